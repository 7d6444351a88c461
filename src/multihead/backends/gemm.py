"""oneDNN's float32 GEMM as torch exposes it, for the projections and the torch-only kernels.

Notation: M, N, K the GEMM's sizes (x (M, K) · wᵀ with w (N, K)).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["MatMul", "onednn_available", "gemm_for", "mm_nt"]

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
    """Whether float32 GEMMs run on oneDNN (else on ``torch.matmul``)."""
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
    op = _onednn_linear()
    if op is not None and x.dtype == torch.float32 and x.device.type == "cpu" and torch.backends.mkldnn.enabled:
        empty: list[float] = []
        return lambda a, w: op(a, w, None, "none", empty, "")
    return _matmul_nt


def mm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x · wᵀ``: x (M, K), w (N, K) -> (M, N), with :func:`gemm_for` ``x``'s GEMM."""
    return gemm_for(x)(x, w)
