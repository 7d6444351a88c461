"""The two attention loops' entry points: the FlashAttention loop and the decoding loop, with
the checks of what they read as raw memory and the call that runs either.

Notation: B batch, H query heads, Hkv key/value heads (G = H / Hkv), Sq queries, Sk keys,
D head dim, Dv value head dim.

:func:`attention_f32` and :func:`decode_f32` check their arguments and call the kernel
(:func:`run_kernel`) eagerly; the operator ``multihead::attention`` (:mod:`.ops`) runs
:func:`run_kernel` as its body, and :func:`.ops.run` chooses between the two (and between the
loops, by :data:`DECODE_ROWS`). The query tile of the FlashAttention loop is tuned per vector
width here (:func:`query_tile`). Nothing happens at import time.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..._checks import check_float, check_int, check_tensor
from ...logits import relative_dense
from ...masks import packed_bounds
from . import loader
from ._ffi import SUFFIX, kernel, ptr
from .loader import require

__all__ = ["attention_f32", "check_operator_inputs", "key_panels", "decode_f32", "Logits", "Tiles", "MAX_BLOCK_KEYS",
           "run_kernel", "PlainCall",
           "query_tile", "QUERY_TILE", "rows_per_kv_head", "DECODE_ROWS", "LANE_KEYS", "LANE_ROWS",
           "decoding_loop_fits"]

_CPU = torch.device("cpu")  # the outputs' device, named (a default device set by the user must not move them)

#: Query positions per work item of the FlashAttention loop (items are (batch, K/V head, query
#: tile)), per vector width; 48 for the others. Each item packs the keys its rows see once, so
#: larger tiles pack less: with AVX-512 (Intel Xeon, 2 cores, H=12, D=64, paired medians of 9)
#: 144 positions take 0.93× the time of 48 (S=1024 and 2048, without a mask and causal), 192
#: 0.91-0.93×, at S=512 causal 0.98× / 0.95×; 144 keeps more items for machines with more cores.
_QUERY_TILES = {512: 144}
#: Set (tests): the tile for every width instead.
QUERY_TILE: int | None = None


def query_tile() -> int:
    """The FlashAttention loop's query tile for the loaded kernel's vector width (or
    :data:`QUERY_TILE` where set)."""
    return QUERY_TILE or _QUERY_TILES.get(loader.loaded_bits, 48)


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
    tiles: Tiles | None = None,
    bias: torch.Tensor | None = None,
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
        tiles: a block mask (:class:`Tiles`; not with ``mask``): its empty tiles are never
            computed, its full ones read no mask.
        bias: an additive float bias broadcastable to (B, H, Sq, Sk) on the scaled logits, after
            soft-capping and ALiBi (read in float32).

    Returns:
        (B, H, Sq, Dv) in q's dtype, a view of a (B, Sq, H, Dv) buffer; zeros for rows
        with no key; and lse (float32) with ``return_lse``.

    Raises:
        TypeError, ValueError: tensors of the wrong dtype, device or shapes.
        RuntimeError: the kernel is not available (see :func:`.loader.status`).
    """
    _check_logits(q, k, softcap, alibi_slopes, sinks, cu_seqlens)
    return run_kernel("mh_attention_f32", q, k, v, scale, causal, window, mask, return_lse, query_tile(),
                      logits=Logits(softcap, alibi_slopes, sinks, cu_seqlens, tiles=tiles, bias=bias))


def key_panels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = False,
               window: int | None = None, cu_seqlens: torch.Tensor | None = None,
               tiles: Tiles | None = None) -> int:
    """How many q·kᵀ key panels (NR keys × a tile of query rows) the FlashAttention loop computes
    for this problem: the evidence that packed sequences spend no scores across sequences, and
    a block mask none in its empty tiles (the tests compare it with the panels the query tiles'
    sequences, structure and tiles cover)."""
    _check_logits(q, k, None, None, None, cu_seqlens)
    counter = torch.zeros(1, dtype=torch.int64, device=q.device)
    run_kernel("mh_attention_f32", q, k, v, scale, causal, window, None, False, query_tile(),
               logits=Logits(cu_seqlens=cu_seqlens, panels=counter, tiles=tiles))
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
    return run_kernel("mh_decode_f32", q, k, v, scale, causal, window, mask, return_lse)


def check_operator_inputs(q: object, k: object, v: object, mask: object, window: object, softcap: object = None,
                          alibi_slopes: object = None, sinks: object = None, cu_seqlens: object = None) -> None:
    """What the operator ``multihead::attention`` checks in its own entry before the kernels read
    memory (it may be called directly, not through :func:`multihead.attention`): the tensors'
    types, devices, dtypes (float64 too: its plain loop) and shapes, the mask's broadcast, the
    features' shapes and ``cu_seqlens``.

    Raises:
        TypeError, ValueError: naming the argument, expected against got.
    """
    _check_qkv(q, k, v, mask, window, float64=True)
    _check_logits(q, k, softcap, alibi_slopes, sinks, cu_seqlens)


def _check_qkv(q_in: object, k_in: object, v_in: object, mask_in: object, window: object,
               float64: bool = False) -> None:
    """The kernel reads raw memory: shapes, dtypes and devices are checked first."""
    q, k, v = (check_tensor(name, t, ndim=4) for name, t in (("q", q_in), ("k", k_in), ("v", v_in)))
    if (q.dtype not in SUFFIX and not (float64 and q.dtype == torch.float64)) or q.device.type != "cpu":
        raise TypeError(f"q must be a float32, bfloat16 or float16{' (or float64)' if float64 else ''} CPU tensor, "
                        f"got {q.dtype} on {q.device}")
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
            if torch.broadcast_shapes(mask.shape, (b, h, sq, k.shape[2])) != (b, h, sq, k.shape[2]):
                raise RuntimeError("broadcasts to more")
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
    tiles: Tiles | None = None  # a block mask's tile classes and bytes
    bias: torch.Tensor | None = None  # an additive bias broadcastable to (B, H, Sq, Sk)
    relative: torch.Tensor | None = None  # (B|1, H|1, Sq + Sk - 1): bias [b, h, i, j] = relative[b, h, j - i + Sq - 1]

    def any(self) -> bool:
        return any(value is not None for value in self)

    def arguments(self, seq: int) -> tuple[object, ...]:
        """The C arguments: softcap, slopes, sinks, segment bounds, their batch stride, counter,
        tiles, their strides and block sizes, the partial tiles' bytes; with the tensors that must
        outlive the call (kept by the caller)."""
        slopes, sinks = (None if t is None else t.detach().float().contiguous()
                         for t in (self.alibi_slopes, self.sinks))
        seg = None if self.cu_seqlens is None else packed_bounds(self.cu_seqlens, seq)  # (B|1, 2, S)
        seg_bs = 0 if seg is None or seg.shape[0] == 1 else seg.stride(0)
        tiles = self.tiles
        tile_args: tuple[object, ...] = (None, (), None) if tiles is None else tiles.arguments()
        bias_args = _bias_pointer(self.bias, self.relative)  # checked by run_kernel
        return (float(self.softcap or 0.0), ptr(slopes), ptr(sinks), ptr(seg), seg_bs, ptr(self.panels),
                *tile_args, *bias_args, slopes, sinks, seg, tiles, self.bias, self.relative)



#: The largest key block the FlashAttention loop takes a block mask in.
MAX_BLOCK_KEYS = 1024


class Tiles(NamedTuple):
    """A block mask as the FlashAttention loop reads it (:class:`multihead.BlockMask`'s layout).

    Attributes:
        classes: int32 (B|1, H|1, nQ, nK), nQ = ⌈Sq / bq⌉, nK = ⌈Sk / bk⌉: ``-1`` no pair of
            the tile may attend (skipped), ``-2`` every pair may, ``p >= 0`` the tile's bytes
            are ``partial[p]``.
        partial: uint8 (P, bq, bk), contiguous, 1 = may attend.
        bq, bk: query and key block sizes (bk a multiple of 32, at most 1024).
    """

    classes: torch.Tensor
    partial: torch.Tensor
    bq: int
    bk: int

    def check(self, b: int, h: int, sq: int, sk: int) -> None:
        """What the kernel reads as raw memory, checked first: the classes' dtype, shape and values,
        the partial tiles' dtype, shape and layout, the block sizes.

        Raises:
            TypeError, ValueError: naming the field, expected against got.
        """
        c, part, bq, bk = self.classes, self.partial, self.bq, self.bk
        check_int("bq", bq, minimum=1)
        check_int("bk", bk, minimum=32, maximum=MAX_BLOCK_KEYS)
        if bk % 32:
            raise ValueError(f"bk must be a multiple of 32, got {bk}")
        want = (-(-sq // bq), -(-sk // bk))
        if (not isinstance(c, torch.Tensor) or c.dtype != torch.int32 or c.dim() != 4 or c.device.type != "cpu"
                or c.shape[0] not in (1, b) or c.shape[1] not in (1, h) or tuple(c.shape[2:]) != want):
            got = f"{c.dtype} {list(c.shape)}" if isinstance(c, torch.Tensor) else type(c).__name__
            raise ValueError(f"tile classes must be int32 CPU [B|1, H|1, nQ, nK] = [{b}|1, {h}|1, {want[0]}, "
                             f"{want[1]}], got {got}")
        if (not isinstance(part, torch.Tensor) or part.dtype not in (torch.uint8, torch.bool) or part.dim() != 3
                or tuple(part.shape[1:]) != (bq, bk) or not part.is_contiguous() or part.device.type != "cpu"):
            got = f"{part.dtype} {list(part.shape)}" if isinstance(part, torch.Tensor) else type(part).__name__
            raise ValueError(f"partial tiles must be contiguous uint8 CPU [P, bq, bk] = [P, {bq}, {bk}], got {got}")
        if c.numel() and (int(c.min()) < -2 or int(c.max()) >= part.shape[0]):
            raise ValueError(f"tile classes must be -1, -2 or an index below {part.shape[0]} (the partial tiles), "
                             f"got values in [{int(c.min())}, {int(c.max())}]")

    def dense(self, sq: int, sk: int) -> torch.Tensor:
        """The mask it stands for: bool (B|1, H|1, Sq, Sk), True = may attend."""
        c = self.classes.long()  # (Bm, Hm, nQ, nK)
        bm, hm, nq, nk = c.shape
        blank = torch.zeros(1, self.bq, self.bk, dtype=torch.bool, device=c.device)  # (1, bq, bk)
        tile_bytes = torch.cat((self.partial.bool(), blank, ~blank))  # (P + 2, bq, bk): then EMPTY, FULL
        empty, full_tile = self.partial.shape[0], self.partial.shape[0] + 1
        pick = torch.where(c == -1, empty, torch.where(c == -2, full_tile, c))  # (Bm, Hm, nQ, nK)
        blocks = tile_bytes[pick]  # (Bm, Hm, nQ, nK, bq, bk)
        full = blocks.permute(0, 1, 2, 4, 3, 5).reshape(bm, hm, nq * self.bq, nk * self.bk)
        return full[:, :, :sq, :sk]

    def arguments(self) -> tuple[object, ...]:
        """tiles, (4 strides, bq, bk), partial: the C arguments (callers keep ``self`` alive)."""
        c = self.classes
        strides = tuple(0 if c.shape[i] == 1 else c.stride(i) for i in range(4))
        return c.data_ptr(), (*strides, self.bq, self.bk), self.partial.data_ptr()


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
        packed_bounds(cu_seqlens, q.shape[2], q.shape[0])  # checked once per cu_seqlens tensor (read on the host)


#: The FlashAttention loop's features when none is given: softcap, slopes, sinks, segments, their
#: batch stride, panel counter, the block mask (tiles, their strides and sizes, partial bytes) and the
#: bias (address, strides).
_NO_LOGITS = (0.0, None, None, None, 0, None, None, (), None, None, ())
_NO_MASK_STRIDES = (0, 0, 0, 0)
_NO_LSE_STRIDES = (0, 0, 0)


def run_kernel(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
               window: int | None, mask: torch.Tensor | None, return_lse: bool, *extra: int, checked: bool = False,
               logits: Logits | None = None,
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One call of the loop ``name`` (``"mh_attention_f32"`` or ``"mh_decode_f32"``, run in q's
    dtype's kernel).

    Args:
        q: (B, H, Sq, D); k: (B, Hkv, Sk, D); v: (B, Hkv, Sk, Dv); mask broadcastable to
            (B, H, Sq, Sk) or None; scale, causal, window, return_lse: as :func:`attention_f32`'s.
        extra: the loop's own arguments before the thread count (the FlashAttention loop's
            query tile, :func:`query_tile`).
        checked: the caller validated the tensors (else :func:`_check_qkv` does).
        logits: the FlashAttention loop's logit features and packed sequences.

    Returns:
        out (B, H, Sq, Dv) in q's dtype, a view of a (B, Sq, H, Dv) buffer; with
        ``return_lse`` also lse (B, H, Sq) float32.
    """
    if not checked:  # the "native" backend's callers validated everything once already
        _check_qkv(q, k, v, mask, window)
    fn = kernel(require(), name, q.dtype)
    b, h, sq, d = q.shape
    _, hkv, sk, dv = v.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    out = torch.empty_strided((b, h, sq, dv), (sq * h * dv, dv, h * dv, 1), dtype=q.dtype,
                              device=q.device)  # (B, Sq, H, Dv) memory
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device) if return_lse else None  # (B, H, Sq)
    if mask is not None:
        mask = _expanded(mask, (b, h, sq, sk))  # strides 0 where broadcast
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    strides = (qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], sq * h * dv, dv, h * dv,
               *(_NO_MASK_STRIDES if mask is None else mask.stride()),
               *(_NO_LSE_STRIDES if lse is None else (h * sq, sq, 1)))
    features: tuple[object, ...] = ()
    keep: tuple[object, ...] = ()  # the tensors behind the features' pointers, alive through the call
    if logits is not None and (logits.bias is not None or logits.relative is not None):
        logits = _checked_biases(logits, b, h, sq, sk)
    if logits is not None and logits.tiles is not None:
        if mask is not None:
            raise ValueError("a block mask (tiles) and a dense mask cannot be given together: fold the mask "
                             "into the block mask")
        logits.tiles.check(b, h, sq, sk)
    if name == "mh_attention_f32":
        if logits is None or not logits.any():
            features = _NO_LOGITS
        else:
            arguments = logits.arguments(sq)
            features, keep = arguments[:11], arguments[11:]
    elif logits is not None and logits.any():
        raise ValueError(f"{name} takes no logit features or packed sequences (the FlashAttention loop does)")
    code = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), None if lse is None else lse.data_ptr(),
              None if mask is None else mask.data_ptr(), (b, h, hkv, sq, sk, d, dv), strides, float(scale), int(causal),
              window or 0, *features, *extra, torch.get_num_threads())
    del keep
    if code != 0:
        _refused(code)
    if lse is not None:
        return out, lse
    return out


def _expanded(mask: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """``mask``, broadcastable to ``shape``, as a view of that shape (strides 0 where broadcast)."""
    if mask.dim() < 4:
        mask = mask[(None,) * (4 - mask.dim())]
    return mask if mask.shape == shape else mask.expand(shape)


class PlainCall:
    """One call signature's kernel call, made once: a loop (the decoding loop or the FlashAttention
    loop) for tensors of these shapes and dtype, with no logit feature, lse or gradient, as
    :func:`run_kernel` would call it; per call only the pointers, strides, the mask and the output
    are new.

    Built by :func:`multihead.attention`'s remembered plan for such a signature; the shapes,
    dtype and device it was built for are the plan's key, checked by the caller's validation.
    """

    __slots__ = ("_lib", "_fn", "_decode", "_size", "_out_strides", "_dtype", "_shape", "_tail", "_last",
                 "_mask_shape", "_last_mask")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decode: bool) -> None:
        """q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv): the signature's tensors (any
        strides); ``decode``: the decoding loop, else the FlashAttention loop."""
        b, h, sq, d = q.shape
        _, hkv, sk, dv = v.shape
        self._lib = require()
        self._fn = kernel(self._lib, "mh_decode_f32" if decode else "mh_attention_f32", q.dtype)
        self._decode = decode
        self._size, self._out_strides = (b, h, sq, dv), (sq * h * dv, dv, h * dv, 1)  # (B, Sq, H, Dv) memory
        self._dtype = q.dtype
        self._shape = (b, h, hkv, sq, sk, d, dv)
        self._tail = (sq * h * dv, dv, h * dv, *_NO_MASK_STRIDES, *_NO_LSE_STRIDES)  # out's strides, no mask/lse
        self._mask_shape = (b, h, sq, sk)
        self._last_mask: tuple[tuple[object, ...], tuple[int, ...]] = ((), ())  # (shape, strides) -> the kernel's
        # the last call's strides of q, k, v, and the kernel's strides argument for them
        self._last: tuple[tuple[tuple[int, ...], ...], tuple[int, ...]] = ((), ())

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                 window: int | None, mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """out (B, H, Sq, Dv) for tensors of the signature and a bool ``mask`` broadcastable to
        (B, H, Sq, Sk) or None (validated by the caller, as :func:`run_kernel`'s ``checked``), or
        None where a last dimension is strided (the general path copies it first) or the kernels
        were loaded again since (:func:`.loader.loaded`'s cache cleared: another build may run now)."""
        if loader.library() is not self._lib:
            return None
        given = (q.stride(), k.stride(), v.stride())
        last = self._last
        if given != last[0]:  # other strides than the last call's: their kernel arguments
            qs, ks, vs = given
            if qs[3] != 1 or ks[3] != 1 or vs[3] != 1:
                return None
            # one tuple, set at once: a thread never reads another call's strides with its own
            last = self._last = (given, (qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], *self._tail))
        strides = last[1]
        if mask is not None:  # its strides in place of the tail's zeros (9 of q, k, v, 3 of out; 4 of the mask)
            strides = (*strides[:12], *self._mask_strides(mask), *_NO_LSE_STRIDES)
        out = torch.empty_strided(self._size, self._out_strides, dtype=self._dtype, device=_CPU)
        extra = () if self._decode else (*_NO_LOGITS, query_tile())
        code = self._fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), None,
                        None if mask is None else mask.data_ptr(), self._shape, strides,
                        scale, int(causal), window or 0, *extra, torch.get_num_threads())
        if code != 0:
            _refused(code)
        return out

    def _mask_strides(self, mask: torch.Tensor) -> tuple[int, ...]:
        """The kernel's strides of ``mask`` as broadcast to (B, H, Sq, Sk) (0 where broadcast), kept
        for the last mask's shape and strides (a layer's calls give the same ones)."""
        given = (mask.shape, mask.stride())
        last = self._last_mask
        if given != last[0]:
            last = self._last_mask = (given, _expanded(mask, self._mask_shape).stride())
        return last[1]


def _bias_pointer(bias: torch.Tensor | None, relative: torch.Tensor | None) -> tuple[int | None, tuple[int, ...]]:
    """The kernels' bias arguments (its address, 4 strides (b, h, i, j) in elements) for a checked bias
    (float32 (B, H, Sq, Sk), expanded) or a checked relative bias (float32 (B, H, Sq + Sk - 1),
    expanded, contiguous rows), not both: the relative one read along diagonals, from element
    Sq - 1 of its row on, one element back per query row."""
    if bias is not None:
        return bias.data_ptr(), tuple(bias.stride())
    if relative is None:
        return None, ()
    return relative.data_ptr(), tuple(relative.stride()[:2]) + (-1, 1)


def bias_arguments(biases: Logits, b: int, h: int, sq: int, sk: int
                   ) -> tuple[int | None, tuple[int, ...], tuple[torch.Tensor | None, ...]]:
    """The backward's bias arguments (address, strides) for the forward's ``bias`` and ``relative``
    (:class:`Logits`' fields; both: added into one dense bias), checked as the forward checks
    them; and the tensors behind the address, to keep alive through the call."""
    checked = _checked_biases(biases, b, h, sq, sk)
    address, strides = _bias_pointer(checked.bias, checked.relative)
    return address, strides, (checked.bias, checked.relative)


def _checked_biases(logits: Logits, b: int, h: int, sq: int, sk: int) -> Logits:
    """``logits`` with its bias and relative bias checked and laid out for the kernels (one of them:
    both are added into one dense bias); the relative one's address moved to its element Sq - 1."""
    bias = None if logits.bias is None else _checked_bias(logits.bias, b, h, sq, sk)
    relative = None if logits.relative is None else _checked_relative(logits.relative, b, h, sq, sk)
    if bias is not None and relative is not None:
        bias, relative = (bias + relative_dense(relative, sq, sk)).expand(b, h, sq, sk), None
    if relative is not None:
        relative = relative[:, :, sq - 1:]  # row i starts Sq - 1 - i elements before this one (stride -1)
    return logits._replace(bias=bias, relative=relative)


def _checked_relative(relative: object, b: int, h: int, sq: int, sk: int) -> torch.Tensor:
    """The relative bias, checked (a floating CPU tensor (B|1, H|1, Sq + Sk - 1)) before the kernel
    reads it along diagonals: float32, contiguous rows, expanded to (B, H, Sq + Sk - 1).

    Raises:
        TypeError, ValueError: naming ``rel_bias``, expected against got.
    """
    t = check_tensor("rel_bias", relative, ndim=3)
    if not t.dtype.is_floating_point or t.device.type != "cpu":
        raise TypeError(f"rel_bias must be a floating CPU tensor, got {t.dtype} on {t.device}")
    n = sq + sk - 1
    if t.shape[0] not in (1, b) or t.shape[1] not in (1, h) or t.shape[2] != n:
        raise ValueError(f"rel_bias must be [B|1, H|1, Sq + Sk - 1] = [{b}|1, {h}|1, {n}], got {list(t.shape)}")
    return t.detach().float().contiguous().expand(b, h, n)


def _checked_bias(bias: object, b: int, h: int, sq: int, sk: int) -> torch.Tensor:
    """The bias, checked (a floating CPU tensor broadcastable to (B, H, Sq, Sk)) before the kernel
    reads it, expanded to (B, H, Sq, Sk) (strides 0 where broadcast).

    Raises:
        TypeError, ValueError: naming ``bias``, expected against got.
    """
    t = check_tensor("bias", bias, ndim=(0, 1, 2, 3, 4))
    if not t.dtype.is_floating_point or t.device.type != "cpu":
        raise TypeError(f"bias must be a floating CPU tensor, got {t.dtype} on {t.device}")
    try:
        return t.detach().float()[(None,) * (4 - t.dim())].expand(b, h, sq, sk)
    except RuntimeError:
        raise ValueError(f"bias must broadcast to [B, H, Sq, Sk] = {[b, h, sq, sk]}, got {list(t.shape)}") from None


def _refused(code: int) -> None:
    if code == -1:
        raise MemoryError("the native attention kernel could not allocate its buffers")
    raise RuntimeError(f"the native attention kernel refused the problem (code {code})")


def rows_per_kv_head(q: torch.Tensor, k: torch.Tensor) -> int:
    """Sq·G: the query rows that share one K/V head (few: the decoding loop)."""
    return q.shape[2] * (q.shape[1] // k.shape[1])


#: At most this many query rows per K/V head (Sq·G) take the decoding loop.
DECODE_ROWS = 32
#: With the AVX-512 build, float32 calls with at most LANE_KEYS keys (csrc/decode.cpp's SMALL_KEYS)
#: and LANE_ROWS query rows per K/V head take the decoding loop too: its few-key path holds a block
#: of 16 rows in the vector lanes (the softmax vertical, K and V read once per block). Measured
#: (Intel Xeon, 1 thread, key padding, best of 3 × 5 timings; its time / the FlashAttention loop's):
#: H=12, D=32, B=32: S=48 0.63×, 96 0.93×, 128 0.93×; D=64, causal, B=8: S=64 0.75×, 128 0.82×;
#: GQA 32/8, D=128, causal: S=64 0.61×, 32 queries on 128 keys 0.89×; B=1, S=128 0.95×; 256
#: queries on 128 keys 0.94×. csrc/decode.cpp's lanes_take holds the FlashAttention loop's float32
#: calls to the same bounds (packed sequences of at most LANE_KEYS keys at any row count) and runs
#: them on that path. With the AVX2 build (8 lanes) both loops take it for short prefills only (at
#: least 8 queries per head and at most 64 keys, or packed: csrc/decode.cpp's small_item_fits,
#: with its measurements), not through this routing.
LANE_KEYS = 128
LANE_ROWS = 256


def decoding_loop_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a plain call (no logit feature, packing, bias or block mask) runs faster in the
    decoding loop than in the FlashAttention loop: few query rows per K/V head (:data:`DECODE_ROWS`),
    or, with the AVX-512 build, float32 with few keys (:data:`LANE_KEYS`, :data:`LANE_ROWS`)."""
    rows = rows_per_kv_head(q, k)
    return rows <= DECODE_ROWS or (rows <= LANE_ROWS and k.shape[2] <= LANE_KEYS and q.dtype == torch.float32
                                   and loader.vector_bits() == 512)

