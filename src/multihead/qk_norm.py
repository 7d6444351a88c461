"""QK-norm: RMSNorm on the queries and keys, before RoPE (or after it).

Notation: B batch, S tokens, H query heads, Hkv key/value heads, D head_dim.

Checkpoints place it in one of three ways:

* ``"head"`` — per head, over D, one weight of D shared by the heads (Qwen3, Gemma 3):
  applied to q (B, H, S, D) and k (B, Hkv, S, D) after the split;
* ``"proj"`` — over the whole projection, one weight of H·D for q and Hkv·D for k
  (OLMo 2): applied to q (B, S, H·D) and k (B, S, Hkv·D) before the split;
* ``"head_after_rope"`` — as ``"head"``, but to the rotated q and k (HunYuan dense): RMSNorm
  with a weight does not commute with the rotation, so the order is the checkpoint's.

Gemma stores the weight as an offset from one (``x · (1 + w)``); ``offset=True`` reads it so.
"""

from __future__ import annotations

import torch
from torch import nn

from ._checks import check_float, check_int

__all__ = ["RMSNorm", "QK_NORMS"]

#: Where the norm applies: per head over D (before or after RoPE), or over the whole projection.
QK_NORMS = ("head", "proj", "head_after_rope")


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · w`` over the last dim, computed in float32 at least.

    Args:
        dim: the normalised width (D, or H·D for ``"proj"``).
        eps: added to the mean square.
        offset: the weight is stored as ``w - 1`` (Gemma): the scale is ``1 + weight``.
        device, dtype: of the weight (ones, or zeros with ``offset``).
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, offset: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dim = check_int("dim", dim)
        self.eps = check_float("eps", eps, low=0.0, high=1.0, low_inclusive=False)
        self.offset = bool(offset)
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(dim, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, offset={self.offset}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., dim) -> (..., dim), same dtype."""
        work = torch.promote_types(x.dtype, torch.float32)
        y = x.to(work)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.weight.to(work)
        return (y * (1.0 + scale if self.offset else scale)).to(x.dtype)
