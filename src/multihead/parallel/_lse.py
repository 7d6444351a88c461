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
        lse (B, H, Sq) in float32 or wider (-inf on those rows). The core returns lse in
        float32; for float64 inputs a float32 lse would put ~1e-7 into every merge, so it is
        recomputed here in float64 (:func:`_lse_wide`).
    """
    out, lse = _functional.attention(q, k, v, causal=causal, window=window, mask=mask, scale=scale,
                                     return_lse=True)
    if lse.dtype != work_dtype(q.dtype):
        lse = _lse_wide(q, k, causal=causal, window=window, mask=mask, scale=scale)
    return out, lse


def _lse_wide(q: torch.Tensor, k: torch.Tensor, *, causal: bool, window: int | None,
              mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """(B, H, Sq) log-sum-exp of the masked scaled scores in ``work_dtype(q.dtype)``, a chunk of
    queries at a time (scratch about a quarter of q's bytes); -inf where no key is visible."""
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = h // hkv
    work = work_dtype(q.dtype)
    lse = torch.empty(b, h, sq, dtype=work, device=q.device)
    chunk = max(1, min(sq, (sq * d) // max(1, 4 * sk)))
    keys = k.to(work)
    for lo in range(0, sq, chunk):
        hi = min(sq, lo + chunk)
        qc = q[:, :, lo:hi].to(work).reshape(b, hkv, g, hi - lo, d)  # (B, Hkv, G, c, D)
        s = torch.einsum("bkgqd,bksd->bkgqs", qc, keys).reshape(b, h, hi - lo, sk) * scale  # (B, H, c, Sk)
        rows = torch.arange(lo, hi, device=q.device)[:, None] + (sk - sq)  # bottom-right query positions
        off = torch.arange(sk, device=q.device)[None, :] - rows  # (c, Sk): key j - query position
        allowed = torch.ones(hi - lo, sk, dtype=torch.bool, device=q.device)
        if causal:
            allowed = allowed & (off <= 0)
        if window is not None:
            allowed = allowed & (off > -window) & ((off < window) if not causal else True)
        full = allowed.expand(b, h, hi - lo, sk)
        if mask is not None:
            full = full & mask.expand(b, h, sq, sk)[:, :, lo:hi]
        lse[:, :, lo:hi] = torch.logsumexp(s.masked_fill(~full, float("-inf")), dim=-1)
    return lse


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
