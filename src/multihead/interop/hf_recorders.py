"""``output_attentions`` on patched models: transformers 5's recording hooks on the wrappers.

Transformers 5 collects each layer's attention weights with hooks that a ``PreTrainedModel``
installs on its attention classes (its ``_can_record_outputs``). :func:`multihead.hf.patch`
replaces those modules, so :func:`record_like_the_original` installs the same hooks on each
wrapper, and :func:`restore_recording` gives the originals theirs after
:func:`multihead.hf.unpatch` where transformers installed its hooks while the model was patched.

This module imports transformers lazily: ``import multihead`` never imports it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .hf_wrappers import PatchedAttention

__all__ = ["record_like_the_original", "restore_recording"]


def record_like_the_original(model: nn.Module, name: str, wrapper: PatchedAttention) -> None:
    """Install on ``wrapper`` the recording hooks transformers would install on the module it
    replaced (``_can_record_outputs`` of the nearest ``PreTrainedModel``: ``attentions`` and
    ``cross_attentions`` at output index 1, matched by class or class name and layer name),
    so ``output_attentions=True`` collects the wrapper's weights; ``wrapper.records`` names them."""
    found = _recorded_parts(model, name, wrapper.original)
    if not found:
        return
    from transformers.utils.output_capturing import install_output_capuring_hook

    owner = _owner_model(model, name)
    installed = bool(getattr(owner, "_output_capturing_hooks_installed", False))
    wrapper.records = tuple(dict.fromkeys(key for key, _, _, _ in found))
    wrapper.__dict__["_recorders_were_installed"] = installed
    # A rule matching by module name (Informer's "self_attn") matches the wrapper at that name too:
    # transformers hooks it itself when it installs its hooks, later; only a rule by class is ours.
    keys = {key for key, _, _, by_name in found if installed or not by_name}
    target = getattr(wrapper, "recorder", wrapper)  # the module that returns (y, weights)
    for key in sorted(keys):
        install_output_capuring_hook(target, key, 1)


def restore_recording(model: nn.Module, name: str, wrapper: PatchedAttention) -> None:
    """After :func:`multihead.hf.unpatch`: transformers installs its recording hooks once per model; if that
    happened while patched, the original modules never got theirs: install them now."""
    owner = _owner_model(model, name)
    if wrapper.__dict__.get("_recorders_were_installed", True) or not getattr(
            owner, "_output_capturing_hooks_installed", False):
        return
    from transformers.utils.output_capturing import install_output_capuring_hook

    for key, sub, index, _ in _recorded_parts(model, name, wrapper.original):
        install_output_capuring_hook(wrapper.original.get_submodule(sub), key, index)


def _owner_model(model: nn.Module, name: str) -> nn.Module | None:
    """The nearest transformers ``PreTrainedModel`` holding the module at ``name`` (its recording
    rules apply there), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    owner = None
    parts = name.split(".")
    for depth in range(len(parts)):
        candidate = model.get_submodule(".".join(parts[:depth])) if depth else model
        if isinstance(candidate, PreTrainedModel):
            owner = candidate
    return owner


def _recorded_parts(model: nn.Module, name: str, original: nn.Module) -> list[tuple[str, str, int, bool]]:
    """(key, submodule name inside ``original``, output index, matched by module name alone) for
    each weights recorder of the owner model that matches ``original`` or one of its submodules
    (BERT records ``.self``)."""
    owner = _owner_model(model, name)
    rules = getattr(type(owner), "_can_record_outputs", None) if owner is not None else None
    if not rules:
        return []
    found = []
    for key, entries in rules.items():
        if "hidden_states" in key:
            continue  # the layers' outputs, never an attention module's weights
        for entry in entries if isinstance(entries, list) else [entries]:
            target, index, layer_name, class_name = _recorder_fields(entry)
            for sub, module in original.named_modules():
                module_name = f".{name}" + (f".{sub}" if sub else "")
                by_class = target is not None and isinstance(module, target)
                by_name = class_name is not None and module_name.endswith(class_name)
                if ((by_class or by_name)
                        and (layer_name is None or f".{layer_name.strip('.')}." in module_name + ".")):
                    found.append((key, sub, index, by_name and not by_class and not sub))
                    break
    return found


def _recorder_fields(entry: Any) -> tuple[type | None, int, str | None, str | None]:
    """(target class, output index, layer name, class name) of one ``_can_record_outputs`` entry:
    an ``OutputRecorder``, a class, or a class name (transformers' own reading of them)."""
    if isinstance(entry, str):
        return None, 1, None, entry
    if isinstance(entry, type):
        return entry, 1, None, None
    return (getattr(entry, "target_class", None), int(getattr(entry, "index", 1)), getattr(entry, "layer_name", None),
            getattr(entry, "class_name", None))
