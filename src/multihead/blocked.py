"""The torch-only attention kernels: ``blocked_attention`` (backend ``"blocked"``) and
``decode_attention``, the fast paths where the native kernel cannot be built.

Notation: B batch, H query heads, Hkv key/value heads, G = H // Hkv query heads per
K/V head, Sq queries, Sk keys, D head dim (Dv for values), P query positions in one
block, R = P·G rows of one block, W keys of one block.

Why another kernel: torch's fused CPU SDPA does its GEMMs with MKL's sgemm, which on
this project's AMD (Zen) machines runs AVX2 code at about half of what oneDNN's AVX-512
GEMM reaches in the same process; and with a causal mask it works in key blocks of 512,
so at S ≤ 1024 it computes (and then masks) almost the whole square.

``"blocked"`` (inference; never an S×S matrix)::

    for each batch row b, K/V head g, block of query positions [p0, p1):
        rows = the G query heads of group g at positions p0..p1-1     (R, D), one matrix
        keys = the range [k0, k1) that some row of the block may see (causal: ≤ p1)
        s = (rows · scale) · keysᵀ      one GEMM (oneDNN for float32)   (R, W)
        -inf only in the columns where masking can occur (the diagonal band)
        p = softmax(s)                  fused, in place, in cache
        out[rows] = p · values          one GEMM                        (R, Dv)

Causal, Sq = Sk = 8, blocks of P = 2 positions: ``■`` is computed unmasked, ``▲`` is the
masked diagonal square (its upper half set to -inf), blank cells are never computed::

    ▲ ▲
    ▲ ▲
    ■ ■ ▲ ▲
    ■ ■ ▲ ▲
    ■ ■ ■ ■ ▲ ▲
    ...

Long key ranges (W > ``_KEY_CHUNK``) are split into chunks whose partial outputs are
merged by their log-sum-exp, as FlashAttention does, so a block stays in cache. GQA
stacks the G heads of a group into one matrix: K/V are never repeated. A query with no
allowed key gets zeros. The output is returned as a (B, H, Sq, Dv) view of a
(B, Sq, H, Dv) buffer, like SDPA's, so that merging heads afterwards costs no copy.

:func:`decode_attention` (few query rows per K/V head: decoding) is two batched
matmuls over all K/V heads, the G query heads of a group stacked (no K/V repeat).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .backends import _accumulation_dtype, full_mask, safe_softmax

__all__ = ["blocked_attention", "decode_attention", "onednn_available", "gemm_for", "mm_nt"]

#: Rows (R = P·G) of one block: a power of two within these bounds. Measured on a
#: 2-core Zen 5: each oneDNN call costs ~10 µs besides its FLOPs, so big blocks win even
#: past the L2 size; with a causal mask a block also computes (and masks) about R²/2
#: entries above the diagonal, so R ≈ Sq/8 balances the two.
_MIN_ROWS, _MAX_ROWS = 16, 512
#: Key ranges are rounded to multiples of this (K/V zero-padded, padding masked) and
#: split into chunks of at most ``_KEY_CHUNK`` keys merged by log-sum-exp. Every GEMM
#: then has one of a few shapes: oneDNN JIT-compiles (about 1 ms) and caches (about
#: 0.5 MiB, up to 1024 entries) one kernel per shape, so unbounded shapes would cost
#: both time and memory in a long-running process.
_KEY_ALIGN = 128
_KEY_CHUNK = 4096

_NEG_INF = float("-inf")
MatMul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def _onednn_linear() -> Callable[..., torch.Tensor] | None:
    """oneDNN's fp32 GEMM as exposed by torch (the op Inductor uses), or None."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):  # a torch built without it
        return None


def onednn_available() -> bool:
    """Whether float32 blocks run on oneDNN (else on ``torch.matmul``)."""
    return _onednn_linear() is not None and torch.backends.mkldnn.enabled


def _matmul_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, w.transpose(0, 1))


def gemm_for(x: torch.Tensor) -> MatMul:
    """The GEMM ``(x, w) -> x · wᵀ`` to use for tensors like ``x``, chosen once per call.

    oneDNN for float32 CPU tensors when available (and not disabled through
    ``torch.backends.mkldnn``), else ``torch.matmul``. oneDNN needs ``w`` with contiguous
    rows or a plain transpose of such a matrix: a row-strided ``w`` is copied slowly
    inside it, so callers pass contiguous K/V rows.
    """
    op = _onednn_linear()
    if op is not None and x.dtype == torch.float32 and x.device.type == "cpu" and torch.backends.mkldnn.enabled:
        empty: list[float] = []
        return lambda a, w: op(a, w, None, "none", empty, "")
    return _matmul_nt


def mm_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x · wᵀ``: x (M, K), w (N, K) -> (M, N), with :func:`gemm_for` ``x``'s GEMM."""
    return gemm_for(x)(x, w)


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each (S, D) slice of t (B, Hkv, S, D) has contiguous rows.

    oneDNN reads ``w`` fast only so (a row-strided view is copied slowly inside it).
    """
    return t.stride(-1) == 1 and (t.stride(-2) == t.shape[-1] or t.shape[-2] == 1)


def _block_rows(rows: int, keys: int, causal: bool) -> int:
    """R for a block: ``rows`` = Sq·G query rows per group, ``keys`` = Sk (padded)."""
    want = max(256, min(512, rows // 8)) if causal else (512 if keys >= 1024 else 256)
    want = min(want, 1 << (rows - 1).bit_length())  # never much more than there is
    return min(_MAX_ROWS, max(_MIN_ROWS, 1 << (want.bit_length() - 1)))


def _as_4d(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask[(None,) * (4 - mask.dim())]  # (B|1, H|1, Sq|1, Sk|1)


def _upcast(t: torch.Tensor) -> torch.Tensor:
    # Half-precision inputs are computed in float32 (softmax in float32 at least).
    return t.to(_accumulation_dtype(t.dtype))


def blocked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    mm: MatMul | None = None,
) -> torch.Tensor:
    """Query-blocked attention without autograd (see the module docstring).

    Args:
        q: (B, H, Sq, D); k: (B, Hkv, Sk, D); v: (B, Hkv, Sk, Dv).
        scale: logit scale. causal, window: bottom-right aligned, as in
            :func:`multihead.attention`. mask: bool broadcastable to (B, H, Sq, Sk),
            True = may attend.
        mm: the GEMM ``x · wᵀ`` for both products; default :func:`gemm_for` the dtype.

    Returns:
        (B, H, Sq, Dv), a view of a (B, Sq, H, Dv) buffer; zeros for rows with no key.
    """
    b, h, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    off = sk - sq  # query i sits at key position i + off
    dtype = q.dtype
    q, k, v = _upcast(q), _upcast(k), _upcast(v)
    mm = mm or gemm_for(q)
    mask = _as_4d(mask)
    align = _KEY_ALIGN
    chunk = max(align, _KEY_CHUNK // align * align)
    skp = -(-sk // align) * align  # Sk rounded up
    step = max(1, _block_rows(sq * g, min(skp, chunk), causal) // g)  # P positions per block, R = P·G rows
    sqp = -(-sq // step) * step  # Sq rounded up: every block has R rows (padding discarded)
    # One group's scaled queries, position-major: (Sqp, G, D), so that the G heads of a
    # block of positions form one contiguous (R, D) matrix. Staged per group (not for
    # all of q at once) because fresh memory costs a page fault per 4 KiB on first touch.
    qg = q.new_zeros((sqp, g, d))
    k_direct = skp == sk and _rows_contiguous(k)
    v_direct = skp == sk and _rows_contiguous(v)
    kg = None if k_direct else k.new_zeros((skp, d))  # (Skp, D): contiguous rows, zero padding
    vg = None if v_direct else v.new_zeros((skp, dv))
    out = torch.empty((b, sqp, h, dv), dtype=q.dtype, device=q.device)  # (B, Sqp, H, Dv)
    out_g = out.view(b, sqp, hkv, g, dv)  # (B, Sqp, Hkv, G, Dv)
    may_die = mask is not None or off < 0 or (window is not None and not causal)
    bands: dict[tuple[int, int, int], torch.Tensor] = {}  # band masks reused across blocks

    def band(p0: int, p1: int, c0: int, c1: int) -> torch.Tensor:
        """(P, c1 - c0) additive: -inf where causal/window structure blocks, else 0.

        Added rather than masked_fill'ed: an add runs about 3× faster here.
        """
        key = (p1 - p0, c0 - p0, c1 - c0)  # the band depends only on relative offsets
        if key not in bands:
            rel = (torch.arange(c0, c1, device=q.device)[None, :]
                   - torch.arange(p0 + off, p1 + off, device=q.device)[:, None])  # (P, c1-c0): j - position
            blocked = rel > 0 if causal else torch.zeros_like(rel, dtype=torch.bool)
            if window is not None:
                blocked |= rel <= -window
                if not causal:
                    blocked |= rel >= window
            bands[key] = torch.zeros(blocked.shape, dtype=q.dtype, device=q.device).masked_fill_(blocked, _NEG_INF)
        return bands[key]

    plain = not causal and window is None and mask is None and skp == sk  # nothing to mask anywhere
    for bi in range(b):
        for gi in range(hkv):
            # Stage the group; 2-D views hoisted, since every op in the block loop counts.
            torch.mul(q[bi, gi * g:(gi + 1) * g].transpose(0, 1), scale, out=qg[:sq])  # (Sq, G, D)
            q2 = qg.view(sqp * g, d)  # (Sqp·G, D)
            k2 = k[bi, gi] if k_direct else kg
            if not k_direct:
                kg[:sk] = k[bi, gi]  # (Skp, D)
            vt2 = (v[bi, gi] if v_direct else vg).transpose(0, 1)  # (Dv, Skp)
            if not v_direct:
                vg[:sk] = v[bi, gi]
            dst2 = out_g[bi, :, gi]  # (Sqp, G, Dv)
            for p0 in range(0, sqp, step):
                p1 = p0 + step
                lo, hi = 0, sk  # keys some row of the block may see
                if causal:
                    hi = min(hi, p1 + off)
                if window is not None:
                    lo = max(lo, p0 + off - window + 1)
                    if not causal:
                        hi = min(hi, p1 - 1 + off + window)
                if hi <= lo:
                    dst2[p0:p1].zero_()
                    continue
                lo, hi = lo // align * align, min(skp, -(-hi // align) * align)  # aligned: few shapes
                x = q2[p0 * g:p1 * g]  # (R, D)
                acc, acc_lse = None, None
                for c0 in range(lo, hi, chunk):
                    c1 = min(c0 + chunk, hi)
                    chunked = c0 > lo or c1 < hi
                    s = mm(x, k2[c0:c1])  # (R, W)
                    masked = not plain and _mask_scores(s.view(step, g, c1 - c0), band, mask, bi, gi, g,
                                                        p0, p1, c0, c1, sq, sk, causal, window)
                    # A row may see no key of one chunk (causal band) though it sees others.
                    check_dead = masked and (may_die or chunked)
                    smax = s.amax(-1) if chunked or check_dead else None  # (R,)
                    dead = smax == _NEG_INF if check_dead else None  # rows with no allowed key
                    torch._softmax(s, -1, False, out=s)  # in place
                    o = mm(s, vt2[:, c0:c1])  # (R, Dv)
                    if dead is not None:
                        o.masked_fill_(dead[:, None], 0.0)  # softmax gave NaN there
                    if not chunked:
                        acc = o
                        break
                    # lse = max + log(sum), and the softmax's largest entry is exp(0)/sum.
                    lse = smax - torch.log(s.amax(-1))
                    if dead is not None:
                        lse.masked_fill_(dead, _NEG_INF)
                    acc, acc_lse = _merge(acc, acc_lse, o, lse)
                dst2[p0:p1] = acc.view(step, g, dv)
    result = out[:, :sq].permute(0, 2, 1, 3)  # (B, H, Sq, Dv)
    return result if result.dtype == dtype else result.to(dtype)


def _mask_scores(s3: torch.Tensor, band: Callable[[int, int, int, int], torch.Tensor], mask: torch.Tensor | None,
                 bi: int, gi: int, g: int, p0: int, p1: int, c0: int, c1: int, sq: int, sk: int,
                 causal: bool, window: int | None) -> bool:
    """Set -inf where a block's scores (P, G, W) are masked; return whether any may be.

    Structural masking (causal, window) can only touch two column bands of a block: on
    the right the keys after the block's first query, on the left the keys before its
    last query's window; the rest of the block runs unmasked.
    """
    masked = False
    off = sk - sq
    regions = []
    if causal or window is not None:
        first = p0 + off + (1 if causal else window)  # right band: columns ≥ first
        if first < c1:
            regions.append((max(c0, first), c1))
        if window is not None:
            last = min(c1, p1 + off - window)  # left band: columns < last
            if last > c0:
                regions.append((c0, last))
    for a0, a1 in regions:
        s3[:, :, a0 - c0:a1 - c0].add_(band(p0, p1, a0, a1)[:, None, :])
        masked = True
    if c1 > sk:  # zero padding of K/V
        s3[:, :, max(0, sk - c0):].fill_(_NEG_INF)
        masked = True
    if mask is not None:
        r1, w1 = min(p1, sq), min(c1, sk)  # the caller's mask covers no padding
        m = _mask_block(mask, bi, gi, g, p0, r1, c0, w1)
        s3[:r1 - p0, :, :w1 - c0].masked_fill_(~m, _NEG_INF)
        masked = True
    return masked


def _mask_block(mask: torch.Tensor, bi: int, gi: int, g: int, p0: int, p1: int, c0: int, c1: int) -> torch.Tensor:
    """The caller's mask for one block, shaped to broadcast over (P, G, W)."""
    m = mask[bi if mask.shape[0] > 1 else 0]  # (H|1, Sq|1, Sk|1)
    m = m[:, p0:p1] if m.shape[1] > 1 else m
    m = m[:, :, c0:c1] if m.shape[2] > 1 else m
    if m.shape[0] > 1:
        return m[gi * g:(gi + 1) * g].transpose(0, 1)  # (P|1, G, W|1)
    return m[0][:, None, :]  # (P|1, 1, W|1)


def _merge(acc: torch.Tensor | None, acc_lse: torch.Tensor | None,
           o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two normalised partial outputs by their log-sum-exp (rows with none: -inf)."""
    if acc is None:
        return o, lse
    top = torch.maximum(acc_lse, lse)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # both -inf: weights 0
    wa, wb = torch.exp(acc_lse - top), torch.exp(lse - top)
    total = wa + wb
    new_lse = top + torch.log(total)
    total = torch.where(total == 0, torch.ones_like(total), total)
    return (acc * (wa / total)[:, None] + o * (wb / total)[:, None]), new_lse


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    window: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for few queries (decoding): two batched matmuls over all K/V heads.

    The G query heads of a group share one matmul against their K/V head (no repeat),
    so K and V are each read once. Scores are (B, Hkv, Sq·G, Sk): small when Sq is.

    Args and returns: as :func:`blocked_attention` (output (B, H, Sq, Dv)).
    """
    b, h, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    dtype = q.dtype
    q, k, v = _upcast(q), _upcast(k), _upcast(v)
    qs = (q.view(b, hkv, g, sq, d).transpose(2, 3) * scale).reshape(b, hkv, sq * g, d)  # (B, Hkv, Sq·G, D)
    s = torch.matmul(qs, k.transpose(-1, -2))  # (B, Hkv, Sq·G, Sk)
    # With one query per row and a causal mask every cached key is visible: no mask.
    structural = window is not None or (causal and sq > 1)
    if mask is None and not structural:
        torch._softmax(s, -1, False, out=s)
    else:
        allowed = _decode_mask(mask, b, h, hkv, g, sq, sk, causal, window, q.device)
        s = safe_softmax(s.view(b, hkv, sq, g, sk).masked_fill(~allowed, _NEG_INF)).view(b, hkv, sq * g, sk)
    o = torch.matmul(s, v)  # (B, Hkv, Sq·G, Dv)
    out = o.view(b, hkv, sq, g, dv).permute(0, 1, 3, 2, 4).reshape(b, h, sq, dv)  # (B, H, Sq, Dv)
    return out if out.dtype == dtype else out.to(dtype)


def _decode_mask(mask: torch.Tensor | None, b: int, h: int, hkv: int, g: int, sq: int, sk: int,
                 causal: bool, window: int | None, device: torch.device) -> torch.Tensor:
    """Combined mask broadcastable to (B, Hkv, Sq, G, Sk)."""
    m = _as_4d(full_mask(mask, causal, window, sq, sk, device))  # (B|1, H|1, Sq|1, Sk|1)
    m = m.expand(m.shape[0], m.shape[1], sq, m.shape[3])
    if m.shape[1] == h:
        return m.reshape(m.shape[0], hkv, g, sq, m.shape[3]).transpose(2, 3)  # (B|1, Hkv, Sq, G, Sk|1)
    return m[:, :, :, None, :]  # (B|1, 1, Sq, 1, Sk|1)
