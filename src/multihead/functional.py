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
from typing import Any, Literal, NamedTuple, overload

import torch

from ._checks import check_finite as _check_finite
from ._checks import (_broadcastable, check_bool_mask, check_float, check_float_tensor, check_int, check_like,
                      check_tensor)

from ._call_checks import ATTENTION_HABITS, refuse_unexpected
from ._memo import remember
from .backends import auto, resolve_backend
from .backends.registry import Backend, BackendSpec, Prepared, get_spec, place_block_mask, place_segments
from .block_mask import DEFAULT_BLOCK_SIZE, BlockMask, MaskMod
from .logits import NO_FEATURES, Features
from .masks import check_cu_seqlens
from .score_mods import ScoreMod
from .score_mods import lower as lower_score_mod

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
              sinks: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
              mask_mod: MaskMod | None = None, block_mask: BlockMask | None = None,
              bias: torch.Tensor | None = None, score_mod: ScoreMod | None = None) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              mask: torch.Tensor | None = None, window: int | None = None, scale: float | None = None,
              dropout_p: float = 0.0, return_weights: bool = False, return_lse: bool = False,
              backend: str | None = None, check_finite: bool = False,
              softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
              mask_mod: MaskMod | None = None, block_mask: BlockMask | None = None,
              bias: torch.Tensor | None = None, score_mod: ScoreMod | None = None,
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
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    bias: torch.Tensor | None = None,
    score_mod: ScoreMod | None = None,
    **unexpected: Any,
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
            it; it never runs another backend instead. Without logit features or packing,
            the backend (and ``"auto"``'s path) is resolved once per call signature and
            remembered (shapes, dtype, device, gradients, dropout_p, the flags; see
            :func:`multihead.backends.auto.decision`); every argument is checked every call.
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
            sequences; every other gets a block-diagonal mask (dense FLOPs). The order in
            which the logit features apply is :mod:`multihead.logits`'s.
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's signature; True = may
            attend; ``q_idx`` bottom-right aligned, ``i + Sk - Sq``: :mod:`multihead.block_mask`),
            classified for this call's (B, H, Sq, Sk) in tiles of 128 (build it once with
            :meth:`multihead.BlockMask.from_mask_mod` and pass ``block_mask`` to reuse it).
        block_mask: a prebuilt :class:`multihead.BlockMask` for (B|1, H|1, Sq, Sk). A backend
            declaring ``block_mask`` takes its tiles (empty ones skipped); every other gets its
            dense form as a mask. ``mask_mod`` and ``block_mask`` combine with ``mask``,
            ``causal``, ``window``, ``cu_seqlens`` and each other by logical and.
        bias: float broadcastable to (B, H, Sq, Sk): added to the scaled logits after
            soft-capping and ALiBi (:mod:`multihead.logits`; T5's ``position_bias``);
            differentiable. Backends declaring ``bias``: ``"explicit"``, ``"sdpa"``.
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's signature; the
            building blocks of :mod:`multihead.score_mods`, or any Python callable), applied
            after the bias, before masking. Runs on ``"explicit"`` (exact, differentiable into
            the tensors it captures); ``"auto"`` sends it there.
        **unexpected: refused (``TypeError``); torch's keywords (``attn_mask``, ``is_causal``,
            ``key_padding_mask``, ``need_weights``, ``average_attn_weights``, ``enable_gqa``)
            with their equivalents named, mask polarity included.

    Returns:
        out (B, H, Sq, Dv); with ``return_weights`` and/or ``return_lse`` a tuple
        ``(out, weights (B, H, Sq, Sk), lse (B, H, Sq))`` holding the ones asked for, in
        that order. A query that may attend to no key outputs zeros (and zero weights,
        zero gradients, lse ``-inf``), never NaN.

    Raises:
        TypeError: non-tensors, non-float q/k/v, mismatched dtypes, non-bool mask, a keyword
            argument it does not take.
        ValueError: wrong ranks or sizes, H not divisible by Hkv, mismatched devices,
            bad mask shape, window < 1, dropout_p outside [0, 1), unknown backend,
            a backend without a capability the call needs, non-finite inputs with
            ``check_finite``.
    """
    if unexpected:  # only a wrong call pays for this look-up
        raise refuse_unexpected("attention()", unexpected, ATTENTION_HABITS)
    mask, scale, dropout_p, tensors = _validate(q, k, v, mask, window, scale, dropout_p)
    name = default_backend(backend, return_weights)
    if (softcap is None and alibi_slopes is None and sinks is None and cu_seqlens is None and mask_mod is None
            and block_mask is None and bias is None and score_mod is None):
        features = NO_FEATURES  # the common call: nothing to check, its backend remembered
        plan = _plan_for(name, tensors, q, k, v, dropout_p, return_weights, return_lse)
        if plan.fast is not None and not check_finite and type(q) is _Tensor:
            out = plan.fast(q, k, v, scale, bool(causal), window, mask)  # what plan.run would run, made once
            if out is not None:
                return out
        fn = plan.run
    else:
        features = _validate_features(q, k, softcap, alibi_slopes, sinks, return_lse)._replace(
            cu_seqlens=_check_segments(cu_seqlens, q, k), bias=_check_bias(bias, q, k),
            score_mod=_check_score_mod(score_mod), block_mask=_block_mask_for(mask_mod, block_mask, q, k))
        features = lower_score_mod(features, q.shape[2], k.shape[2], q.shape[1])  # building blocks: features
        if features.head_scale is not None:  # score · scale_h: each head's queries times its scale
            q = q * features.head_scale.to(q.dtype)[:, None, None]  # (B, H, Sq, D)
            features = features._replace(head_scale=None)
        fn = resolve_backend(name, q, k, v, dropout_p=dropout_p, return_weights=return_weights,
                             return_lse=return_lse, features=features)
        spec = get_spec(name)
        features, mask = place_segments(spec, q, k, v, features, mask)  # structure, or a mask
        features, mask = place_block_mask(spec, features, mask)  # tiles, or a mask
    if check_finite:
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_finite(name, t)
    out, weights, lse = fn(
        q, k, v,
        mask=mask, causal=bool(causal), window=window, scale=scale,
        dropout_p=dropout_p, return_weights=return_weights, return_lse=return_lse, features=features,
    )
    if not (return_weights or return_lse):
        return out
    extra = [t for t, asked in ((weights, return_weights), (lse, return_lse)) if asked and t is not None]
    return (out, *extra) if extra else out


class _Plan(NamedTuple):
    """What :func:`attention` runs for a call without logit features or packing, remembered per
    signature (:func:`_plan_for`): the backend's spec, the function to call, for ``"auto"`` the
    rules' decision, whose path is called directly, and where the backend (or auto's path)
    prepares one (:attr:`~multihead.backends.registry.BackendSpec.prepare`) and the signature asks
    for no weights, lse, gradient or dropout, the function it made for such a call
    (``fast``: ``(q, k, v, scale, causal, window, mask) -> out``, or None from it where it does not
    take the call)."""

    spec: BackendSpec
    run: Backend
    decision: auto.Decision | None
    fast: Prepared | None = None


#: At most this many plans are remembered (:func:`_plan_for`); the oldest goes first.
PLAN_CACHE_SIZE = 1024
_plans: dict[tuple[object, ...], _Plan] = {}


def _plan_for(name: str, tensors: tuple[object, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              dropout_p: float, return_weights: bool, return_lse: bool) -> _Plan:
    """The plan for this call (no features): the backend :func:`multihead.backends.resolve_backend`
    gives it, and for ``"auto"`` the path :func:`multihead.backends.auto.decision` picks, remembered
    per signature: ``name``, ``tensors`` (the shapes, q's dtype and device: :func:`_validate`),
    whether autograd records on q, k or v, ``dropout_p`` and the two flags; everything the
    capability check and the rules read of the call (:func:`multihead.backends.auto.signature`).
    Reused while the same spec is registered under ``name``, it is ready
    (:attr:`BackendSpec.ready`) and auto's decision :meth:`~multihead.backends.auto.Decision.holds`;
    otherwise, or while a compiler traces, resolved again (raising as resolve_backend does; a plan
    made while tracing prepares nothing)."""
    if torch.compiler.is_compiling():
        return _resolve(name, q, k, v, dropout_p, return_weights, return_lse, prepare=False)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key = (name, tensors, grad, dropout_p, return_weights, return_lse)
    try:
        plan = _plans.get(key)
    except TypeError:  # an unhashable shape (symbolic sizes outside a compiler)
        return _resolve(name, q, k, v, dropout_p, return_weights, return_lse, prepare=False)
    if (plan is not None and get_spec(name) is plan.spec and plan.spec.ready() is None
            and (plan.decision is None or plan.decision.holds())):
        return plan
    plan = _resolve(name, q, k, v, dropout_p, return_weights, return_lse,
                    prepare=not (grad or dropout_p or return_weights or return_lse))
    remember(_plans, key, plan, PLAN_CACHE_SIZE)
    return plan


def _resolve(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
             return_weights: bool, return_lse: bool, *, prepare: bool) -> _Plan:
    """:func:`_plan_for`'s plan, made now: the capability check (raising for a missing one)
    and, for ``"auto"``, its decision; the path it picks is what ``auto_backend`` would run
    (without packed sequences it only adds the decision). ``prepare``: also make the backend's
    (or the path's) prepared call where it has one (the call asks for nothing it would skip)."""
    fn = resolve_backend(name, q, k, v, dropout_p=dropout_p, return_weights=return_weights, return_lse=return_lse)
    spec = get_spec(name)
    if fn is not auto.auto_backend:
        return _Plan(spec, fn, None, spec.prepare(q, k, v) if prepare and spec.prepare is not None else None)
    picked = auto.decision(q, k, v, dropout_p, return_weights, return_lse)
    return _Plan(spec, picked.rule.run, picked, picked.fast if prepare else None)


#: The floating dtypes (``dtype.is_floating_point``), for the common call's one look-up.
_FLOAT_DTYPES = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point)
_Tensor = torch.Tensor
_CPU = torch.device("cpu")


def _validate(q: object, k: object, v: object, mask: object, window: object, scale: object,
              dropout_p: object) -> tuple[torch.Tensor | None, float, float, tuple[object, ...]]:
    """Every check of :func:`attention`, once, in order (q, k and v, then mask, window, scale,
    dropout_p): returns the mask as a 4-D view, scale, dropout_p, and (q, k and v's shapes, q's
    dtype and device) for :func:`_plan_for`.

    The common call's tensors (plain CPU tensors of rank 4 and one floating dtype, with sizes
    that agree) pass :func:`_check_tensors` in one expression, which implies all its checks; any
    other runs them one by one, each error naming its argument with what was expected and what
    was got. A float scale or dropout_p in range is taken as it is (what check_float returns)."""
    qs = None
    if type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor:
        qs, ks, vs = q.shape, k.shape, v.shape
        dtype = q.dtype
        try:
            b, h, _, d = qs
            kb, hkv, sk, kd = ks
            vb, vh, vsk, _ = vs
        except ValueError:  # a rank other than 4
            qs = None
        else:
            if not (kb == b and vb == b and kd == d and vh == hkv and vsk == sk and hkv > 0 and h % hkv == 0
                    and dtype in _FLOAT_DTYPES and k.dtype is dtype and v.dtype is dtype
                    and q.is_cpu and k.is_cpu and v.is_cpu):
                qs = None
    if qs is None:
        q, k, v = _check_tensors(q, k, v)
        qs, ks, vs, dtype = q.shape, k.shape, v.shape, q.dtype
        tensors: tuple[object, ...] = (qs, ks, vs, dtype, q.device)
    else:
        tensors = (qs, ks, vs, dtype, _CPU)
    mask4 = None
    if mask is not None:
        assert isinstance(q, torch.Tensor)  # checked above
        mask4 = check_bool_mask("mask", mask, (qs[0], qs[1], qs[2], ks[2]), "[B, H, Sq, Sk]")
        if mask4.device != q.device:
            raise ValueError(f"mask must be on device {q.device} like q, got {mask4.device}")
        mask4 = mask4[(None,) * (4 - mask4.dim())]  # (B|1, H|1, Sq|1, Sk|1): one rank for every backend
    if window is not None:
        check_int("window", window)
    if scale is None:
        scale_f = 1.0 / math.sqrt(qs[3])
    elif type(scale) is float and 0.0 < scale < math.inf:
        scale_f = scale
    else:
        scale_f = check_float("scale", scale, low=0.0, high=math.inf, low_inclusive=False, high_inclusive=False)
    if type(dropout_p) is float and 0.0 <= dropout_p < 1.0:
        p = dropout_p
    else:
        p = check_float("dropout_p", dropout_p, low=0.0, high=1.0, high_inclusive=False)
    return mask4, scale_f, p, tensors


def _check_tensors(q_in: object, k_in: object, v_in: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checks of q, k and v, one by one (see :func:`_validate`): returns them as tensors."""
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
    return q, k, v


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


def _check_bias(bias: object, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``bias`` checked (a floating tensor broadcastable to (B, H, Sq, Sk), on q's device) as a
    4-D view, or None."""
    if bias is None:
        return None
    t = check_tensor("bias", bias)
    if not t.dtype.is_floating_point:
        raise TypeError(f"bias must be a floating tensor (added to the logits), got dtype {t.dtype}; "
                        "a bool mask goes in mask=")
    b, h, sq, _ = q.shape
    target = (b, h, sq, k.shape[2])
    if t.dim() > 4 or not _broadcastable(tuple(t.shape), target):
        raise ValueError(f"bias must be broadcastable to [B, H, Sq, Sk] = {list(target)}, got shape {list(t.shape)}")
    if t.device != q.device:
        raise ValueError(f"bias must be on device {q.device} like q, got {t.device}")
    return t[(None,) * (4 - t.dim())]  # (B|1, H|1, Sq|1, Sk|1)


def _check_score_mod(score_mod: object) -> ScoreMod | None:
    """``score_mod`` checked (callable), or None."""
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be a callable (score, b, h, q_idx, kv_idx) -> score, "
                        f"got {type(score_mod).__name__}")
    return score_mod  # type: ignore[return-value]  # callable: checked


def _block_mask_for(mask_mod: MaskMod | None, block_mask: object, q: torch.Tensor,
                    k: torch.Tensor) -> BlockMask | None:
    """The call's block mask: ``block_mask`` checked against (B, H, Sq, Sk), and-ed with
    ``mask_mod``'s, built for the call in tiles of :data:`~multihead.block_mask.DEFAULT_BLOCK_SIZE`."""
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a multihead.BlockMask, got {type(block_mask).__name__}")
        got = block_mask.shape
        if got[0] not in (1, b) or got[1] not in (1, h) or got[2:] != (sq, sk):
            raise ValueError(f"block_mask must be built for (B, H, Sq, Sk) = {(b, h, sq, sk)} (B and H may be 1), "
                             f"got {got}")
        if block_mask.tiles.device != q.device:
            raise ValueError(f"block_mask must be on device {q.device} like q, got {block_mask.tiles.device}")
    if mask_mod is None:
        return block_mask
    built = BlockMask.from_mask_mod(mask_mod, b, h, sq, sk, DEFAULT_BLOCK_SIZE, device=q.device)
    return built if block_mask is None else block_mask & built


def default_backend(backend: str | None, return_weights: bool) -> str:
    """``backend``, or the default for the call: "explicit" for weights, else "auto"."""
    if backend is None:
        return WEIGHTS_BACKEND if return_weights else DEFAULT_BACKEND
    return backend
