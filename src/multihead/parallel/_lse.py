"""One block of attention returning (out, lse), and the log-sum-exp merge of blocks.

Notation: B batch, H query heads, Hkv key/value heads, G = H // Hkv, Sq queries,
Sk keys, D head dim (Dv for values).

``lse[b, h, i] = log Σ_j exp(scale · q_i·k_j)`` over the keys query i may see, and
``-inf`` for a row that sees none. Two partial results over disjoint key sets merge as

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b

(FlashAttention's rescaling, between processes instead of tiles). A row with
lse_a = lse_b = -inf keeps out = 0, never NaN.
"""

from __future__ import annotations

import torch

from .. import functional as _functional

__all__ = ["block_attention", "merge_into", "work_dtype"]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: float32 at least (half-precision ring steps would drift)."""
    return torch.promote_types(dtype, torch.float32)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, window: int | None,
                    mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``mh.attention`` of one block with its per-row log-sum-exp (``return_lse=True``).

    Args:
        q: (B, H, Sq, D); k, v: (B, Hkv, Sk, D), (B, Hkv, Sk, Dv).
        causal, window: bottom-right aligned, as in :func:`multihead.attention`.
        mask: bool broadcastable to (B, H, Sq, Sk), True = may attend, or None.
        scale: the logit scale.

    Returns:
        out (B, H, Sq, Dv) in q's dtype (zeros on rows with no visible key) and
        lse (B, H, Sq) in ``work_dtype(q.dtype)`` (the core's: float64 for float64 inputs,
        else float32), -inf on those rows.
    """
    out, lse = _functional.attention(q, k, v, causal=causal, window=window, mask=mask, scale=scale,
                                     return_lse=True)
    return out, lse


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge a block's (out, lse) into the running (acc_out, acc_lse), in place.

    Args:
        acc_out: (B, H, Sq, Dv) in the work dtype; acc_lse: (B, H, Sq).
        out: (B, H, Sq, Dv) the block's output; lse: (B, H, Sq).
    """
    lse = lse.to(acc_lse.dtype)
    new = torch.logaddexp(acc_lse, lse)
    dead = torch.isneginf(new)  # no visible key on either side: both weights 0, not NaN
    w_acc = torch.where(dead, 0.0, torch.exp(acc_lse - new))
    w_new = torch.where(dead, 0.0, torch.exp(lse - new))
    acc_out.mul_(w_acc.unsqueeze(-1)).addcmul_(out.to(acc_out.dtype), w_new.unsqueeze(-1))
    acc_lse.copy_(new)
