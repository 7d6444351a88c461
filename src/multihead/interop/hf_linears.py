"""A patched model's other linear layers (MLPs, the LM head) on multihead's few-row kernel.

While a model decodes, each token reads all its weights once, and most of them are not the
attention's: in a 0.5B Llama, the MLPs hold 77% of each layer's weights and the LM head a third
of the whole. :func:`patch_linears` gives every plain ``nn.Linear`` of a model (outside the
modules multihead already runs) the few-row path of :func:`multihead.linear.few_rows`: calls of
at most :data:`multihead.backends.native.MAX_STEP_ROWS` rows without autograd run on the native
kernel; every other call is ``nn.Linear``'s own forward, unchanged.

The module keeps its parameters, its state dict and ``isinstance(m, nn.Linear)``: only its class
becomes :class:`FewRowLinear`, a subclass with that forward. Subclasses of ``nn.Linear``
(quantized, LoRA and other adapters' layers) keep their own forward and are left as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from ..linear import few_rows

__all__ = ["FewRowLinear", "patch_linears", "unpatch_linears", "linears_to_patch"]


class FewRowLinear(nn.Linear):
    """``nn.Linear`` whose calls of few rows without autograd run on the native few-row kernel
    (:func:`multihead.linear.few_rows`); the same parameters and state dict."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's own name
        """``input · weightᵀ + bias``: (..., in_features) -> (..., out_features)."""
        few = few_rows(input, [(self.weight, self.bias)])
        return super().forward(input) if few is None else few[0]


def linears_to_patch(model: nn.Module, skip: tuple[type[nn.Module], ...] = ()) -> list[str]:
    """The names of ``model``'s plain ``nn.Linear`` modules (their class exactly ``nn.Linear``)
    outside modules of the types in ``skip``, in model order."""
    found: list[str] = []
    skipped: list[str] = []
    for name, module in model.named_modules():
        if skipped and any(name.startswith(prefix) for prefix in skipped):
            continue
        if isinstance(module, skip):
            skipped.append(f"{name}.")
        elif type(module) is nn.Linear:
            found.append(name)
    return found


def patch_linears(model: nn.Module, names: list[str]) -> None:
    """Turn the ``nn.Linear`` modules at ``names`` (from :func:`linears_to_patch`) into
    :class:`FewRowLinear`, in place."""
    for name in names:
        module = model.get_submodule(name)
        if type(module) is not nn.Linear:
            raise TypeError(f"{name} must be a torch.nn.Linear, got {type(module).__name__}")
    for name in names:  # only now, so that a refusal above leaves the model untouched
        _set_class(model.get_submodule(name), FewRowLinear)


def unpatch_linears(model: nn.Module) -> int:
    """Give every :class:`FewRowLinear` of ``model`` its ``nn.Linear`` class back; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is FewRowLinear:
            _set_class(module, nn.Linear)
            count += 1
    return count


def _set_class(module: nn.Module, cls: type[nn.Module]) -> None:
    """Give ``module`` the class ``cls`` (nn.Linear or its subclass, same attributes)."""
    module.__class__ = cls
