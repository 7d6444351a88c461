"""Attention backends behind one signature, chosen by name.

Notation: B batch, H query heads, Hkv key/value heads, G = H // Hkv queries per K/V
head, Sq queries, Sk keys, D head dim (Dv for values).

Every backend is a callable::

    backend(q, k, v, *, mask, causal, window, scale, dropout_p, return_weights)
        -> (out (B, H, Sq, Dv), weights (B, H, Sq, Sk) or None)

receiving arguments already validated by :func:`multihead.attention`. ``mask`` is the
caller's bool mask (True = may attend) or None; ``causal`` and ``window`` are passed
separately so that each backend can use its kernel's own causal support and keep its
quirks (SDPA's top-left causal alignment) to itself. A query row that may attend to
nothing returns zeros.

Registered here:

* ``"sdpa"``: torch's fused ``scaled_dot_product_attention`` (no weights).
* ``"explicit"``: scores, softmax and the weighted sum written out, float32 or wider
  softmax; the only one that returns weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from .masks import _offsets

__all__ = ["Backend", "register_backend", "get_backend", "resolve_backend", "available_backends", "full_mask"]


class Backend(Protocol):
    def __call__(
        self,
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
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


_BACKENDS: dict[str, Backend] = {}


_WEIGHTS: set[str] = set()  # backends that can return attention weights


def register_backend(name: str, fn: Backend | None = None, *, weights: bool = False
                     ) -> Callable[[Backend], Backend] | Backend:
    """Register ``fn`` under ``name`` (usable as a decorator). Re-registering replaces.

    Args:
        name: the name users pass as ``backend=``.
        fn: the backend; omit to use as a decorator.
        weights: whether it returns weights when asked (checked before it is called).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")

    def deco(f: Backend) -> Backend:
        _BACKENDS[name] = f
        (_WEIGHTS.add if weights else _WEIGHTS.discard)(name)
        return f

    return deco if fn is None else deco(fn)


def available_backends() -> tuple[str, ...]:
    """Names of the registered backends."""
    return tuple(_BACKENDS)


def resolve_backend(name: str, return_weights: bool) -> Backend:
    """The backend ``name``, checked to return weights if they are asked for.

    Raises:
        ValueError: unknown name, or a backend that returns no weights asked for them.
    """
    fn = get_backend(name)
    if return_weights and name not in _WEIGHTS:
        raise ValueError(f"backend {name!r} cannot return weights; use one of {sorted(_WEIGHTS)} "
                         "(the default picks 'explicit' when return_weights=True)")
    return fn


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    try:
        return _BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {name!r}") from None


def full_mask(
    mask: torch.Tensor | None,
    causal: bool,
    window: int | None,
    sq: int,
    sk: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Combine the caller's mask with bottom-right causal and window masks.

    Returns:
        bool mask broadcastable to (B, H, Sq, Sk), or None when nothing is masked.
    """
    if causal or window is not None:
        off = _offsets(sq, sk, device)  # (Sq, Sk)
        structural = off <= 0 if causal else torch.ones_like(off, dtype=torch.bool)
        if window is not None:
            # A window looks back ``window - 1`` keys; without causal it is symmetric.
            structural = structural & (off > -window)
            if not causal:
                structural = structural & (off < window)
        mask = structural if mask is None else mask & structural
    return mask


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Softmax in float32 at least: half-precision logits overflow and lose mass.
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


@register_backend("explicit", weights=True)
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(q kᵀ · scale) v, written out, with GQA by grouping (no repeat of K/V)."""
    b, h, sq, _ = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    acc = _accumulation_dtype(q.dtype)
    if sk == 0 or sq == 0:  # nothing to attend to: zeros, as for a fully masked row
        out = q.new_zeros(b, h, sq, dv)
        return out, (q.new_zeros(b, h, sq, sk) if return_weights else None)
    qg = q.to(acc).reshape(b, hkv, g * sq, q.shape[-1])  # (B, Hkv, G·Sq, D): query heads of one group stacked
    scores = torch.matmul(qg, k.to(acc).transpose(-1, -2)) * scale  # (B, Hkv, G·Sq, Sk)
    scores = scores.view(b, h, sq, sk)  # (B, H, Sq, Sk)
    combined = full_mask(mask, causal, window, sq, sk, q.device)
    if combined is not None:
        scores = scores.masked_fill(~combined, float("-inf"))
    weights = safe_softmax(scores)  # (B, H, Sq, Sk)
    probs = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = torch.matmul(probs.view(b, hkv, g * sq, sk), v.to(acc))  # (B, Hkv, G·Sq, Dv)
    out = out.view(b, h, sq, dv).to(q.dtype)  # (B, H, Sq, Dv)
    return out, (weights.to(q.dtype) if return_weights else None)


@register_backend("sdpa")
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        return out, None
    combined = full_mask(mask, causal, window, sq, sk, q.device)
    # torch >= 2.5 returns zeros for rows with no allowed key (its _safe_softmax).
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=combined, dropout_p=dropout_p, scale=scale, enable_gqa=gqa
    )
    return out, None
