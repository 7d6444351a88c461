"""oneDNN's float32 GEMM as torch exposes it, for the projections and the torch-only kernels.

Notation: M, N, K the GEMM's sizes (x (M, K) · wᵀ with w (N, K)).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MatMul", "onednn_available", "gemm_for", "mm_nt", "onednn_linear_op", "compiled_onednn"]

MatMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def _onednn_linear() -> Callable[..., torch.Tensor] | None:
    """oneDNN's fp32 GEMM as exposed by torch (the op Inductor uses), or None."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):  # a torch built without it
        return None


def onednn_available() -> bool:
    """Whether float32 GEMMs run on oneDNN (else on ``torch.matmul``).

    False while ``torch.compile`` traces: Inductor cannot lower the oneDNN op that
    eager mode calls, and picks its own GEMMs for ``torch.matmul``."""
    if torch.compiler.is_compiling():
        return False
    # torch's stub declares the module attribute as its ContextProp descriptor; it reads a bool.
    return _onednn_linear() is not None and torch.backends.mkldnn.enabled  # type: ignore[return-value]


def _matmul_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w.transpose(0, 1))


def gemm_for(x: torch.Tensor) -> MatMul:
    """The GEMM ``(x, w) -> x · wᵀ`` to use for tensors like ``x``, chosen once per call.

    oneDNN for float32 CPU tensors when available (and not disabled through
    ``torch.backends.mkldnn``), else ``torch.matmul``. oneDNN needs ``w`` with contiguous
    rows or a plain transpose of such a matrix: a row-strided ``w`` is copied slowly
    inside it, so callers pass contiguous K/V rows.
    """
    op = None if torch.compiler.is_compiling() else _onednn_linear()
    if op is not None and x.dtype == torch.float32 and x.device.type == "cpu" and torch.backends.mkldnn.enabled:
        empty: list[float] = []
        return lambda a, w: op(a, w, None, "none", empty, "")
    return _matmul_nt


def mm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x · wᵀ``: x (M, K), w (N, K) -> (M, N), with :func:`gemm_for` ``x``'s GEMM."""
    return gemm_for(x)(x, w)


@torch.compiler.assume_constant_result  # a traced graph takes it as a constant
def compiled_onednn() -> bool:
    """Whether traced graphs may call :func:`onednn_linear_op` (oneDNN is there and enabled)."""
    return _onednn_linear() is not None and torch.backends.mkldnn.enabled  # type: ignore[return-value]


@torch.library.custom_op("multihead::linear", mutates_args=())
def onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x · weightᵀ + bias`` on oneDNN's GEMM, as an operator ``torch.compile`` keeps opaque.

    Inductor cannot lower torch's ``mkldnn._linear_pointwise`` and its own GEMM for
    ``F.linear`` is MKL's (AVX2 on AMD CPUs, about half oneDNN's rate), so compiled
    layers call this instead. x: (..., in) float32 CPU; weight (out, in); bias (out,) or None.
    """
    op = _onednn_linear()
    if op is None:
        raise RuntimeError("oneDNN's linear is not available in this torch build")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (N, in)
    return op(x2, weight.contiguous(), bias, "none", [], "").view(*x.shape[:-1], weight.shape[0])


@onednn_linear_op.register_fake
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x, weight = ctx.saved_tensors
    gy2 = gy.reshape(-1, gy.shape[-1])  # (N, out)
    gx = onednn_linear_op(gy, weight.t().contiguous(), None)  # gy · w   (..., in)
    gw = onednn_linear_op(gy2.t().contiguous(), x.reshape(-1, x.shape[-1]).t().contiguous(), None)  # gyᵀ · x
    return gx, gw, gy2.sum(0) if ctx.has_bias else None


onednn_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)
