"""Backend ``"explicit"``: scores, softmax and the weighted sum written out.

Notation: B batch, H query heads, Hkv key/value heads, G = H // Hkv, Sq queries, Sk
keys, D head dim (Dv for values).

The only backend that returns the attention weights; differentiable, any dtype and
device; softmax in float32 at least.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..logits import NO_FEATURES, Features, alibi_bias, sink_column, soft_cap
from ..masks import full_mask
from ..score_mods import apply_score_mod
from .registry import register_backend

__all__ = ["explicit_attention", "safe_softmax", "accumulation_dtype", "lse_dtype"]

_NEG_INF = float("-inf")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precision (its logits overflow and lose mass), else ``dtype``."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where a row of all ``-inf`` gives zeros, not NaN.

    Max-subtracted; the gradient of an all-masked row is zero.
    """
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(scores - row_max)
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype: float64 for float64 inputs, else float32 (FlashAttention's)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_logsumexp(scores: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim in float32 at least; ``-inf`` for all-masked rows."""
    return torch.logsumexp(scores.to(accumulation_dtype(scores.dtype)), dim=-1).to(lse_dtype(scores.dtype))


@register_backend("explicit", weights=True, lse=True, grad=True, dropout=True, softcap=True, alibi=True, sinks=True,
                  bias=True, score_mod=True)
def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    causal: bool,
    window: int | None,
    scale: float,
    dropout_p: float,
    return_weights: bool,
    return_lse: bool,
    features: Features = NO_FEATURES,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """softmax(q kᵀ · scale) v, written out, with GQA by grouping (no repeat of K/V).

    Soft-capping, ALiBi, an additive bias, a score_mod (any Python callable, evaluated once on
    the (B, H, Sq, Sk) scores: exact, differentiable into what it captures) and sinks
    (``features``) in the order of :mod:`multihead.logits`.
    """
    softcap, alibi_slopes, sinks = features.softcap, features.alibi_slopes, features.sinks
    b, h, sq, _ = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    acc = accumulation_dtype(q.dtype)
    if sk == 0 or sq == 0:  # nothing to attend to: zeros, as for a fully masked row
        out = q.new_zeros(b, h, sq, dv)
        lse = torch.full((b, h, sq), _NEG_INF, dtype=lse_dtype(q.dtype), device=q.device) if return_lse else None
        return out, (q.new_zeros(b, h, sq, sk) if return_weights else None), lse
    qg = q.to(acc).reshape(b, hkv, g * sq, q.shape[-1])  # (B, Hkv, G·Sq, D): query heads of one group stacked
    scores = torch.matmul(qg, k.to(acc).transpose(-1, -2)) * scale  # (B, Hkv, G·Sq, Sk)
    scores = scores.view(b, h, sq, sk)  # (B, H, Sq, Sk)
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, sq, sk, acc)  # (B, H, Sq, Sk)
    extra = features.dense_bias(sq, sk)  # bias and relative: (B|1, H|1, Sq, Sk)
    if extra is not None:
        scores = scores + extra.to(acc)
    if features.score_mod is not None:
        scores = apply_score_mod(features.score_mod, scores)  # (B, H, Sq, Sk)
    combined = full_mask(mask, causal, window, sq, sk, q.device)
    if combined is not None:
        scores = scores.masked_fill(~combined, _NEG_INF)
    if sinks is not None:  # the sink is one more column of the softmax, then dropped
        weights = safe_softmax(torch.cat((scores, sink_column(sinks, b, sq, acc)), dim=-1))[..., :sk]
    else:
        weights = safe_softmax(scores)  # (B, H, Sq, Sk)
    probs = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = torch.matmul(probs.view(b, hkv, g * sq, sk), v.to(acc))  # (B, Hkv, G·Sq, Dv)
    out = out.view(b, h, sq, dv).to(q.dtype)  # (B, H, Sq, Dv)
    lse = masked_logsumexp(scores) if return_lse else None  # (B, H, Sq)
    return out, (weights.to(q.dtype) if return_weights else None), lse
