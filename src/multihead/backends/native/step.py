"""Decoding a token in few C calls: the few-row GEMV of the projections and the whole layer step.

Notation: B batch (rows, one token each: B ≤ :data:`MAX_STEP_ROWS`), E embed_dim, H query heads,
Hkv key/value heads, D head dim, C cache capacity, P RoPE positions, R rotary dim.

:func:`linear_few_rows` streams the weights once for few rows (the layer's projections while
decoding); :func:`decode_step` runs a layer's whole step (projections, RoPE, the cache write,
attention, W_o) in one call, and :class:`StepPlan` keeps that call's C arguments marshalled for
a (layer, cache) pair. Nothing happens at import time.
"""

from __future__ import annotations

import torch

from ..._checks import check_tensor
from ._ffi import MAX_STEP_ROWS, SUFFIX, kernel, pointers, ptr
from .loader import require

__all__ = ["MAX_STEP_ROWS", "linear_few_rows", "decode_step", "StepPlan", "Norm", "NORM_MODES"]

_CPU = torch.device("cpu")  # the outputs' device, named (a default device set by the user must not move them)

#: QK-norm in the step: (q weight, k weight, eps, mode), the weights of the step's dtype; mode
#: (:data:`NORM_MODES`): 1 per head before RoPE, 2 per head after it (weights (D,) each), 3 across
#: the whole projection before RoPE (OLMo 2 and 3: weights (H·D,) and (Hkv·D,)), plus 4 where
#: the scale is ``1 + weight`` (Gemma's offset).
Norm = tuple[torch.Tensor, torch.Tensor, float, int]
#: The modes the kernel takes.
NORM_MODES = (1, 2, 3, 5, 6, 7)


def linear_few_rows(
    x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]]
) -> list[torch.Tensor]:
    """``x · wᵀ + b`` for each ``(w, b)`` of ``layers`` in one call, for few rows of x.

    For decoding: the weights are streamed once, all of them split across threads in
    one parallel region (the q, k and v projections of a token cost one call). Forward
    only.

    Args:
        x: (M, K) float32, contiguous, 1 ≤ M ≤ :data:`MAX_STEP_ROWS`.
        layers: (w (N_i, K), b (N_i,) or None), float32 and contiguous.

    Returns:
        One (M, N_i) tensor per layer.

    Raises:
        TypeError, ValueError: tensors of the wrong dtype, device, layout or shapes.
        RuntimeError: the kernel is not available (see :func:`.loader.status`).
    """
    check_tensor("x", x, ndim=2)
    m, k = x.shape
    if not 1 <= m <= MAX_STEP_ROWS:
        raise ValueError(f"x must have 1 to {MAX_STEP_ROWS} rows, got shape {list(x.shape)}")
    _check_layout("x", x)
    for i, (w, bias) in enumerate(layers):  # one pass; a name is only spelled out for an error
        _check_layout(f"layers[{i}][0]", w)
        if w.dim() != 2 or w.shape[1] != k or w.shape[0] == 0:
            raise ValueError(f"layers[{i}] weight must be (N, {k}), got {list(w.shape)}")
        if bias is not None:
            _check_layout(f"layers[{i}][1]", bias)
            if bias.shape != (w.shape[0],):
                raise ValueError(f"layers[{i}] bias must be ({w.shape[0]},), got {list(bias.shape)}")
    lib = require()
    outs = [torch.empty(m, w.shape[0], dtype=torch.float32, device=_CPU) for w, _ in layers]  # whatever the defaults
    code = lib.mh_linear_few_rows_f32(
        x.data_ptr(), m, k, len(layers), pointers([w for w, _ in layers]), tuple(w.shape[0] for w, _ in layers),
        pointers([b for _, b in layers]), pointers(outs), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"the native linear kernel refused the problem (code {code})")
    return outs


def _check_layout(name: str, t: torch.Tensor) -> None:
    """``t`` is a contiguous float32 CPU tensor, or a TypeError naming ``name``."""
    if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
        raise TypeError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}"
                        f"{'' if t.is_contiguous() else ', not contiguous'}")


def decode_step(
    x: torch.Tensor,
    layers: list[tuple[torch.Tensor, torch.Tensor | None]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope: tuple[torch.Tensor, torch.Tensor, int, bool] | None,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    norm: Norm | None = None,
    window: int | None = None,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """A whole decoding step of a layer in one call (one token per row, B ≤ :data:`MAX_STEP_ROWS`).

    Projects x to q, k, v, rotates q and k at each row's position ``lengths[b] - starts[b]``,
    writes k and v into the cache at slot ``lengths[b]``, attends over the row's slots
    ``starts[b] .. lengths[b]`` and projects with W_o. It does **not** advance the cache's counters: the caller
    (:func:`multihead.decode.fused_step`, traced) commits them through ``KVCache.commit``
    (a :class:`StepPlan`'s step does). The caller has validated everything
    (:func:`multihead.decode.why_not_fused`).

    Args:
        x: (B, E) float32, bfloat16 or float16, contiguous: the dtype of everything
            below but the RoPE tables (computed in float32; y, K and V rounded to it).
        layers: (weight, bias or None) of q, k, v, o; contiguous, x's dtype.
        rope: (cos (P, R/2), sin (P, R/2), R, interleaved) float32 tables covering every
            row's position, or None.
        cache_k, cache_v: (B, Hkv, C, D) x's dtype, with contiguous rows. lengths: (B,)
            int64, contiguous (read only).
        norm: QK-norm per head, ``(q weight (D,), k weight (D,), eps, mode)`` (:data:`Norm`),
            as :class:`multihead.RMSNorm` computes it in float32, or None.
        window: a sliding window (each row's query sees its last ``window`` keys, itself
            included, as :class:`multihead.masks.Structure`), or None. The cache's slots must
            hold positions 0 .. lengths[b] (a linear cache, not a ring).
        starts: (B,) int64, contiguous, each row's first slot, 0 ≤ starts[b] ≤ lengths[b]: a
            left-padded row (its slots before it are padding, never attended; its positions
            count from it), or None (every row from slot 0).

    Returns:
        y: (B, E) in x's dtype.
    """
    _check_step_dtypes(x, layers, rope, cache_k, cache_v)
    _check_step_shapes(x, layers, num_heads, num_kv_heads, head_dim, rope, cache_k, cache_v, lengths)
    norm_args = _checked_norm(norm, x.dtype, (num_heads, num_kv_heads, head_dim))
    win = _window_argument(window)
    _check_starts(starts, lengths)
    lib = require()
    b, e = x.shape
    y = torch.empty((b, e), dtype=x.dtype, device=x.device)
    cos, sin, rotary_dim, interleaved = rope if rope is not None else (None, None, 0, False)
    code = kernel(lib, "mh_decode_step_f32", x.dtype)(
        ptr(x), b, e, pointers([w for w, _ in layers]), pointers([bias for _, bias in layers]),
        num_heads, num_kv_heads, head_dim, ptr(cos), ptr(sin), rotary_dim, int(interleaved), *norm_args,
        ptr(cache_k), ptr(cache_v), tuple(cache_k.stride()[:3]), lengths.data_ptr(),
        float(scale), win, ptr(starts), ptr(y), None, torch.get_num_threads(), None, 0, 0)
    if code == -1:
        raise MemoryError("the native decoding step could not allocate its buffers")
    if code != 0:
        raise RuntimeError(f"the native decoding step refused the problem (code {code})")
    return y


class StepPlan:
    """:func:`decode_step`'s C arguments for one layer and cache, marshalled once.

    Marshalling them (tuples of addresses and strides, dtype checks) costs
    more than a small layer's whole step when the interpreter's caches are cold, as they
    are at every step of a model that streams its weights. A plan keeps them, with the
    tensors they point into (so that their storage lives as long as the plan: a pointer
    in it can never be reused by another tensor). :meth:`key` is compared at every use:
    a replaced or moved weight, table or buffer, another row count, dtype or thread count
    makes a new plan, never a stale pointer. The caller has validated the tensors (as for
    :func:`decode_step`; :class:`multihead.decode.FusedStep` does).

    Unlike :func:`decode_step`, a plan's step also advances the cache's counters, in the
    same C call once everything else is written (as :func:`.counters.advance_counters`, which
    ``KVCache.commit`` calls): after the kernel, a step of a model that streams its weights
    finds the interpreter's caches cold again, and the commit's Python took 0.1-0.17 ms.

    Args: as :func:`decode_step`'s, with ``rows`` B, ``dtype`` the step's and ``slot_pos``
    the cache's (B, C) int64 slot positions, unit stride along C.
    """

    def __init__(self, rows: int, layers: list[tuple[torch.Tensor, torch.Tensor | None]], *, num_heads: int,
                 num_kv_heads: int, head_dim: int, rope: tuple[torch.Tensor, torch.Tensor, int, bool] | None,
                 cache_k: torch.Tensor, cache_v: torch.Tensor, lengths: torch.Tensor, slot_pos: torch.Tensor,
                 scale: float, dtype: torch.dtype, norm: Norm | None = None, window: int | None = None) -> None:
        self.key = StepPlan.key_of(rows, layers, rope, cache_k, cache_v, lengths, slot_pos, dtype,
                                   (num_heads, num_kv_heads, head_dim, float(scale)), norm, window)
        #: Every tensor the plan points into, in a fixed order (the cache's four last), held so
        #: that their storage lives as long as the plan.
        self.tensors: tuple[torch.Tensor, ...] = tuple(t for t in (
            *(t for pair in layers for t in pair), *(rope[:2] if rope is not None else ()),
            *(norm[:2] if norm is not None else ()), cache_k, cache_v, lengths, slot_pos) if t is not None)
        e = layers[0][0].shape[1]
        cos, sin, rotary_dim, interleaved = rope if rope is not None else (None, None, 0, False)
        #: (B, 2, Hkv, D): the slots the last step wrote, as they were before (the cache puts them
        #: back if the step must be undone: :meth:`multihead.KVCache.undo_native_step`).
        self.saved = torch.empty((rows, 2, num_kv_heads, head_dim), dtype=dtype, device=_CPU)
        self._fn = kernel(require(), "mh_decode_step_f32", dtype)
        self._shape, self._dtype = (rows, 1, e), dtype
        self._args = (rows, e, pointers([w for w, _ in layers]), pointers([b for _, b in layers]), num_heads,
                      num_kv_heads, head_dim, ptr(cos), ptr(sin), rotary_dim, int(interleaved),
                      *_norm_arguments(norm), ptr(cache_k), ptr(cache_v), tuple(cache_k.stride()[:3]),
                      lengths.data_ptr(), float(scale), _window_argument(window))
        self._counters = (slot_pos.data_ptr(), slot_pos.stride(0), slot_pos.shape[1])

    @staticmethod
    def key_of(rows: int, layers: list[tuple[torch.Tensor, torch.Tensor | None]],
               rope: tuple[torch.Tensor, torch.Tensor, int, bool] | None, cache_k: torch.Tensor,
               cache_v: torch.Tensor, lengths: torch.Tensor, slot_pos: torch.Tensor, dtype: torch.dtype,
               shape: tuple[int, int, int, float], norm: Norm | None = None,
               window: int | None = None) -> tuple[object, ...]:
        """What a plan's arguments depend on: data pointers, strides, rows, dtype, threads,
        ``shape`` (H, Hkv, D, scale) and ``window``: the layer's, which a user may reassign
        (``layer.scale``), and the QK-norm's weights' pointers, eps and mode."""
        return (rows, dtype, torch.get_num_threads(), shape, window, _norm_arguments(norm),
                *(ptr(t) for pair in layers for t in pair),
                None if rope is None else (rope[0].data_ptr(), rope[1].data_ptr(), rope[2], rope[3]),
                cache_k.data_ptr(), cache_v.data_ptr(), cache_k.stride(), lengths.data_ptr(), slot_pos.data_ptr(),
                slot_pos.shape, slot_pos.stride())

    def run(self, x: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
        """The step for x (B, E) or (B, 1, E), contiguous, of the plan's dtype: y (B, 1, E).
        K and V written, the counters advanced; the written slots' old K and V are kept in
        :attr:`saved`. Nothing is written if it fails (every row must have room). ``starts``:
        as :func:`decode_step`'s (B,) int64 contiguous, checked by the caller (the kernel
        refuses a start past its row's new token)."""
        y = torch.empty(self._shape, dtype=self._dtype, device=_CPU)
        code = self._fn(x.data_ptr(), *self._args, ptr(starts), y.data_ptr(), self.saved.data_ptr(),
                        torch.get_num_threads(), *self._counters)
        if code == -1:
            raise MemoryError("the native decoding step could not allocate its buffers")
        if code != 0:
            raise RuntimeError(f"the native decoding step refused the problem (code {code})")
        return y



def _shape_error(name: str, t: object, want: str) -> ValueError:
    got = f"{list(t.shape)}{'' if t.is_contiguous() else ', not contiguous'}" if isinstance(t, torch.Tensor) \
        else type(t).__name__
    return ValueError(f"{name} must be {want}, got {got}")


def _check_step_shapes(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]], num_heads: int,
                       num_kv_heads: int, head_dim: int, rope: tuple[torch.Tensor, torch.Tensor, int, bool] | None,
                       cache_k: torch.Tensor, cache_v: torch.Tensor, lengths: torch.Tensor) -> None:
    """Every shape, layout and capacity the step's kernel relies on, checked before it runs (the
    public :func:`decode_step` and the operator ``multihead::decode_step`` may be called directly):
    x (B, E) contiguous with 1 <= B <= MAX_STEP_ROWS; q/k/v/o weights (H·D, E), (Hkv·D, E) ×2,
    (E, H·D), contiguous, biases of their rows; the caches (B, Hkv, C, D) alike with contiguous
    rows; lengths (B,) int64 with every value in [0, C) (a slot to write); the RoPE tables
    (P, R/2) float32 contiguous covering every row's position, R even and at most D."""
    if not all(isinstance(n, int) and n > 0 for n in (num_heads, num_kv_heads, head_dim)) \
            or num_heads % num_kv_heads:
        raise ValueError(f"num_heads, num_kv_heads, head_dim must be positive, num_heads a multiple of "
                         f"num_kv_heads, got {num_heads}, {num_kv_heads}, {head_dim}")
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_STEP_ROWS or not x.is_contiguous():
        raise _shape_error("x", x, f"(B, E) contiguous with 1 <= B <= {MAX_STEP_ROWS}")
    b, e = x.shape
    h, hkv, d = num_heads, num_kv_heads, head_dim
    if len(layers) != 4:
        raise ValueError(f"layers must be the (weight, bias) of q, k, v and o, got {len(layers)} pairs")
    for name, (w, bias), rows, cols in zip("qkvo", layers, (h * d, hkv * d, hkv * d, e), (e, e, e, h * d)):
        if w.dim() != 2 or tuple(w.shape) != (rows, cols) or not w.is_contiguous():
            raise _shape_error(f"the {name} weight", w, f"({rows}, {cols}) contiguous")
        if bias is not None and (tuple(bias.shape) != (rows,) or not bias.is_contiguous()):
            raise _shape_error(f"the {name} bias", bias, f"({rows},) contiguous")
    if cache_k.dim() != 4 or cache_k.shape[0] != b or cache_k.shape[1] != hkv or cache_k.shape[3] != d \
            or cache_k.stride(-1) != 1:
        raise _shape_error("cache_k", cache_k, f"(B={b}, Hkv={hkv}, C, D={d}) with contiguous rows")
    if tuple(cache_v.shape) != tuple(cache_k.shape) or cache_v.stride() != cache_k.stride():
        raise _shape_error("cache_v", cache_v, f"cache_k's shape {list(cache_k.shape)} and strides")
    capacity = cache_k.shape[2]
    if not isinstance(lengths, torch.Tensor) or lengths.dtype != torch.int64 or tuple(lengths.shape) != (b,) \
            or not lengths.is_contiguous() or lengths.device.type != "cpu":
        raise _shape_error("lengths", lengths, f"a contiguous int64 CPU tensor ({b},)")
    low, high = int(lengths.min()), int(lengths.max())
    if low < 0 or high >= capacity:
        raise ValueError(f"lengths must lie in [0, {capacity}) (each row writes slot lengths[b] of the cache), "
                         f"got {lengths.tolist()}")
    if rope is not None:
        cos, sin, rotary_dim, _ = rope
        if not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d:
            raise ValueError(f"the rotary dim must be even and in (0, {d}], got {rotary_dim}")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dim() != 2 or t.shape[1] != rotary_dim // 2 or t.shape[0] <= high or not t.is_contiguous():
                raise _shape_error(f"the RoPE table {name}", t,
                                   f"(P > {high}, {rotary_dim // 2}) contiguous (a row for every position)")


def _check_step_dtypes(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]],
                       rope: tuple[torch.Tensor, torch.Tensor, int, bool] | None, cache_k: torch.Tensor,
                       cache_v: torch.Tensor) -> None:
    """The step reads raw memory of one dtype: x's, everywhere but the float32 RoPE tables."""
    if x.dtype not in SUFFIX:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    named = [("cache_k", cache_k), ("cache_v", cache_v)] + [
        (f"layers[{i}][{j}]", t) for i, layer in enumerate(layers) for j, t in enumerate(layer) if t is not None]
    for name, t in named:
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    for name, t in zip(("cos", "sin"), rope[:2] if rope is not None else ()):
        if t.dtype != torch.float32:
            raise TypeError(f"the RoPE table {name} must be float32, got {t.dtype}")


def _check_starts(starts: torch.Tensor | None, lengths: torch.Tensor) -> None:
    """Each row's first slot: None, or (B,) int64 contiguous on the CPU with 0 <= starts[b] <= lengths[b]."""
    if starts is None:
        return
    if not isinstance(starts, torch.Tensor) or starts.dtype != torch.int64 or starts.shape != lengths.shape \
            or not starts.is_contiguous() or starts.device.type != "cpu":
        raise _shape_error("starts", starts, f"a contiguous int64 CPU tensor ({lengths.shape[0]},)")
    if bool((starts < 0).any()) or bool((starts > lengths).any()):
        raise ValueError(f"starts must lie in [0, lengths[b]] (a row's first slot, at most its new token's), got "
                         f"{starts.tolist()} for lengths {lengths.tolist()}")


def _window_argument(window: int | None) -> int:
    """The kernel's window argument (0: none), a window checked first: None or an int >= 1."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    return window


def _norm_arguments(norm: Norm | None) -> tuple[tuple[int, int] | None, float, int]:
    """The kernel's QK-norm arguments: the two weights' addresses, eps, mode (None, 0.0, 0: none)."""
    if norm is None:
        return None, 0.0, 0
    q_weight, k_weight, eps, mode = norm
    return (q_weight.data_ptr(), k_weight.data_ptr()), float(eps), int(mode)


def _checked_norm(norm: Norm | None, dtype: torch.dtype, heads: tuple[int, int, int]
                  ) -> tuple[tuple[int, int] | None, float, int]:
    """:func:`_norm_arguments` of a QK-norm checked first: weights contiguous CPU tensors of the
    step's dtype, (D,) per head or (H·D,) and (Hkv·D,) across the projection (``heads``: H, Hkv,
    D), eps a float in (0, 1], mode one of :data:`NORM_MODES`."""
    if norm is None:
        return _norm_arguments(None)
    if not isinstance(norm, tuple) or len(norm) != 4:
        raise TypeError(f"norm must be (q weight, k weight, eps, mode) or None, got {type(norm).__name__}")
    q_weight, k_weight, eps, mode = norm
    h, hkv, d = heads
    across = mode in (3, 7)  # the whole projection (checked below to be a mode at all)
    for name, w, n in (("q", q_weight, h * d if across else d), ("k", k_weight, hkv * d if across else d)):
        if not isinstance(w, torch.Tensor) or w.dtype != dtype or w.device.type != "cpu":
            raise TypeError(f"the {name} norm weight must be a CPU tensor of x's dtype {dtype}, got "
                            f"{w.dtype if isinstance(w, torch.Tensor) else type(w).__name__}")
        if tuple(w.shape) != (n,) or not w.is_contiguous():
            raise _shape_error(f"the {name} norm weight", w, f"({n},) contiguous")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 < float(eps) <= 1.0:
        raise ValueError(f"the norm's eps must be a number in (0, 1], got {eps!r}")
    if mode not in NORM_MODES or isinstance(mode, bool):
        raise ValueError(f"the norm's mode must be one of {list(NORM_MODES)}, got {mode!r}")
    return _norm_arguments(norm)
