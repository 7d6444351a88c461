"""score_mods (FlexAttention's signature): documented building blocks, composable.

Notation: B batch, H query heads, Sq queries, Sk keys, NB number of buckets.

A ``score_mod(score, b, h, q_idx, kv_idx) -> score`` rewrites the scaled logit of query
``q_idx`` and key ``kv_idx`` of head ``h``, batch row ``b``, before masking (its place
among the logit features: :mod:`multihead.logits`). It is evaluated once on the whole
score tensor with broadcast int64 index tensors (:func:`multihead.block_mask.mask_mod_indices`)::

    score (B, H, Sq, Sk)   b (B, 1, 1, 1)   h (1, H, 1, 1)   q_idx (1, 1, Sq, 1)   kv_idx (1, 1, 1, Sk)

``q_idx`` is the query's position on the key axis, **bottom-right aligned** as everywhere
in multihead (query row i at ``i + Sk - Sq``: a query's cache position when decoding);
FlexAttention's is the row index, the same when Sq == Sk.

The building blocks are small objects whose fields a kernel can read: :func:`lower` turns them
into the features the native kernels run (forward and backward for the biases); any other
Python callable runs on the ``"explicit"`` backend, exactly and differentiably (gradients reach
the tensors it captures, e.g. a learned table):

* :func:`relative_bias` ``(table, buckets)``: ``score + table[h, buckets(q_idx, kv_idx)]``,
  T5's relative position bias with :func:`t5_buckets`;
* :func:`alibi` ``(slopes)``: ``score - slope_h · |q_idx - kv_idx|`` (as ``alibi_slopes=``);
* :func:`soft_cap` ``(cap)``: ``cap · tanh(score / cap)`` (as ``softcap=``); :func:`tanh` (as ``softcap=1``);
* :func:`head_scale` ``(scales)``: ``score · scale_h`` (first: each head's queries times its scale);
* :func:`clamp` ``(lo, hi)`` (``"explicit"`` only);
* :func:`compose` ``(*mods)``: each applied to the result of the one before.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._checks import check_float, check_int, check_tensor
from .block_mask import mask_mod_indices
from .logits import Features
from .logits import soft_cap as _cap

__all__ = ["ScoreMod", "Buckets", "RelativeBias", "T5Buckets", "Alibi", "SoftCap", "HeadScale", "Clamp", "Compose",
           "relative_bias", "t5_buckets", "alibi", "soft_cap", "head_scale", "tanh", "clamp", "compose",
           "apply_score_mod", "lower"]

#: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's signature).
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
#: ``buckets(q_idx, kv_idx) -> int64 bucket ids``, broadcast of its arguments.
Buckets = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _per_head(name: str, value: object) -> torch.Tensor:
    """A (H,) floating tensor, checked."""
    t = check_tensor(name, value, ndim=1)
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor [H], got dtype {t.dtype}")
    return t


@dataclass(frozen=True, eq=False)
class T5Buckets:
    """T5's bucketing of ``kv_idx - q_idx`` (transformers' ``T5Attention._relative_position_bucket``,
    exactly): half the buckets for exact small distances, the rest logarithmic up to
    ``max_distance``; ``bidirectional`` (encoders) splits them between keys before and after.

    Attributes:
        num_buckets: NB. max_distance: distances from here share the last bucket.
        bidirectional: True for encoders, False for decoders (no bucket for future keys).
    """

    num_buckets: int
    max_distance: int
    bidirectional: bool

    def __call__(self, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """int64 buckets in [0, NB) of the broadcast of ``q_idx`` and ``kv_idx``."""
        relative = kv_idx - q_idx  # memory position - query position
        n = self.num_buckets
        buckets = torch.zeros_like(relative)
        if self.bidirectional:
            n //= 2
            buckets = buckets + (relative > 0).to(torch.long) * n
            relative = relative.abs()
        else:
            relative = -torch.clamp(relative, max=0)
        exact = n // 2
        large = exact + (torch.log(relative.float() / exact) / math.log(self.max_distance / exact)
                         * (n - exact)).to(torch.long)
        large = torch.clamp(large, max=n - 1)
        return buckets + torch.where(relative < exact, relative, large)


@dataclass(frozen=True, eq=False)
class RelativeBias:
    """``score + table[h, buckets(q_idx, kv_idx)]``: a learned bias per head and bucket.

    Attributes:
        table: (H, NB) float, e.g. T5's ``relative_attention_bias.weight.T``; differentiable.
        buckets: ``(q_idx, kv_idx) -> int64`` bucket ids in [0, NB), e.g. :func:`t5_buckets`.
    """

    table: torch.Tensor
    buckets: Buckets

    def __call__(self, score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return score + self.table[h, self.buckets(q_idx, kv_idx)].to(score.dtype)  # (1, H, Sq, Sk)


@dataclass(frozen=True, eq=False)
class Alibi:
    """``score - slope_h · |q_idx - kv_idx|`` (ALiBi, as :func:`multihead.logits.alibi_bias`).

    Attributes:
        slopes: (H,) float.
    """

    slopes: torch.Tensor

    def __call__(self, score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return score - self.slopes.to(score.dtype)[h] * (q_idx - kv_idx).abs().to(score.dtype)


@dataclass(frozen=True, eq=False)
class SoftCap:
    """``cap · tanh(score / cap)`` (:func:`multihead.logits.soft_cap`).

    Attributes:
        cap: > 0.
    """

    cap: float

    def __call__(self, score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return _cap(score, self.cap)


@dataclass(frozen=True, eq=False)
class HeadScale:
    """``score · scale_h``: one multiplier per head.

    Attributes:
        scales: (H,) float; differentiable.
    """

    scales: torch.Tensor

    def __call__(self, score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return score * self.scales.to(score.dtype)[h]


@dataclass(frozen=True, eq=False)
class Clamp:
    """``score`` clamped to [lo, hi].

    Attributes:
        lo, hi: the bounds, lo <= hi.
    """

    lo: float
    hi: float

    def __call__(self, score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        return score.clamp(self.lo, self.hi)


@dataclass(frozen=True, eq=False)
class Compose:
    """Each of ``mods`` applied to the result of the one before, first to last.

    Attributes:
        mods: the score_mods.
    """

    mods: tuple[ScoreMod, ...]

    def __call__(self, score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                 kv_idx: torch.Tensor) -> torch.Tensor:
        for mod in self.mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score


def t5_buckets(num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True) -> T5Buckets:
    """T5's bucketing (:class:`T5Buckets`); the defaults are T5's config's
    (``relative_attention_num_buckets``, ``relative_attention_max_distance``; decoders:
    ``bidirectional=False``).

    Raises:
        TypeError, ValueError: ``num_buckets`` < 4 (2 exact buckets per direction at least),
            ``max_distance`` not above the exact range.
    """
    n = check_int("num_buckets", num_buckets, minimum=4)
    exact = (n // 2 if bidirectional else n) // 2
    distance = check_int("max_distance", max_distance, minimum=exact + 1)
    return T5Buckets(n, distance, bool(bidirectional))


def relative_bias(table: torch.Tensor, buckets: Buckets) -> RelativeBias:
    """A learned relative position bias (:class:`RelativeBias`).

    Args:
        table: (H, NB) float.
        buckets: ``(q_idx, kv_idx) -> int64`` bucket ids in [0, NB).

    Raises:
        TypeError: ``table`` not floating, ``buckets`` not callable. ValueError: not 2-D.
    """
    t = check_tensor("table", table, ndim=2)
    if not t.dtype.is_floating_point:
        raise TypeError(f"table must be a floating tensor [H, num_buckets], got dtype {t.dtype}")
    if not callable(buckets):
        raise TypeError(f"buckets must be a callable (q_idx, kv_idx) -> bucket ids, got {type(buckets).__name__}")
    return RelativeBias(t, buckets)


def alibi(slopes: torch.Tensor) -> Alibi:
    """ALiBi as a score_mod (:class:`Alibi`); ``slopes`` (H,) float
    (:func:`multihead.logits.alibi_slopes` gives the standard ones)."""
    return Alibi(_per_head("slopes", slopes))


def soft_cap(cap: float) -> SoftCap:
    """Soft-capping as a score_mod (:class:`SoftCap`); ``cap`` > 0."""
    return SoftCap(check_float("cap", cap, low=0.0, high=math.inf, low_inclusive=False, high_inclusive=False))


def head_scale(scales: torch.Tensor) -> HeadScale:
    """One multiplier per head (:class:`HeadScale`); ``scales`` (H,) float."""
    return HeadScale(_per_head("scales", scales))


def tanh(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
         kv_idx: torch.Tensor) -> torch.Tensor:
    """``tanh(score)``, a score_mod (b, h, q_idx, kv_idx unused)."""
    return torch.tanh(score)


def clamp(lo: float, hi: float) -> Clamp:
    """Scores clamped to [lo, hi] (:class:`Clamp`).

    Raises:
        ValueError: lo > hi or a NaN bound.
    """
    low = check_float("lo", lo, low=-math.inf, high=math.inf)
    high = check_float("hi", hi, low=low, high=math.inf)
    return Clamp(low, high)


def compose(*mods: ScoreMod) -> Compose:
    """The score_mods applied in order, first to last (:class:`Compose`).

    Raises:
        ValueError: none given. TypeError: one is not callable.
    """
    if not mods:
        raise ValueError("compose needs at least one score_mod, got none")
    for i, mod in enumerate(mods):
        if not callable(mod):
            raise TypeError(f"compose's score_mod {i} must be callable, got {type(mod).__name__}")
    return Compose(tuple(mods))


def apply_score_mod(score_mod: ScoreMod, scores: torch.Tensor) -> torch.Tensor:
    """``score_mod`` on every score, with the broadcast index tensors (see the module), checked.

    Args:
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score``.
        scores: (B, H, Sq, Sk) float, the scaled logits.

    Returns:
        (B, H, Sq, Sk) in ``scores``' dtype.

    Raises:
        TypeError: its result is not a floating tensor. ValueError: it does not broadcast
            to (B, H, Sq, Sk).
    """
    b, h, sq, sk = scores.shape
    result = score_mod(scores, *mask_mod_indices(b, h, sq, sk, device=scores.device))
    if not isinstance(result, torch.Tensor) or not result.dtype.is_floating_point:
        got = f"dtype {result.dtype}" if isinstance(result, torch.Tensor) else type(result).__name__
        raise TypeError(f"score_mod must return a floating tensor (the new scores), got {got}")
    try:
        shape = torch.broadcast_shapes(result.shape, scores.shape)
    except RuntimeError:
        shape = None
    if shape != scores.shape:
        raise ValueError(f"score_mod must return scores broadcastable to (B, H, Sq, Sk) = {tuple(scores.shape)}, "
                         f"got shape {tuple(result.shape)}")
    return result.to(scores.dtype).expand(scores.shape)


# The stages of multihead.logits' order a building block can be lowered to: the feature it becomes
# (a per-head scale only first of all: it becomes each head's queries times its scale).
_SCALE, _SOFTCAP, _ALIBI, _BIAS = -1, 0, 1, 2


def lower(features: Features, sq: int, sk: int, heads: int) -> Features:
    """``features`` with its ``score_mod`` turned into the logit features that compute it exactly,
    where it is made only of building blocks in :mod:`multihead.logits`' order (a per-head scale,
    soft-capping, then ALiBi, then relative bias) and none of them would run before a feature the
    call already sets: :class:`HeadScale` becomes ``head_scale`` (each head's queries times its
    scale), :class:`SoftCap` becomes ``softcap`` and :func:`tanh` ``softcap=1``, :class:`Alibi`
    ``alibi_slopes``, and :class:`RelativeBias`, gathered from its table (its gradient reaches the
    table), becomes ``relative`` (1, H, Sq + Sk - 1), one value per head and distance, with T5's
    buckets, or an additive ``bias`` (1, H, Sq, Sk) with others. The fast paths run them ("native"
    all of them, forward and backward for the biases; "sdpa" the biases, as one dense bias).
    Anything else is returned as given (``"explicit"`` runs the score_mod).
    """
    mod = features.score_mod
    if mod is None:
        return features
    parts = mod.mods if isinstance(mod, Compose) else (mod,)
    stage = max([s for s, on in ((_SOFTCAP, features.softcap is not None), (_ALIBI, features.alibi_slopes is not None),
                                 (_BIAS, features.has_bias())) if on], default=_SCALE - 1)
    lowered: dict[str, object] = {"score_mod": None}
    for part in parts:
        kind = _stage(part, heads)
        if kind is None or kind < stage or (kind == stage and kind != _BIAS):
            return features  # not a building block, or out of the order the features apply in
        stage = kind
        if isinstance(part, HeadScale):
            lowered["head_scale"] = part.scales
        elif isinstance(part, SoftCap) or part is tanh:
            lowered["softcap"] = part.cap if isinstance(part, SoftCap) else 1.0  # tanh(s) = 1 · tanh(s / 1)
        elif isinstance(part, Alibi):
            lowered["alibi_slopes"] = part.slopes
        else:
            assert isinstance(part, RelativeBias)  # _stage accepts these three
            key, bias = _relative(part, sq, sk)  # relative (1, H, Sq + Sk - 1) or bias (1, H, Sq, Sk)
            prior = lowered.get(key, getattr(features, key))
            lowered[key] = bias if prior is None else prior + bias  # type: ignore[operator]
    return features._replace(**lowered)  # type: ignore[arg-type]


def _stage(part: object, heads: int) -> int | None:
    if isinstance(part, HeadScale) and part.scales.shape == (heads,):
        return _SCALE
    if isinstance(part, SoftCap) or part is tanh:
        return _SOFTCAP
    if isinstance(part, Alibi) and part.slopes.shape == (heads,):
        return _ALIBI
    if isinstance(part, RelativeBias) and part.table.dim() == 2 and part.table.shape[0] == heads:
        return _BIAS
    return None


def _relative(part: RelativeBias, sq: int, sk: int) -> tuple[str, torch.Tensor]:
    """``table[h, buckets(q_idx, kv_idx)]`` at the call's positions (bottom-right), as the feature
    that adds it: ``("relative", (1, H, Sq + Sk - 1))`` where the buckets depend on the distance
    ``kv_idx - q_idx`` alone (T5's), else ``("bias", (1, H, Sq, Sk))``; differentiable into the table.

    Per distance, the buckets are computed Sq + Sk - 1 times, not Sq·Sk (S = 2048 took 0.77 s pair
    by pair), and the native kernels read the vector along diagonals: no (Sq, Sk) bias is made."""
    table = part.table
    if isinstance(part.buckets, T5Buckets):
        distances = torch.arange(-(sk - 1), sq, device=table.device)  # kv_idx - q_idx, (Sq + Sk - 1,)
        buckets = part.buckets(torch.zeros(1, dtype=torch.long, device=table.device), distances)
        return "relative", table[:, buckets][None]  # [0, h, t]: distance t - Sk + 1, i.e. key j - row i = t - Sq + 1
    q_idx = torch.arange(sk - sq, sk, device=table.device)[:, None]  # (Sq, 1)
    kv_idx = torch.arange(sk, device=table.device)[None, :]  # (1, Sk)
    return "bias", table[:, part.buckets(q_idx, kv_idx)][None]  # (1, H, Sq, Sk)
