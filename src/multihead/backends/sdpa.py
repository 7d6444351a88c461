"""Backend ``"sdpa"``: torch's fused ``scaled_dot_product_attention``.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim.

Differentiable, with dropout, any dtype and device; no weights, no log-sum-exp. ALiBi,
an additive ``bias`` (differentiable: SDPA's backward gives the float mask's gradient) and
sinks go in exactly through an additive float mask (a sink is one more key of zeros whose
bias is the sink logit: its score is exactly ``sink_h``, its value adds nothing);
soft-capping and score_mods, functions of the score itself, cannot and are refused.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..logits import NO_FEATURES, Features, alibi_bias, sink_column
from ..masks import full_mask
from .registry import register_backend

__all__ = ["sdpa_attention"]


@register_backend("sdpa", grad=True, dropout=True, alibi=True, sinks=True, bias=True)
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
    features: Features = NO_FEATURES,
) -> tuple[torch.Tensor, None, None]:
    """torch's fused ``scaled_dot_product_attention``; ALiBi, an additive bias and sinks
    (``features``) as an additive float mask (-inf where masked; a row with no key gives zeros).

    SDPA's ``is_causal`` is top-left aligned, so it is only used when Sq == Sk (where
    both alignments agree) and no other mask is given; otherwise the bottom-right
    causal mask is built and passed as ``attn_mask``.
    """
    if features is not NO_FEATURES and (features.alibi_slopes is not None or features.sinks is not None
                                        or features.has_bias()):
        return _with_bias(q, k, v, mask, causal, window, scale, dropout_p, features), None, None
    qs, ks = q.shape, k.shape
    sq, sk = qs[2], ks[2]
    gqa = qs[1] != ks[1]
    if mask is None and window is None and (not causal or sq == sk):
        # Bidirectional on the CPU without autograd: a zero additive bias keeps a NaN query row NaN
        # (the unmasked kernel returns zeros there) for less than a check of q would cost; + 0 is exact.
        bias = _zero_bias(q) if not causal and not torch.compiler.is_compiling() else None
        if not gqa and scale == 1.0 / math.sqrt(qs[3]):
            # SDPA's own default scale (the same double): the same numbers, and no keywords for
            # torch to parse (a microsecond of a small call).
            out = F.scaled_dot_product_attention(q, k, v, bias, dropout_p, causal)
        elif bias is not None:
            out = F.scaled_dot_product_attention(q, k, v, bias, dropout_p, scale=scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
            )
        return (out if bias is not None else _nan_rows_kept(q, out, sk)), None, None
    combined = full_mask(mask, causal, window, sq, sk, q.device)
    # torch >= 2.5 returns zeros for rows with no allowed key (its _safe_softmax).
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=combined, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )
    return _empty_rows_zero(q, out, combined), None, None


_ZERO_BIAS: dict[torch.dtype, torch.Tensor] = {}


def _zero_bias(q: torch.Tensor) -> torch.Tensor | None:
    """A (1, 1, 1, 1) zero of q's dtype, made once per dtype, for a CPU call without autograd
    (with gradients SDPA's backward would take another kernel: the check of q is used there)."""
    if not q.is_cpu or (q.requires_grad and torch.is_grad_enabled()):
        return None
    zero = _ZERO_BIAS.get(q.dtype)
    if zero is None:
        zero = _ZERO_BIAS[q.dtype] = torch.zeros((1, 1, 1, 1), dtype=q.dtype)
    return zero


def _may_hold_nan(q: torch.Tensor) -> bool:
    """Whether q may hold a NaN: one sum decides in eager mode (an overflow to inf only costs the
    exact masking after it); a compiled graph always takes the exact, branch-free masking."""
    return torch.compiler.is_compiling() or math.isnan(float(q.detach().sum()))


def _nan_rows_kept(q: torch.Tensor, out: torch.Tensor, sk: int) -> torch.Tensor:
    """NaN in, NaN out, as the reference and every other backend: torch's unmasked CPU kernel
    returns zeros for a query row holding a NaN (its row maximum skips NaN scores).

    q (B, H, Sq, D), out (B, H, Sq, Dv); :func:`_may_hold_nan` decides whether to look.
    """
    if sk == 0 or q.device.type != "cpu" or not _may_hold_nan(q):  # the CPU kernel's habit; no device sync
        return out
    return out.masked_fill(q.isnan().any(dim=-1, keepdim=True), math.nan)  # (B, H, Sq, 1) over Dv


def _empty_rows_zero(q: torch.Tensor, out: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """A query that may attend to nothing outputs zeros even when it holds a NaN (SDPA's
    masked softmax gives zeros for such a row, but NaN once its scores are NaN).

    ``allowed``: bool broadcastable to (B, H, Sq, Sk), or None (no row is empty).
    """
    if allowed is None or q.device.type != "cpu" or not _may_hold_nan(q):
        return out
    return out.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)  # (B|1, H|1, Sq, 1)


def _with_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
               window: int | None, scale: float, dropout_p: float, features: Features) -> torch.Tensor:
    """SDPA with ALiBi, the bias and/or sinks (``features``) as an additive float mask (-inf where
    masked)."""
    alibi_slopes, sinks = features.alibi_slopes, features.sinks
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    work = torch.promote_types(q.dtype, torch.float32) if q.dtype != torch.float64 else q.dtype
    bias = torch.zeros(1, 1, sq, sk, dtype=work, device=q.device)  # (1, 1, Sq, Sk)
    if alibi_slopes is not None:
        bias = bias + alibi_bias(alibi_slopes, sq, sk, work)[None]  # (1, H, Sq, Sk)
    extra = features.dense_bias(sq, sk)  # bias and relative: (B|1, H|1, Sq, Sk)
    if extra is not None:
        bias = bias + extra.to(work)
    combined = full_mask(mask, causal, window, sq, sk, q.device)
    if combined is not None:
        bias = bias.masked_fill(~combined, float("-inf"))
    bias = bias.expand(b, h, sq, sk)  # (B, H, Sq, Sk)
    if sinks is not None:
        bias = torch.cat((bias, sink_column(sinks, b, sq, work)), dim=-1)  # (B, H, Sq, Sk + 1)
        zeros = k.new_zeros(b, k.shape[1], 1, k.shape[3])
        k, v = torch.cat((k, zeros), dim=2), torch.cat((v, v.new_zeros(b, v.shape[1], 1, v.shape[3])), dim=2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout_p, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out if sinks is not None else _empty_rows_zero(q, out, combined)  # a sink is a key every row sees
