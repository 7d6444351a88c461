"""Ring attention: each rank keeps its queries, K/V shards travel around the ring.

Notation: B batch, H query heads, Hkv key/value heads, G = H // Hkv, S tokens of the
full sequence, P ranks, r this rank, S_r tokens held by rank r, D head dim (Dv values).

Step i (i = 0 .. P-1) rank r holds the K/V shard of rank ``(r - i) mod P`` and already
sends it on to r+1 (``batch_isend_irecv``) while it computes its queries against it::

    step 0     step 1     step 2          (P = 3; [x] = K/V shard of rank x)
    r0: [0]    r0: [2]    r0: [1]
    r1: [1]    r1: [0]    r1: [2]
    r2: [2]    r2: [1]    r2: [0]

Each block gives (out, lse) from :func:`multihead.attention` (``return_lse=True``); the
blocks merge by log-sum-exp in float32 or wider. Masks use global positions (causal,
window, key padding), planned per pair of *runs* (:mod:`.layout`): a pair no query of
which may see any key is skipped, a fully visible one runs unmasked, the diagonal one
runs with the kernel's own causal flag. With the zigzag layout every rank computes the
same number of score elements for causal attention (:func:`ring_work`).

Backward (a custom ``autograd.Function``): K/V go around the ring again, every block's
probabilities are recomputed from the saved lse (FlashAttention's backward), and the
dK/dV accumulators travel with their K/V shard, one step behind, until they reach the
shard's owner. GQA never repeats K/V: G query heads read each travelling K/V head.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._checks import check_float, check_int
from ..functional import attention
from ..masks import Structure, key_padding_mask
from ._comm import agree, resolve_group, ring_shift, world_and_rank
from ._lse import block_attention, merge_into, work_dtype
from .layout import LAYOUTS, Run, _dtype_code, _rows, check_sizes, shard_runs

__all__ = ["ring_attention", "ring_work", "RingWork"]

_SKIP, _FULL, _DIAG, _MASK = "skip", "full", "diag", "mask"
#: Score elements per chunk of the backward's explicit recomputation (memory bound).
_BACKWARD_CHUNK = 1 << 22


@dataclass(frozen=True)
class _Spec:
    group: dist.ProcessGroup | None  # None: a plan only (ring_plan), which never communicates
    world: int
    rank: int
    sizes: tuple[int, ...]
    layout: str
    causal: bool
    window: int | None
    scale: float

    @property
    def comm(self) -> dist.ProcessGroup:
        """The group of a spec that communicates."""
        assert self.group is not None  # only ring_plan's specs have none, and they never send
        return self.group

    @property
    def seq_len(self) -> int:
        return sum(self.sizes)

    def runs(self, rank: int) -> list[Run]:
        return shard_runs(self.seq_len, self.world, rank, self.layout)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: object = None,
                   causal: bool = False, window: int | None = None, key_mask: torch.Tensor | None = None,
                   scale: float | None = None, layout: str = "zigzag") -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of ``group``, by a ring of K/V.

    Equal to :func:`multihead.attention` on the full sequence, each rank getting its shard
    of the output. Differentiable (q, k and v).

    Args:
        q: (B, H, S_r, D) this rank's queries, in ``layout`` order (:func:`shard_sequence`
            along dim 2); RoPE, if any, already applied at global positions
            (:func:`shard_positions`).
        k, v: (B, Hkv, S_r, D), (B, Hkv, S_r, Dv) this rank's keys and values (same tokens).
        group: ProcessGroup, 1-D DeviceMesh or None (the default group).
        causal: mask future keys (by global position).
        window: sliding window (Mistral's convention; both sides when not causal).
        key_mask: (B, S_r) bool, True = real token, this rank's shard of the key padding.
        scale: logit scale; default 1/√D.
        layout: "contiguous", "zigzag" (default: balanced for causal) or "striped".

    Returns:
        (B, H, S_r, Dv), this rank's shard of the output. A query with no visible key
        gets zeros (never NaN), in the forward and the backward.

    Raises:
        ValueError: on every rank with the same message, before any K/V moves: a rank's
            bad inputs, shapes or options that differ across ranks, shard lengths that are
            not ``layout``'s (S < P included).
        TypeError: non-tensors or wrong dtypes (through the same refusal on every rank).
    """
    g = resolve_group(group)
    p, r = world_and_rank(g)
    error, meta = _check_local(q, k, v, key_mask, causal, window, scale, layout)
    if p == 1:  # nothing to shard: exactly multihead.attention
        if error is not None:
            raise ValueError(error)
        mask = None if key_mask is None else key_padding_mask(key_mask)
        return attention(q, k, v, causal=causal, window=window, mask=mask, scale=scale)
    table = agree(g, meta, error, lambda t: _check_table(t, layout))
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    spec = _Spec(g, p, r, tuple(row[-1] for row in table), layout, bool(causal), window, sc)
    km = None if key_mask is None else key_mask.to(torch.uint8)  # gloo sends no bool
    return _RingAttention.apply(q, k, v, km, spec)


# -- validation ------------------------------------------------------------------------
def _check_local(q: object, k: object, v: object, key_mask: object, causal: object, window: object,
                 scale: object, layout: object) -> tuple[str | None, list[int]]:
    """This rank's refusal of its own inputs (a message, not raised: see :func:`agree`) and metadata."""
    try:
        qt, kt, vt, has_mask, win, sc = _validate(q, k, v, key_mask, window, scale, layout)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}", [0] * 12
    b, h, s, d = qt.shape
    scale_bits = 0 if sc is None else struct.unpack("<q", struct.pack("<d", sc))[0]
    return None, [b, h, d, kt.shape[1], vt.shape[-1], _dtype_code(qt.dtype), int(bool(causal)),
                  0 if win is None else win, int(has_mask), LAYOUTS.index(layout), scale_bits, s]


def _validate(q: object, k: object, v: object, key_mask: object, window: object, scale: object,
              layout: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, int | None, float | None]:
    """Raise on bad inputs; return q, k, v, whether a key mask is given, window and scale, checked."""
    from .._checks import check_float_tensor, check_like, check_tensor
    from .layout import check_layout

    check_layout(layout)
    q = check_tensor("q", q, ndim=4)
    k = check_tensor("k", k, ndim=4)
    v = check_tensor("v", v, ndim=4)
    check_float_tensor("q", q)
    check_like("k", k, "q", q)
    check_like("v", v, "q", q)
    b, h, s, d = q.shape
    if tuple(k.shape[:3]) != (b, k.shape[1], s) or k.shape[0] != b or k.shape[-1] != d:
        raise ValueError(f"k must have shape [B, Hkv, S_r, D] = [{b}, Hkv, {s}, {d}] (the same tokens as q), "
                         f"got {list(k.shape)}")
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"v must have shape [B, Hkv, S_r, Dv] = {list(k.shape[:3])} + [Dv] like k, "
                         f"got {list(v.shape)}")
    if h % k.shape[1]:
        raise ValueError(f"the number of query heads ({h}) must be a multiple of the number of K/V heads "
                         f"({k.shape[1]})")
    if key_mask is not None:
        key_mask = check_tensor("key_mask", key_mask, ndim=2)
        if key_mask.dtype != torch.bool:
            raise TypeError(f"key_mask must be a bool tensor (True = real token), got dtype {key_mask.dtype}")
        if tuple(key_mask.shape) != (b, s):
            raise ValueError(f"key_mask must have shape [B, S_r] = [{b}, {s}], got {list(key_mask.shape)}")
    win = None if window is None else check_int("window", window)
    sc = None if scale is None else check_float("scale", scale, low=0.0, high=math.inf, low_inclusive=False,
                                                high_inclusive=False)
    return q, k, v, key_mask is not None, win, sc


def _check_table(table: list[list[int]], layout: str) -> str | None:
    """A refusal every rank computes alike from every rank's metadata, or None."""
    if any(row[:-1] != table[0][:-1] for row in table):
        return ("the ranks disagree on (B, H, D, Hkv, Dv, dtype, causal, window, key_mask, layout, scale): "
                + _rows([row[:-1] for row in table]))
    return check_sizes([row[-1] for row in table], layout)


# -- the plan: which blocks run, and how -----------------------------------------------
def _classify(a: Run, b: Run, causal: bool, window: int | None) -> str:
    """How queries of run ``a`` see keys of run ``b``: skip, full, diag (kernel flags) or mask.

    From the structural rule (:class:`multihead.masks.Structure`): spans only move right as
    the query moves right, so run ``a``'s first and last queries bound what all of them see.
    """
    structure = Structure(causal, window)
    if structure.trivial:
        return _FULL
    far = 1 << 62  # spans unclipped on the right
    first, last = structure.span(a.start, far), structure.span(a.last, far)
    if last[1] <= b.start or first[0] > b.last:
        return _SKIP  # no query sees any key of the run
    if last[0] <= b.start and first[1] > b.last:
        return _FULL  # every query sees every key of the run
    if (a.start, a.count, a.stride) == (b.start, b.count, b.stride) and a.stride == 1:
        return _DIAG  # same positions: the kernel's bottom-right causal/window flags are exact
    return _MASK


def _pattern(a: Run, b: Run, causal: bool, window: int | None, device: torch.device) -> torch.Tensor:
    """(Sq_a, Sk_b) bool: which keys of run b the queries of run a may see, by global position."""
    return Structure(causal, window).allows(a.positions(device)[:, None], b.positions(device)[None, :])


def _block_mask(kind: str, a: Run, b: Run, spec: _Spec, km: torch.Tensor | None, device: torch.device,
                *, explicit: bool) -> torch.Tensor | None:
    """Bool mask (B or 1, 1, Sq_a, Sk_b) of a block, or None; with ``explicit`` the diag
    pattern is built too (the backward has no kernel flags)."""
    mask = None
    if kind == _MASK or (kind == _DIAG and explicit):
        mask = _pattern(a, b, spec.causal, spec.window, device)[None, None]
    if km is not None:
        keys = km[:, b.offset:b.offset + b.count].bool()[:, None, None, :]  # (B, 1, 1, Sk_b)
        mask = keys if mask is None else mask & keys
    return mask


@dataclass(frozen=True)
class RingWork:
    """One rank's causal/windowed work in a ring call.

    Attributes:
        blocks: attention calls (run pairs not skipped).
        computed: score elements of those calls (Sq·Sk each).
        visible: (query, key) pairs actually allowed to attend.
    """

    blocks: int
    computed: int
    visible: int


def ring_work(seq_len: int, world_size: int, *, layout: str = "zigzag", causal: bool = True,
              window: int | None = None) -> list[RingWork]:
    """Per rank, the work :func:`ring_attention` plans (the same plan it runs).

    Zigzag makes ``max/min`` of ``computed`` (and ``visible``) 1 for causal attention when
    S divides by 2P; contiguous gives about 2.9 at P = 2 (rank P-1 sees every shard).
    """
    check_int("seq_len", seq_len)
    check_int("world_size", world_size)
    spec = _Spec(None, world_size, 0, tuple(_sizes(seq_len, world_size, layout)), layout, causal, window, 1.0)
    result = []
    for r in range(world_size):
        blocks = computed = visible = 0
        for src in range(world_size):
            for a in spec.runs(r):
                for b in spec.runs(src):
                    kind = _classify(a, b, causal, window)
                    if kind == _SKIP:
                        continue
                    blocks += 1
                    computed += a.count * b.count
                    visible += int(_pattern(a, b, causal, window, torch.device("cpu")).sum())
        result.append(RingWork(blocks, computed, visible))
    return result


def _sizes(seq_len: int, world_size: int, layout: str) -> list[int]:
    from .layout import shard_sizes

    return shard_sizes(seq_len, world_size, layout)


# -- forward and backward --------------------------------------------------------------
def _kv_shapes(spec: _Spec, src: int, k: torch.Tensor, v: torch.Tensor, km: torch.Tensor | None
               ) -> list[tuple[int, ...]]:
    """Shapes of rank ``src``'s K, V (and key mask) shards."""
    n = spec.sizes[src]
    shapes: list[tuple[int, ...]] = [(k.shape[0], k.shape[1], n, k.shape[3]), (v.shape[0], v.shape[1], n, v.shape[3])]
    if km is not None:
        shapes.append((km.shape[0], n))
    return shapes


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                km: torch.Tensor | None, spec: _Spec) -> torch.Tensor:
        b, h, s, _ = q.shape
        work = work_dtype(q.dtype)
        out = torch.zeros(b, h, s, v.shape[-1], dtype=work, device=q.device)
        lse = torch.full((b, h, s), float("-inf"), dtype=work, device=q.device)
        current = [k, v] + ([] if km is None else [km])
        mine = spec.runs(spec.rank)
        for step in range(spec.world):
            src = (spec.rank - step) % spec.world
            nxt = (src - 1) % spec.world
            # bound before the shift allocates the next shard: the previous one has no name left,
            # so at most two foreign shards live at once, however the ranks are scheduled
            kk, vv = current[0], current[1]
            kmask = current[2] if km is not None else None
            wait = (ring_shift(current, _kv_shapes(spec, nxt, k, v, km), spec.comm, tag=16 * step)
                    if step < spec.world - 1 else None)
            for a in mine:
                for rb in spec.runs(src):
                    kind = _classify(a, rb, spec.causal, spec.window)
                    if kind == _SKIP:
                        continue
                    mask = _block_mask(kind, a, rb, spec, kmask, q.device, explicit=False)
                    flags = kind == _DIAG
                    o_blk, l_blk = block_attention(
                        q[:, :, a.offset:a.offset + a.count], kk[:, :, rb.offset:rb.offset + rb.count],
                        vv[:, :, rb.offset:rb.offset + rb.count], causal=flags and spec.causal,
                        window=spec.window if flags else None, mask=mask, scale=spec.scale)
                    merge_into(out[:, :, a.offset:a.offset + a.count], lse[:, :, a.offset:a.offset + a.count],
                               o_blk, l_blk)
                    del o_blk, l_blk  # freed before the next block's output is allocated
            if wait is not None:
                current = wait()
        result = out.to(q.dtype)
        # delta = rowsum(dO ∘ O) in the backward uses the unrounded O (bf16 rounding there would
        # cost accuracy in dQ/dK); for float32/64 this is the same tensor as the result.
        ctx.save_for_backward(q, k, v, out, lse, *([] if km is None else [km]))
        ctx.spec, ctx.has_km = spec, km is not None
        return result

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        spec: _Spec = ctx.spec
        q, k, v, out, lse, *rest = ctx.saved_tensors
        km = rest[0] if ctx.has_km else None
        work = work_dtype(q.dtype)
        dout_w = dout.to(work)
        delta = (dout_w * out.to(work)).sum(-1)  # (B, H, S_r): rowsum(dO ∘ O)
        dq = torch.zeros(q.shape, dtype=work, device=q.device)
        current = [k, v] + ([] if km is None else [km])
        mine = spec.runs(spec.rank)
        pending = None  # the dK/dV accumulators of the shard held now, arriving from r-1
        for step in range(spec.world):
            src = (spec.rank - step) % spec.world
            nxt = (src - 1) % spec.world
            last = step == spec.world - 1
            kk, vv = current[0], current[1]  # bound before the shift allocates: as in the forward
            kmask = current[2] if km is not None else None
            wait = None if last else ring_shift(current, _kv_shapes(spec, nxt, k, v, km), spec.comm,
                                                tag=16 * step)
            dk = torch.zeros(kk.shape, dtype=work, device=q.device)
            dv = torch.zeros(vv.shape, dtype=work, device=q.device)
            for a in mine:
                qa = slice(a.offset, a.offset + a.count)
                for rb in spec.runs(src):
                    kind = _classify(a, rb, spec.causal, spec.window)
                    if kind == _SKIP:
                        continue
                    kb = slice(rb.offset, rb.offset + rb.count)
                    mask = _block_mask(kind, a, rb, spec, kmask, q.device, explicit=True)
                    _block_grads(q[:, :, qa], kk[:, :, kb], vv[:, :, kb], dout_w[:, :, qa], lse[:, :, qa],
                                 delta[:, :, qa], mask, spec.scale, dq[:, :, qa], dk[:, :, kb], dv[:, :, kb])
            if pending is not None:
                got_k, got_v = pending()
                dk += got_k
                dv += got_v
                del got_k, got_v  # not held through the next step
            if last:  # the accumulators of shard r+1 go home; ours arrive from r-1
                dk, dv = ring_shift([dk, dv], [k.shape, v.shape], spec.comm, tag=16 * step + 8)()
            else:
                assert wait is not None  # started above: not the last step
                pending = ring_shift([dk, dv], _kv_shapes(spec, nxt, k, v, None), spec.comm, tag=16 * step + 8)
                current = wait()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _block_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                 delta: torch.Tensor, mask: torch.Tensor | None, scale: float,
                 dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add one block's gradients into dq (B, H, Sq, D), dk (B, Hkv, Sk, D), dv (B, Hkv, Sk, Dv).

    P = exp(scale·QKᵀ - lse) recomputed from the final lse (rows with lse = -inf see no
    key: P = 0); dV += Pᵀ dO; dS = P ∘ (dO Vᵀ - delta); dQ += scale · dS K;
    dK += scale · dSᵀ Q. Queries go in chunks so the scores stay small.
    """
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = h // hkv
    work = dq.dtype
    kw, vw = k.to(work), v.to(work)
    chunk = max(1, min(sq, _BACKWARD_CHUNK // max(1, h * sk), max(1, (sq * d) // max(1, sk)) * 4))
    for lo in range(0, sq, chunk):
        hi = min(sq, lo + chunk)
        n = hi - lo
        qc = q[:, :, lo:hi].to(work).reshape(b, hkv, g, n, d)  # (B, Hkv, G, c, D)
        doc = dout[:, :, lo:hi].reshape(b, hkv, g, n, -1)  # (B, Hkv, G, c, Dv)
        row_lse = lse[:, :, lo:hi]
        row_lse = torch.where(torch.isneginf(row_lse), math.inf, row_lse).reshape(b, hkv, g, n, 1)
        s = torch.einsum("bkgqd,bksd->bkgqs", qc, kw) * scale  # (B, Hkv, G, c, Sk)
        p = torch.exp(s - row_lse)
        if mask is not None:
            m = mask[..., lo:hi, :] if mask.shape[-2] > 1 else mask
            m = m.expand(b, h, n, sk).reshape(b, hkv, g, n, sk)
            p = p.masked_fill(~m, 0.0)
        dv += torch.einsum("bkgqs,bkgqd->bksd", p, doc)
        dp = torch.einsum("bkgqd,bksd->bkgqs", doc, vw)
        ds = p * (dp - delta[:, :, lo:hi].reshape(b, hkv, g, n, 1))
        dq[:, :, lo:hi] += (torch.einsum("bkgqs,bksd->bkgqd", ds, kw) * scale).reshape(b, h, n, d)
        dk += torch.einsum("bkgqs,bkgqd->bksd", ds, qc) * scale
