"""Backend ``"sdpa"``: torch's fused ``scaled_dot_product_attention``.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim.

Differentiable, with dropout, any dtype and device; no weights, no log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..masks import full_mask
from .registry import register_backend

__all__ = ["sdpa_attention"]


@register_backend("sdpa", grad=True, dropout=True)
def sdpa_attention(
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
) -> tuple[torch.Tensor, None, None]:
    """torch's fused ``scaled_dot_product_attention``.

    SDPA's ``is_causal`` is top-left aligned, so it is only used when Sq == Sk (where
    both alignments agree) and no other mask is given; otherwise the bottom-right
    causal mask is built and passed as ``attn_mask``.
    """
    sq, sk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if mask is None and window is None and (not causal or sq == sk):
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
        )
        return out, None, None
    combined = full_mask(mask, causal, window, sq, sk, q.device)
    # torch >= 2.5 returns zeros for rows with no allowed key (its _safe_softmax).
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=combined, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )
    return out, None, None
