"""The native CPU kernels (``csrc/``): built on first use, loaded with ctypes.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim,
Dv value head dim.

The kernels are C++ with no dependency but OpenMP: ``attention.cpp`` (the FlashAttention
loop), ``decode.cpp`` (decoding: attention, few-row linear layers, a whole layer step),
``common.h`` (what they share, with the structural rule's C++ copy ``span()``). They are
compiled on first use by :mod:`._build` and called through the signature table of
:mod:`._ffi`. Nothing happens at import time.

Without a C++ compiler (``$CXX``, ``g++`` or ``c++``), or with ``MULTIHEAD_NATIVE=0``,
:func:`available` is False and the ``"auto"`` backend uses its torch paths; the reason
is in :func:`status`. The library is written with ``-fopenmp`` and loaded after torch,
so its threads come from torch's own OpenMP runtime (no second thread pool). Results
do not depend on the thread count (bitwise). Forking a process after torch has used its
OpenMP threads can hang the child in any torch operation (ours or not): call
``torch.set_num_threads(1)`` in the child first, or use the ``spawn`` start method.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch

from ..._checks import check_float, check_int, check_tensor
from ...masks import check_cu_seqlens, segment_bounds
from ..registry import register_backend
from . import _build, _ffi
from ._ffi import int64_ptr, int64s, pointers, ptr
from . import ops  # registers torch.ops.multihead.*: cheap, builds nothing

__all__ = ["available", "status", "build", "vector_bits", "cpu_vendor", "amx_bf16", "advance_counters",
           "attention_f32", "decode_f32", "linear_few_rows", "decode_step", "StepPlan", "MAX_STEP_ROWS", "FEW_ROWS",
           "native_backend", "key_panels"]

#: Most rows of x that :func:`linear_few_rows` and :func:`decode_step` take (the C++
#: ``MAX_STEP_ROWS``, checked against the built library).
MAX_STEP_ROWS = 4
FEW_ROWS = MAX_STEP_ROWS  # the former name
#: Input dtypes of the native backend: each has its own kernels, which read and write that
#: dtype and compute in float32 (half precision is widened in registers as it is loaded,
#: never copied to float32 tensors; outputs rounded to nearest even; lse float32).
DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
#: The kernels' name suffix per dtype (``mh_attention_f32``, ``mh_attention_bf16``, ...).
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def kernel(lib: object, name: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """The C function ``name`` (given with its ``_f32`` suffix) for tensors of ``dtype``."""
    return getattr(lib, name.removesuffix("_f32") + "_" + SUFFIX[dtype])


#: Set by :func:`_loaded` once the library is loaded (never building it): the counter writer
#: (:func:`advance_counters`) and :func:`vector_bits`, asked at every decoding step.
_advance = None
_bits = 0


@functools.cache
def _loaded() -> tuple[object | None, str]:
    global _advance, _bits
    lib, why = _build.load()
    if lib is None:
        return None, why
    _ffi.declare(lib)
    if lib.mh_max_step_rows() != MAX_STEP_ROWS:
        return None, f"the built kernel takes {lib.mh_max_step_rows()} step rows, this module {MAX_STEP_ROWS}"
    _advance, _bits = lib.mh_advance_counters, int(lib.mh_vector_bits())
    return lib, why


def _library():  # type: ignore[no-untyped-def]
    return _loaded()[0]


def build() -> bool:
    """Build and load the kernel now (instead of on first use); True when available."""
    return _library() is not None


@torch.compiler.assume_constant_result  # traced graphs take it as a constant: no ctypes in them
def available() -> bool:
    """Whether the native kernel can run here (builds it on first call)."""
    return _library() is not None


@torch.compiler.assume_constant_result  # traced graphs take it as a constant (no file read in them)
def cpu_vendor() -> str:
    """The CPU's vendor as ``/proc/cpuinfo`` names it (``"GenuineIntel"``, ``"AuthenticAMD"``);
    ``""`` where it cannot be read. ``"auto"`` asks it: torch's own CPU kernels (MKL, oneDNN)
    run different code on different vendors' CPUs of the same vector width."""
    return _build.cpuinfo().get("vendor_id", "")


@torch.compiler.assume_constant_result
def amx_bf16() -> bool:
    """Whether the CPU has AMX tiles for bfloat16 (``amx_bf16``), which oneDNN, and so torch's
    SDPA in bfloat16, runs on. ``"auto"`` asks it."""
    return "amx_bf16" in _build.cpuinfo().get("flags", "").split()


@torch.compiler.assume_constant_result
def amx() -> bool:
    """Whether the bfloat16 FlashAttention loop runs on AMX tiles here (a build with AMX, the
    operating system's permission to use them, not switched off by :func:`amx_enabled`);
    otherwise it runs on AVX-512 (or narrower) vectors. ``"auto"`` asks it for bfloat16."""
    lib = _library()
    return lib is not None and bool(lib.mh_amx_ready())


@contextlib.contextmanager
def amx_enabled(enabled: bool) -> Iterator[None]:
    """Within the block, the bfloat16 loop runs on AMX (``True``, where it can) or never
    (``False``: the AVX-512 loop, as on a CPU without AMX); restored after. Process-wide, for
    tests and measurements: not for concurrent use."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    lib = _require()
    before = lib.mh_amx_switch(int(enabled))
    try:
        yield
    finally:
        lib.mh_amx_switch(before)


@torch.compiler.assume_constant_result
def vector_bits() -> int:
    """The SIMD width the kernels were compiled for here: 512 (AVX-512), 256 or 128; 0 if
    they are not available.

    Their register tiles are chosen at compile time for the width: AVX-512 (32 zmm
    registers) and AVX2 (16 ymm registers) each have their own, measured; narrower
    vectors run the AVX2 tiles split by the compiler, correct but not measured, so
    ``"auto"`` (its thresholds per width), the fused decoding step and the few-row
    projections only use the kernels at 512 and 256.
    """
    return 0 if _library() is None else _bits


def advance_counters(lengths: torch.Tensor, slot_pos: torch.Tensor) -> bool:
    """A cache's counters after one token per row, in one C call: ``slot_pos[b, L_b] = L_b``, then
    ``lengths[b] = L_b + 1`` for every row b (``L_b = lengths[b]``), as
    :meth:`multihead.KVCache.commit` (which calls this) would with two torch
    operations, whose dispatch, with the caches cold after a decoding step's kernel, costs about
    4× this call (110 vs 25 µs measured, the commit alone).

    Args:
        lengths: (B,) int64; slot_pos: (B, C) int64, unit stride along C; CPU.

    Returns:
        True when written; False (nothing written, the caller writes) where the library is not
        loaded yet (this never builds it), or a tracer, a dispatch mode or the profiler must
        see the writes (:func:`.ops.direct`), or the tensors are not plain int64 CPU tensors of
        that layout.

    Raises:
        ValueError: a row's length is outside [0, C) (nothing is written).
    """
    fn = _advance
    if fn is None or not ops.direct(lengths, slot_pos):
        return False
    if not (lengths.is_cpu and slot_pos.is_cpu and lengths.dtype == slot_pos.dtype == torch.int64
            and lengths.dim() == 1 and slot_pos.dim() == 2 and lengths.shape[0] == slot_pos.shape[0]
            and lengths.stride(0) == 1 and slot_pos.stride(1) == 1):
        return False
    if fn(lengths.data_ptr(), slot_pos.data_ptr(), slot_pos.shape[0], slot_pos.stride(0), slot_pos.shape[1]) != 0:
        raise ValueError(f"lengths must lie in [0, {slot_pos.shape[1]}) (the cache's capacity) to advance, "
                         f"got {lengths.tolist()}")
    return True


def status() -> str:
    """Why the kernel is or is not available ("not built yet" before first use)."""
    return _loaded()[1] if _loaded.cache_info().currsize else "not built yet"


def _require():  # type: ignore[no-untyped-def]
    lib = _library()
    if lib is None:
        raise RuntimeError(f"the native kernel is not available: {status()}")
    return lib


def _not_ready() -> str | None:
    return None if available() else f"running here: the native kernel is not available ({status()})"


#: Query positions per work item of the FlashAttention loop (items are (batch, K/V head, query
#: tile)), per vector width; 48 for the others. Each item packs the keys its rows see once, so
#: larger tiles pack less: with AVX-512 (Intel Xeon, 2 cores, H=12, D=64, paired medians of 9)
#: 144 positions take 0.93× the time of 48 (S=1024 and 2048, without a mask and causal), 192
#: 0.91-0.93×, at S=512 causal 0.98× / 0.95×; 144 keeps more items for machines with more cores.
_QUERY_TILES = {512: 144}
#: Set (tests): the tile for every width instead.
_QUERY_TILE: int | None = None


def _query_tile() -> int:
    return _QUERY_TILE or _QUERY_TILES.get(_bits, 48)


def attention_f32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention with the native kernel, forward only (no autograd).

    Work items are (batch, K/V head, tile of query positions); each packs its keys in
    panels and runs the FlashAttention loop over chunks of keys.

    Args:
        q: (B, H, Sq, D); k: (B, Hkv, Sk, D); v: (B, Hkv, Sk, Dv); CPU tensors of one
            dtype, float32, bfloat16 or float16 (computed in float32), H a multiple of
            Hkv. Any strides (rows are made contiguous if their last dim is not).
        scale, causal, window: as in :func:`multihead.attention` (bottom-right aligned).
        mask: bool, broadcastable to (B, H, Sq, Sk), True = may attend; or None.
        return_lse: also return the per-row log-sum-exp (B, H, Sq) float32 of the
            scaled, capped, biased, masked scores (``-inf`` for rows with no key; the sink
            left out, as the torch backends leave it).
        softcap, alibi_slopes (H,), sinks (H,): the logit features of :mod:`multihead.logits`.
        cu_seqlens: (N+1,) or (B, N+1) cumulative lengths of packed sequences (Sq == Sk):
            each query sees keys of its own sequence only, and key panels outside a tile's
            sequences are never computed.

    Returns:
        (B, H, Sq, Dv) in q's dtype, a view of a (B, Sq, H, Dv) buffer; zeros for rows
        with no key; and lse (float32) with ``return_lse``.

    Raises:
        TypeError, ValueError: tensors of the wrong dtype, device or shapes.
        RuntimeError: the kernel is not available (see :func:`status`).
    """
    _check_logits(q, k, softcap, alibi_slopes, sinks, cu_seqlens)
    return _run("mh_attention_f32", q, k, v, scale, causal, window, mask, return_lse, _query_tile(),
                logits=Logits(softcap, alibi_slopes, sinks, cu_seqlens))


def key_panels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = False,
               window: int | None = None, cu_seqlens: torch.Tensor | None = None) -> int:
    """How many q·kᵀ key panels (NR keys × a tile of query rows) the FlashAttention loop computes
    for this problem: the evidence that packed sequences spend no scores across sequences
    (the tests compare it with the panels the query tiles' sequences and structure cover)."""
    _check_logits(q, k, None, None, None, cu_seqlens)
    counter = torch.zeros(1, dtype=torch.int64)
    _run("mh_attention_f32", q, k, v, scale, causal, window, None, False, _query_tile(),
         logits=Logits(cu_seqlens=cu_seqlens, panels=counter))
    return int(counter.item())


def decode_f32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As :func:`attention_f32`, for few query rows per K/V head (G·Sq, e.g. decoding).

    K and V are streamed once, in place (no packing); work items are (batch, K/V head,
    key split): long key ranges are split into parts of at least 512 keys, merged by
    their log-sum-exp (as in flash-decoding). The parts depend on the problem alone,
    never on the thread count, so results are bitwise the same with any number of threads.
    """
    return _run("mh_decode_f32", q, k, v, scale, causal, window, mask, return_lse)


def _check_qkv(q_in: object, k_in: object, v_in: object, mask_in: object, window: object) -> None:
    """The kernel reads raw memory: shapes, dtypes and devices are checked first."""
    q, k, v = (check_tensor(name, t, ndim=4) for name, t in (("q", q_in), ("k", k_in), ("v", v_in)))
    if q.dtype not in SUFFIX or q.device.type != "cpu":
        raise TypeError(f"q must be a float32, bfloat16 or float16 CPU tensor, got {q.dtype} on {q.device}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype or t.device.type != "cpu":
            raise TypeError(f"{name} must be a CPU tensor of q's dtype {q.dtype}, got {t.dtype} on {t.device}")
    b, h, sq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must be (B={b}, Hkv, Sk, D) and (B, Hkv, Sk, Dv) alike, "
                         f"got {list(k.shape)} and {list(v.shape)}")
    if k.shape[-1] != d:
        raise ValueError(f"k must have head dim {d} like q, got shape {list(k.shape)}")
    if k.shape[1] == 0 or h % k.shape[1] or 0 in (d, v.shape[-1]):
        raise ValueError(f"q's heads ({h}) must be a positive multiple of k's ({k.shape[1]}), head dims > 0")
    if mask_in is not None:
        mask = check_tensor("mask", mask_in, ndim=(0, 1, 2, 3, 4))
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = may attend), got dtype {mask.dtype}")
        try:
            torch.broadcast_shapes(mask.shape, (b, h, sq, k.shape[2]))
        except RuntimeError:
            raise ValueError(f"mask must broadcast to [B, H, Sq, Sk] = {[b, h, sq, k.shape[2]]}, "
                             f"got {list(mask.shape)}") from None
    if window is not None:
        check_int("window", window)


class Logits(NamedTuple):
    """The logit features and packed sequences of a call of the FlashAttention loop (None = off)."""

    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None  # (H,)
    sinks: torch.Tensor | None = None  # (H,)
    cu_seqlens: torch.Tensor | None = None  # (N+1,) or (B, N+1)
    panels: torch.Tensor | None = None  # (1,) int64 counter of the key panels computed (tests)

    def any(self) -> bool:
        return any(value is not None for value in self)

    def arguments(self, seq: int) -> tuple[object, ...]:
        """The C arguments: softcap, slopes, sinks, segment bounds, their batch stride, counter;
        with the tensors that must outlive the call (kept by the caller)."""
        slopes, sinks = (None if t is None else t.detach().float().contiguous()
                         for t in (self.alibi_slopes, self.sinks))
        seg = None if self.cu_seqlens is None else segment_bounds(self.cu_seqlens, seq)  # (B|1, 2, S)
        seg_bs = 0 if seg is None or seg.shape[0] == 1 else seg.stride(0)
        return (float(self.softcap or 0.0), ptr(slopes), ptr(sinks), ptr(seg), seg_bs, ptr(self.panels),
                slopes, sinks, seg)


def _check_logits(q: object, k: object, softcap: object, alibi_slopes: object, sinks: object,
                  cu_seqlens: object) -> None:
    """The features read as raw memory: (H,) float tensors, cu_seqlens rising from 0 to Sq == Sk."""
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4 or k.dim() != 4:
        return  # _check_qkv names the bad tensor
    if softcap is not None:
        check_float("softcap", softcap, low=0.0, high=math.inf, low_inclusive=False, high_inclusive=False)
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None:
            t = check_tensor(name, t, ndim=1)
            if not t.dtype.is_floating_point or t.device.type != "cpu" or t.shape[0] != q.shape[1]:
                raise ValueError(f"{name} must be a floating CPU tensor [H] = [{q.shape[1]}], got {t.dtype} "
                                 f"{list(t.shape)} on {t.device}")
    if cu_seqlens is not None:
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"cu_seqlens needs Sq == Sk, got Sq={q.shape[2]}, Sk={k.shape[2]}")
        check_cu_seqlens(cu_seqlens, q.shape[2], batch=q.shape[0])


def _run(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
         window: int | None, mask: torch.Tensor | None, return_lse: bool, *extra: int, checked: bool = False,
         logits: Logits | None = None,
         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if not checked:  # the "native" backend's callers validated everything once already
        _check_qkv(q, k, v, mask, window)
    lib = _require()
    b, h, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty((b, sq, h, dv), dtype=q.dtype).permute(0, 2, 1, 3)  # (B, H, Sq, Dv)
    lse = torch.empty((b, h, sq), dtype=torch.float32) if return_lse else None  # (B, H, Sq)
    if mask is not None:
        mask = mask[(None,) * (4 - mask.dim())].expand(b, h, sq, sk)  # strides 0 where broadcast
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
               *(mask.stride() if mask is not None else (0, 0, 0, 0)),
               *(lse.stride() if lse is not None else (0, 0, 0)))
    logits = logits or Logits()
    features: tuple[object, ...] = ()
    keep: tuple[object, ...] = ()  # the tensors behind the features' pointers, alive through the call
    if name == "mh_attention_f32":
        arguments = logits.arguments(sq)
        features, keep = arguments[:6], arguments[6:]
    elif logits.any():
        raise ValueError(f"{name} takes no logit features or packed sequences (the FlashAttention loop does)")
    code = kernel(lib, name, q.dtype)(
        ptr(q), ptr(k), ptr(v), ptr(out), ptr(lse), ptr(mask),
        int64s((b, h, hkv, sq, sk, d, dv)), int64s(strides), float(scale), int(causal), int(window or 0),
        *features, *extra, torch.get_num_threads())
    del keep
    if code == -1:
        raise MemoryError("the native attention kernel could not allocate its buffers")
    if code != 0:
        raise RuntimeError(f"the native attention kernel refused the problem (code {code})")
    if lse is not None:
        return out, lse
    return out


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
        RuntimeError: the kernel is not available (see :func:`status`).
    """
    check_tensor("x", x, ndim=2)
    if not 1 <= x.shape[0] <= MAX_STEP_ROWS:
        raise ValueError(f"x must have 1 to {MAX_STEP_ROWS} rows, got shape {list(x.shape)}")
    for name, t in [("x", x)] + [(f"layers[{i}][{j}]", t) for i, layer in enumerate(layers)
                                 for j, t in enumerate(layer) if t is not None]:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}"
                            f"{'' if t.is_contiguous() else ', not contiguous'}")
    for i, (w, bias) in enumerate(layers):
        if w.dim() != 2 or w.shape[1] != x.shape[1] or w.shape[0] == 0:
            raise ValueError(f"layers[{i}] weight must be (N, {x.shape[1]}), got {list(w.shape)}")
        if bias is not None and tuple(bias.shape) != (w.shape[0],):
            raise ValueError(f"layers[{i}] bias must be ({w.shape[0]},), got {list(bias.shape)}")
    lib = _require()
    m, k = x.shape
    outs = [torch.empty((m, w.shape[0]), dtype=torch.float32) for w, _ in layers]
    code = lib.mh_linear_few_rows_f32(
        ptr(x), m, k, len(layers), pointers([w for w, _ in layers]), int64s([w.shape[0] for w, _ in layers]),
        pointers([b for _, b in layers]), pointers(outs), torch.get_num_threads())
    if code != 0:
        raise RuntimeError(f"the native linear kernel refused the problem (code {code})")
    return outs


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
) -> torch.Tensor:
    """A whole decoding step of a layer in one call (one token per row, B ≤ :data:`MAX_STEP_ROWS`).

    Projects x to q, k, v, rotates q and k at each row's position ``lengths[b]``, writes
    k and v into the cache at that slot, attends over the row's ``lengths[b] + 1`` keys
    and projects with W_o. It does **not** advance the cache's counters: the caller
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

    Returns:
        y: (B, E) in x's dtype.
    """
    _check_step_dtypes(x, layers, rope, cache_k, cache_v)
    lib = _require()
    b, e = x.shape
    y = torch.empty((b, e), dtype=x.dtype)
    cos, sin, rotary_dim, interleaved = rope if rope is not None else (None, None, 0, False)
    code = kernel(lib, "mh_decode_step_f32", x.dtype)(
        ptr(x), b, e, pointers([w for w, _ in layers]), pointers([bias for _, bias in layers]),
        num_heads, num_kv_heads, head_dim, ptr(cos), ptr(sin), rotary_dim, int(interleaved),
        ptr(cache_k), ptr(cache_v), int64s(cache_k.stride()[:3]), int64_ptr(lengths),
        float(scale), ptr(y), None, torch.get_num_threads(), None, 0, 0)
    if code == -1:
        raise MemoryError("the native decoding step could not allocate its buffers")
    if code != 0:
        raise RuntimeError(f"the native decoding step refused the problem (code {code})")
    return y


class StepPlan:
    """:func:`decode_step`'s C arguments for one layer and cache, marshalled once.

    Marshalling them (ctypes arrays of pointers and strides, casts, dtype checks) costs
    more than a small layer's whole step when the interpreter's caches are cold, as they
    are at every step of a model that streams its weights. A plan keeps them, with the
    tensors they point into (so that their storage lives as long as the plan: a pointer
    in it can never be reused by another tensor). :meth:`key` is compared at every use:
    a replaced or moved weight, table or buffer, another row count, dtype or thread count
    makes a new plan, never a stale pointer. The caller has validated the tensors (as for
    :func:`decode_step`; :func:`multihead.decode.fused_step` does).

    Unlike :func:`decode_step`, a plan's step also advances the cache's counters, in the
    same C call once everything else is written (as :func:`advance_counters`, which
    ``KVCache.commit`` calls): after the kernel, a step of a model that streams its weights
    finds the interpreter's caches cold again, and the commit's Python took 0.1-0.17 ms.

    Args: as :func:`decode_step`'s, with ``rows`` B, ``dtype`` the step's and ``slot_pos``
    the cache's (B, C) int64 slot positions, unit stride along C.
    """

    def __init__(self, rows: int, layers: list[tuple[torch.Tensor, torch.Tensor | None]], *, num_heads: int,
                 num_kv_heads: int, head_dim: int, rope: tuple[torch.Tensor, torch.Tensor, int, bool] | None,
                 cache_k: torch.Tensor, cache_v: torch.Tensor, lengths: torch.Tensor, slot_pos: torch.Tensor,
                 scale: float, dtype: torch.dtype) -> None:
        self.key = StepPlan.key_of(rows, layers, rope, cache_k, cache_v, lengths, slot_pos, dtype,
                                   (num_heads, num_kv_heads, head_dim, float(scale)))
        #: Every tensor the plan points into, in a fixed order (the cache's four last), held so
        #: that their storage lives as long as the plan.
        self.tensors: tuple[torch.Tensor, ...] = tuple(t for t in (
            *(t for pair in layers for t in pair), *(rope[:2] if rope is not None else ()), cache_k, cache_v, lengths,
            slot_pos) if t is not None)
        #: Set by :mod:`multihead.decode` after a step that asked every condition: what they read
        #: then, so that a later step may skip asking them while it is unchanged (opaque here).
        self.guard: object = None
        e = layers[0][0].shape[1]
        cos, sin, rotary_dim, interleaved = rope if rope is not None else (None, None, 0, False)
        #: (B, 2, Hkv, D): the slots the last step wrote, as they were before (see :meth:`undo`).
        self.saved = torch.empty((rows, 2, num_kv_heads, head_dim), dtype=dtype)
        self._fn = kernel(_require(), "mh_decode_step_f32", dtype)
        self._shape, self._dtype = (rows, 1, e), dtype
        self._args = (rows, e, pointers([w for w, _ in layers]), pointers([b for _, b in layers]), num_heads,
                      num_kv_heads, head_dim, ptr(cos), ptr(sin), rotary_dim, int(interleaved), ptr(cache_k),
                      ptr(cache_v), int64s(cache_k.stride()[:3]), int64_ptr(lengths), float(scale))
        self._counters = (slot_pos.data_ptr(), slot_pos.stride(0), slot_pos.shape[1])

    @staticmethod
    def key_of(rows: int, layers: list[tuple[torch.Tensor, torch.Tensor | None]],
               rope: tuple[torch.Tensor, torch.Tensor, int, bool] | None, cache_k: torch.Tensor,
               cache_v: torch.Tensor, lengths: torch.Tensor, slot_pos: torch.Tensor, dtype: torch.dtype,
               shape: tuple[int, int, int, float]) -> tuple[object, ...]:
        """What a plan's arguments depend on: data pointers, strides, rows, dtype, threads, and
        ``shape`` (H, Hkv, D, scale): the layer's, which a user may reassign (``layer.scale``)."""
        return (rows, dtype, torch.get_num_threads(), shape, *(ptr(t) for pair in layers for t in pair),
                None if rope is None else (rope[0].data_ptr(), rope[1].data_ptr(), rope[2], rope[3]),
                cache_k.data_ptr(), cache_v.data_ptr(), cache_k.stride(), lengths.data_ptr(), slot_pos.data_ptr(),
                slot_pos.shape, slot_pos.stride())

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The step for x (B, E) or (B, 1, E), contiguous, of the plan's dtype: y (B, 1, E).
        K and V written, the counters advanced; the written slots' old K and V are kept in
        :attr:`saved`. Nothing is written if it fails (every row must have room)."""
        y = torch.empty(self._shape, dtype=self._dtype)
        code = self._fn(x.data_ptr(), *self._args, y.data_ptr(), self.saved.data_ptr(), torch.get_num_threads(),
                        *self._counters)
        if code == -1:
            raise MemoryError("the native decoding step could not allocate its buffers")
        if code != 0:
            raise RuntimeError(f"the native decoding step refused the problem (code {code})")
        return y

    def undo(self, lengths: list[int]) -> None:
        """Undo the last :meth:`run` if it ran (the counters say so; a failure after the kernel,
        such as an interrupt as it returns): the slots it wrote at ``lengths`` (each row's
        length before it) and the counters put back, the cache then bitwise as it was."""
        cache_k, cache_v, counts, slot_pos = self.tensors[-4:]
        if counts.tolist() == lengths:
            return  # it wrote nothing
        for b, n in enumerate(lengths):
            cache_k[b, :, n] = self.saved[b, 0]
            cache_v[b, :, n] = self.saved[b, 1]
            slot_pos[b, n] = -1  # a linear cache's slots past its length hold -1
        counts.copy_(torch.tensor(lengths, dtype=counts.dtype))


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


def rows_per_kv_head(q: torch.Tensor, k: torch.Tensor) -> int:
    """Sq·G: the query rows that share one K/V head (few: the decoding loop)."""
    return q.shape[2] * (q.shape[1] // k.shape[1])


#: At most this many query rows per K/V head (Sq·G) take the decoding loop.
DECODE_ROWS = 32


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool, window: int | None,
        mask: torch.Tensor | None, return_lse: bool = False, decode: bool | None = None,
        softcap: float | None = None, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The native loop for these tensors (decoding loop for few rows per K/V head, else
    the FlashAttention loop), half precision read and written as such and computed in
    float32: ``(out, lse or None)``.

    The logit features and packed sequences (``cu_seqlens``, as structure: no key panel
    outside a query's sequences is computed) run in the FlashAttention loop only, so they
    take it whatever ``decode`` says. Runs the operator ``multihead::attention``
    (:mod:`.ops`): differentiable (the native backward) without them, traceable by
    ``torch.compile`` and ``torch.export``; in eager calls without gradients its body
    directly (:func:`.ops.direct`)."""
    if any(t is not None for t in (softcap, alibi_slopes, sinks, cu_seqlens)):
        decode = False  # the decoding loop takes none of them
    decode = rows_per_kv_head(q, k) <= DECODE_ROWS if decode is None else decode
    if ops.direct(q, k, v, mask, alibi_slopes, sinks, cu_seqlens):  # the operator's body, without its dispatch
        out, lse = ops.forward(q, k, v, mask, float(scale), bool(causal), window, decode, softcap, alibi_slopes,
                               sinks, cu_seqlens, return_lse=return_lse)
    else:
        out, lse = torch.ops.multihead.attention(q, k, v, mask, float(scale), bool(causal), window, decode,
                                                 None if softcap is None else float(softcap), alibi_slopes, sinks,
                                                 cu_seqlens)
    return out, (lse if return_lse else None)


@register_backend("native", lse=True, grad=True, dtypes=DTYPES, devices=frozenset({"cpu"}), ready=_not_ready,
                  softcap=True, alibi=True, sinks=True, varlen=True, grad_features=frozenset())
def native_backend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    mask: torch.Tensor | None, causal: bool, window: int | None, scale: float,
    dropout_p: float, return_weights: bool, return_lse: bool, softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """The compiled kernels: float32, bfloat16, float16 (computed in float32, no float32
    copies), CPU, with the native backward for gradients (half precision: computed on
    float32 copies). Soft-capping, ALiBi, sinks and packed sequences (``cu_seqlens`` as
    structure) in the forward; its backward takes none of them: the registry refuses
    gradients with a logit feature here by name, and packed sequences with gradients reach
    it as a dense mask.

    Anything else (dropout, weights, float64, another device, no compiler here) is
    refused by the registry before the call, naming what is missing.
    """
    out, lse = run(q, k, v, scale=scale, causal=causal, window=window, mask=mask, return_lse=return_lse,
                   softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, cu_seqlens=cu_seqlens)
    return out, None, lse
