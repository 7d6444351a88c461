"""The functional core: scaled dot-product attention over heads, in PyTorch's layout.

Notation: B batch, H query heads, Hkv key/value heads, G = H // Hkv, Sq queries,
Sk keys, D head dim (Dv for values).

Each head k computes ``softmax(Q_k K_kᵀ · scale) V_k`` (the seed's
``V_k · softmax(Q_kᵀ K_k / √d_head)ᵀ`` transposed into [tokens, features]); heads never
share attention matrices. The default scale is ``1/√D``, the head's width, not the
model's.

GQA / MQA: with Hkv < H, query heads are split into Hkv consecutive groups of G; query
head i reads K/V head ``i // G`` (the grouping of Llama checkpoints and of
``repeat_kv``). K and V are never repeated in memory::

    query heads   0 1 2 3 | 4 5 6 7      (H = 8)
    K/V heads        0    |    1         (Hkv = 2, G = 4)
"""

from __future__ import annotations

import math
from typing import Any

from typing import Literal, overload

import torch

from ._checks import check_finite as _check_finite
from ._checks import check_bool_mask, check_float, check_float_tensor, check_int, check_like, check_tensor

from .backends import resolve_backend
from .backends.registry import get_spec, place_segments
from .logits import Features
from .masks import check_cu_seqlens

__all__ = ["attention", "DEFAULT_BACKEND", "default_backend"]

#: Backend used when ``backend=None`` and no weights are asked for.
DEFAULT_BACKEND = "auto"
#: Backend used when ``return_weights=True`` and ``backend=None``.
WEIGHTS_BACKEND = "explicit"


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              mask: torch.Tensor | None = None, window: int | None = None, scale: float | None = None,
              dropout_p: float = 0.0, return_weights: Literal[False] = False, return_lse: Literal[False] = False,
              backend: str | None = None, check_finite: bool = False,
              softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              mask: torch.Tensor | None = None, window: int | None = None, scale: float | None = None,
              dropout_p: float = 0.0, return_weights: bool = False, return_lse: bool = False,
              backend: str | None = None, check_finite: bool = False,
              softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
              ) -> torch.Tensor | tuple[torch.Tensor, ...]: ...
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
    check_finite: bool = False,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Multi-head scaled dot-product attention.

    Args:
        q: (B, H, Sq, D) queries.
        k: (B, Hkv, Sk, D) keys; Hkv must divide H (GQA; Hkv = 1 is MQA).
        v: (B, Hkv, Sk, Dv) values.
        causal: mask future keys, aligned **bottom-right**: query i sits at position
            ``i + Sk - Sq`` and sees keys up to it (the decoding convention; SDPA's
            ``is_causal`` aligns top-left, they agree when Sq == Sk).
        mask: bool, broadcastable to (B, H, Sq, Sk); **True = may attend** (as in
            torch's scaled_dot_product_attention; ``torch.nn.MultiheadAttention`` uses
            True = ignore: convert with :func:`multihead.masks.from_torch_mha`).
            Combined with ``causal`` and ``window`` by logical and.
        window: sliding window: with ``causal`` each query sees itself and the
            ``window - 1`` keys before it (Mistral's convention); without ``causal``
            keys closer than ``window`` positions on either side.
        scale: multiplies the logits; default ``1/√D``.
        dropout_p: dropout on the attention probabilities (pass 0 in eval).
        return_weights: also return the per-head attention weights, never averaged.
        return_lse: also return the per-row log-sum-exp of the scaled, masked scores,
            ``lse[b, h, i] = log Σ_j exp(scale · q_i·k_j)`` over the keys row i may see
            (float32, or float64 for float64 inputs; ``-inf`` for a row with no key), as
            FlashAttention does: partial results over disjoint key sets merge exactly by it.
        backend: a name from :func:`multihead.backends.available_backends`; default
            ``"auto"`` (:mod:`multihead.backends.auto`: its rules pick the fast CPU
            kernel for inference, SDPA when gradients or dropout are needed), or
            ``"explicit"`` when ``return_weights`` is set. All give the same numbers
            within rounding. A named backend that cannot do what the call asks
            (gradients, weights, lse, a dtype, a device) raises ``ValueError`` naming
            it; it never runs another backend instead.
        check_finite: raise if q, k or v hold NaN or Inf, naming the tensor and the
            first bad index (costs one pass over the inputs; off by default).
        softcap: logit soft-capping ``cap · tanh(s / cap)`` after scaling, before masking
            (Gemma 2; flash-attn's ``softcap``); None = off.
        alibi_slopes: (H,) float: ALiBi, ``-slope_h · |i + Sk - Sq - j|`` added to the
            logits (BLOOM, MPT; :func:`multihead.logits.alibi_slopes` gives the standard ones).
        sinks: (H,) float: one learned logit per head that joins every row's softmax and
            takes probability from the keys (gpt-oss); differentiable where the backend is.
            Not with ``return_lse`` (a merged partial result would count the sink twice).
        cu_seqlens: (N+1,) integer cumulative lengths ``0 = c_0 <= ... <= c_N = S`` of N
            sequences packed along the tokens (flash-attn's varlen layout, here within each
            of the B rows; or (B, N+1), one packing per row): token t attends only to tokens
            of its own sequence (and, with ``causal``/``window``, by position inside it).
            Needs Sq == Sk. A backend declaring ``varlen`` (``"native"``, and ``"auto"``
            on its native paths) takes it as structure and computes no score across
            sequences; every other gets a block-diagonal mask (dense FLOPs).
        See :mod:`multihead.logits` for the order of these steps.

    Returns:
        out (B, H, Sq, Dv); with ``return_weights`` and/or ``return_lse`` a tuple
        ``(out, weights (B, H, Sq, Sk), lse (B, H, Sq))`` holding the ones asked for, in
        that order. A query that may attend to no key outputs zeros (and zero weights,
        zero gradients, lse ``-inf``), never NaN.

    Raises:
        TypeError: non-tensors, non-float q/k/v, mismatched dtypes, non-bool mask.
        ValueError: wrong ranks or sizes, H not divisible by Hkv, mismatched devices,
            bad mask shape, window < 1, dropout_p outside [0, 1), unknown backend,
            a backend without a capability the call needs, non-finite inputs with
            ``check_finite``.
    """
    mask, scale, dropout_p = _validate(q, k, v, mask, window, scale, dropout_p)
    features = _validate_features(q, k, softcap, alibi_slopes, sinks, return_lse)._replace(
        cu_seqlens=_check_segments(cu_seqlens, q, k))
    name = default_backend(backend, return_weights)
    fn = resolve_backend(name, q, k, v, dropout_p=dropout_p, return_weights=return_weights,
                         return_lse=return_lse, features=features)
    features, mask = place_segments(get_spec(name), q, k, v, features, mask)  # structure, or a mask
    if check_finite:
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_finite(name, t)
    out, weights, lse = fn(
        q, k, v,
        mask=mask, causal=bool(causal), window=window, scale=scale,
        dropout_p=dropout_p, return_weights=return_weights, return_lse=return_lse, features=features,
    )
    extra = [t for t, asked in ((weights, return_weights), (lse, return_lse)) if asked and t is not None]
    return (out, *extra) if extra else out


def _validate(q_in: object, k_in: object, v_in: object, mask: object, window: object, scale: object,
              dropout_p: object) -> tuple[torch.Tensor | None, float, float]:
    """Every check of :func:`attention`, once: returns the mask as a 4-D view, scale, dropout_p."""
    q = check_tensor("q", q_in, ndim=4)
    k = check_tensor("k", k_in, ndim=4)
    v = check_tensor("v", v_in, ndim=4)
    check_float_tensor("q", q)
    check_like("k", k, "q", q)
    check_like("v", v, "q", q)
    b, h, sq, d = q.shape
    _, hkv, sk, _ = k.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"q, k and v must share the batch size, got q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[-1] != d:
        raise ValueError(f"k must have head dim {d} like q [B, Hkv, Sk, D], got {k.shape[-1]} (shape {list(k.shape)})")
    if v.shape[1] != hkv or v.shape[2] != sk:
        raise ValueError(
            f"v must have shape [B, Hkv, Sk, Dv] = [{b}, {hkv}, {sk}, Dv] like k, got {list(v.shape)}"
        )
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"the number of query heads ({h}) must be a multiple of the number of K/V heads ({hkv})")
    mask4 = None
    if mask is not None:
        mask4 = check_bool_mask("mask", mask, (b, h, sq, sk), "[B, H, Sq, Sk]")
        if mask4.device != q.device:
            raise ValueError(f"mask must be on device {q.device} like q, got {mask4.device}")
        mask4 = mask4[(None,) * (4 - mask4.dim())]  # (B|1, H|1, Sq|1, Sk|1): one rank for every backend
    if window is not None:
        check_int("window", window)
    if scale is None:
        scale_f = 1.0 / math.sqrt(d)
    else:
        scale_f = check_float("scale", scale, low=0.0, high=math.inf, low_inclusive=False, high_inclusive=False)
    p = check_float("dropout_p", dropout_p, low=0.0, high=1.0, high_inclusive=False)
    return mask4, scale_f, p


def _validate_features(q: torch.Tensor, k: torch.Tensor, softcap: object, alibi_slopes: object, sinks: object,
                       return_lse: bool) -> Features:
    """The logit features asked for (see :mod:`multihead.logits`), checked."""
    h = q.shape[1]
    features: dict[str, Any] = {}
    if softcap is not None:
        features["softcap"] = check_float("softcap", softcap, low=0.0, high=math.inf, low_inclusive=False,
                                          high_inclusive=False)
    for name, given in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if given is None:
            continue
        value = check_tensor(name, given, ndim=1)
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor [H], got dtype {value.dtype}")
        if value.shape[0] != h:
            raise ValueError(f"{name} must have shape [H] = [{h}], got {list(value.shape)}")
        if value.device != q.device:
            raise ValueError(f"{name} must be on device {q.device} like q, got {value.device}")
        features[name] = value
    if sinks is not None and return_lse:
        raise ValueError("return_lse=True is not supported with sinks: the sink joins each row's softmax once, "
                         "so log-sum-exps of partial results would count it once per part")
    return Features(**features)


def _check_segments(cu_seqlens: object, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``cu_seqlens`` checked ((N+1,) or (B, N+1), rising from 0 to S, Sq == Sk), or None."""
    if cu_seqlens is None:
        return None
    s = q.shape[2]
    if k.shape[2] != s:
        raise ValueError(f"cu_seqlens needs as many keys as queries (packed self-attention), got Sq={s}, "
                         f"Sk={k.shape[2]}")
    return check_cu_seqlens(cu_seqlens, s, batch=q.shape[0])


def default_backend(backend: str | None, return_weights: bool) -> str:
    """``backend``, or the default for the call: "explicit" for weights, else "auto"."""
    if backend is None:
        return WEIGHTS_BACKEND if return_weights else DEFAULT_BACKEND
    return backend
