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
        s = rows · keysᵀ · scale        one GEMM (oneDNN for float32)   (R, W)
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

import math
from dataclasses import dataclass, field

import torch

from ..logits import NO_FEATURES, Features
from ..masks import Structure, full_mask
from .eager import accumulation_dtype, lse_dtype, safe_softmax
from .gemm import MatMul, matmul_nt, gemm_for
from .registry import register_backend

__all__ = ["blocked_attention", "decode_attention"]

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
#: Fewer keys than this are computed at their own width (no padding) by ``torch.matmul``.
#: MKL sums products this narrow in a more accurate order than its wide kernel's single
#: running sum (measured, D=64, scores of spread 15: mean error 7.3e-6 at 2 keys against
#: 1.2e-5 from 16 keys on, and oneDNN 1.2e-5 at every width); padded to 128 keys, a call
#: with 2 keys had twice the naive computation's error.
_NARROW_KEYS = 16

_NEG_INF = float("-inf")


def _split_scale(scale: float) -> tuple[float, float]:
    """(pre, post): multiply the queries by ``pre`` before q·kᵀ and the scores by ``post``.

    A power of two (D = 16, 64, 256) scales exactly, so the queries take it (the cheaper
    place: Sq·D products instead of Sq·Sk); any other scale would round every query once
    more and is applied to the scores, as in the naive computation.
    """
    exact = scale > 0 and math.frexp(scale)[0] == 0.5
    return (scale, 1.0) if exact else (1.0, scale)


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


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    return mask[(None,) * (4 - mask.dim())]  # (B|1, H|1, Sq|1, Sk|1)


def _upcast(t: torch.Tensor) -> torch.Tensor:
    # Half-precision inputs are computed in float32 (softmax in float32 at least).
    return t.to(accumulation_dtype(t.dtype))


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
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Query-blocked attention without autograd (see the module docstring).

    Args:
        q: (B, H, Sq, D); k: (B, Hkv, Sk, D); v: (B, Hkv, Sk, Dv).
        scale: logit scale. causal, window: bottom-right aligned, as in
            :func:`multihead.attention`. mask: bool broadcastable to (B, H, Sq, Sk),
            True = may attend.
        mm: the GEMM ``x · wᵀ`` for both products; default :func:`gemm_for` the dtype.
        return_lse: also return the per-row log-sum-exp of the scaled, masked scores.

    Returns:
        (B, H, Sq, Dv), a view of a (B, Sq, H, Dv) buffer; zeros for rows with no key.
        With ``return_lse`` also lse (B, H, Sq) float32, ``-inf`` for rows with no key.
    """
    b, h, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    dtype = q.dtype
    q, k, v = _upcast(q), _upcast(k), _upcast(v)
    mask4 = None if mask is None else _as_4d(mask)
    mm = mm or (matmul_nt if sk < _NARROW_KEYS else gemm_for(q))
    plan = _Plan.make(q, sk, g, Structure(causal, window), mask4, mm, return_lse, scale)
    out = torch.empty((b, plan.sqp, h, dv), dtype=q.dtype, device=q.device)  # (B, Sqp, H, Dv)
    lse = torch.empty((b, plan.sqp, h), dtype=q.dtype, device=q.device) if return_lse else None  # (B, Sqp, H)
    stage = _Stage(q, k, v, plan)
    for bi in range(b):
        for gi in range(hkv):
            stage.load(bi, gi, plan.pre_scale)
            dst = out.view(b, plan.sqp, hkv, g, dv)[bi, :, gi]  # (Sqp, G, Dv)
            dst_lse = None if lse is None else lse.view(b, plan.sqp, hkv, g)[bi, :, gi]  # (Sqp, G)
            for p0 in range(0, plan.sqp, plan.step):
                _attend_block(stage, plan, bi, gi, p0, dst, dst_lse)
    result = out[:, :sq].permute(0, 2, 1, 3)  # (B, H, Sq, Dv)
    result = result if result.dtype == dtype else result.to(dtype)
    if lse is None:
        return result
    return result, lse[:, :sq].permute(0, 2, 1).to(lse_dtype(dtype))  # (B, H, Sq)


@dataclass(eq=False)  # identity, as before: a plan holds tensors
class _Plan:
    """The fixed sizes of one :func:`blocked_attention` call (see the module legend).

    Attributes:
        structure: the causal/window rule. off: Sk - Sq (query i at position i + off).
        sq, sk, g: queries, keys, query heads per K/V head. step: P positions per
        block; sqp: Sq rounded up to P; align: the key alignment (1 below
        ``_NARROW_KEYS`` keys); skp: Sk rounded up to it;
        chunk: keys per chunk. mask: the caller's 4-D mask or None. mm: the GEMM.
        return_lse: the caller wants the log-sum-exp. pre_scale, post_scale: the
        logit scale applied to the queries before the product or to the scores after it
        (the other one 1; see :func:`_split_scale`). may_die: a row may see no key
        at all. plain: nothing to mask anywhere. bands: cache of :meth:`band`.
    """

    structure: Structure
    off: int
    sq: int
    sk: int
    g: int
    step: int
    sqp: int
    align: int
    skp: int
    chunk: int
    mask: torch.Tensor | None
    mm: MatMul
    return_lse: bool
    pre_scale: float
    post_scale: float
    may_die: bool
    plain: bool
    bands: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def make(cls, q: torch.Tensor, sk: int, g: int, structure: Structure, mask: torch.Tensor | None,
             mm: MatMul, return_lse: bool, scale: float) -> "_Plan":
        sq = q.shape[2]
        align = 1 if sk < _NARROW_KEYS else _KEY_ALIGN
        chunk = max(align, _KEY_CHUNK // align * align)
        skp = -(-sk // align) * align  # Sk rounded up
        step = max(1, _block_rows(sq * g, min(skp, chunk), structure.causal) // g)  # P positions, R = P·G rows
        off = sk - sq
        pre_scale, post_scale = _split_scale(scale)
        may_die = mask is not None or off < 0 or (structure.window is not None and not structure.causal)
        return cls(structure=structure, off=off, sq=sq, sk=sk, g=g, step=step, sqp=-(-sq // step) * step,
                   align=align, skp=skp, chunk=chunk, mask=mask, mm=mm, return_lse=return_lse,
                   pre_scale=pre_scale, post_scale=post_scale, may_die=may_die,
                   plain=structure.trivial and mask is None and skp == sk)

    def band(self, p0: int, p1: int, c0: int, c1: int, device: torch.device) -> torch.Tensor:
        """(P, c1 - c0) bool: True where the structure blocks query rows p0..p1-1.

        Filled in rather than added as -inf: an add is faster, but NaN + -inf is NaN, so a
        NaN key would reach rows that may not see it. Cached: a band depends only on
        relative offsets.
        """
        key = (p1 - p0, c0 - p0, c1 - c0)
        if key not in self.bands:
            rows = torch.arange(p0 + self.off, p1 + self.off, device=device)[:, None]  # (P, 1) positions
            cols = torch.arange(c0, c1, device=device)[None, :]  # (1, W)
            self.bands[key] = ~self.structure.allows(rows, cols)  # (P, W)
        return self.bands[key]


class _Stage:
    """One (batch row, K/V group) staged for the GEMMs: queries (times ``pre_scale``) position-major
    (Sqp, G, D), so the G heads of a block of positions form one (R, D) matrix, and
    K/V with contiguous rows zero-padded to Skp. Buffers are reused across groups:
    fresh memory costs a page fault per 4 KiB on first touch."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan) -> None:
        d, dv = q.shape[-1], v.shape[-1]
        self.q, self.k, self.v, self.plan = q, k, v, plan
        self.qg = q.new_zeros((plan.sqp, plan.g, d))  # (Sqp, G, D)
        # None: K (V) is read in place (no padding, contiguous rows), else staged here.
        direct_k = plan.skp == plan.sk and _rows_contiguous(k)
        direct_v = plan.skp == plan.sk and _rows_contiguous(v)
        self.kg: torch.Tensor | None = None if direct_k else k.new_zeros((plan.skp, d))  # (Skp, D)
        self.vg: torch.Tensor | None = None if direct_v else v.new_zeros((plan.skp, dv))  # (Skp, Dv)

    def load(self, bi: int, gi: int, pre_scale: float) -> None:
        g, sq, sk = self.plan.g, self.plan.sq, self.plan.sk
        torch.mul(self.q[bi, gi * g:(gi + 1) * g].transpose(0, 1), pre_scale, out=self.qg[:sq])  # (Sq, G, D)
        self.q2 = self.qg.view(-1, self.qg.shape[-1])  # (Sqp·G, D)
        if self.kg is not None:
            self.kg[:sk] = self.k[bi, gi]
        if self.vg is not None:
            self.vg[:sk] = self.v[bi, gi]
        self.k2 = self.k[bi, gi] if self.kg is None else self.kg  # (Skp, D)
        self.vt2 = (self.v[bi, gi] if self.vg is None else self.vg).transpose(0, 1)  # (Dv, Skp)


def _attend_block(stage: _Stage, plan: _Plan, bi: int, gi: int, p0: int, dst: torch.Tensor,
                  dst_lse: torch.Tensor | None) -> None:
    """Rows of query positions [p0, p0 + P) of one group: out (P, G, Dv) into ``dst``."""
    p1, g, align = p0 + plan.step, plan.g, plan.align
    lo, hi = plan.structure.key_range(p0 + plan.off, p1 + plan.off, plan.sk)  # keys some row may see
    if hi <= lo:
        dst[p0:p1].zero_()
        if dst_lse is not None:
            dst_lse[p0:p1].fill_(_NEG_INF)
        return
    lo, hi = lo // align * align, min(plan.skp, -(-hi // align) * align)  # aligned: few shapes
    x = stage.q2[p0 * g:p1 * g]  # (R, D)
    acc: torch.Tensor | None = None
    acc_lse: torch.Tensor | None = None
    for c0 in range(lo, hi, plan.chunk):
        c1 = min(c0 + plan.chunk, hi)
        chunked = c0 > lo or c1 < hi
        s = plan.mm(x, stage.k2[c0:c1])  # (R, W)
        if plan.post_scale != 1.0:
            s.mul_(plan.post_scale)
        masked = not plan.plain and _mask_scores(s.view(plan.step, g, c1 - c0), plan, bi, gi, p0, c0, c1)
        # A row may see no key of one chunk (causal band) though it sees others.
        check_dead = masked and (plan.may_die or chunked or plan.return_lse)
        smax = s.amax(-1) if chunked or check_dead or plan.return_lse else None  # (R,)
        dead = smax == _NEG_INF if check_dead and smax is not None else None  # (R,) rows with no allowed key
        torch._softmax(s, -1, False, out=s)  # in place
        o = plan.mm(s, stage.vt2[:, c0:c1])  # (R, Dv)
        if dead is not None:
            o.masked_fill_(dead[:, None], 0.0)  # softmax gave NaN there
        lse: torch.Tensor | None = None
        if smax is not None:
            # lse = max + log(sum), and the softmax's largest entry is exp(0)/sum.
            lse = smax - torch.log(s.amax(-1))
            if dead is not None:
                lse.masked_fill_(dead, _NEG_INF)
        if not chunked:
            acc, acc_lse = o, lse
            break
        assert lse is not None  # a chunked block computes its log-sum-exp
        acc, acc_lse = _merge(acc, acc_lse, o, lse)
    assert acc is not None  # hi > lo: at least one chunk
    dst[p0:p1] = acc.view(plan.step, g, -1)
    if dst_lse is not None:
        assert acc_lse is not None  # return_lse: every chunk computes its log-sum-exp
        dst_lse[p0:p1] = acc_lse.view(plan.step, g)


def _mask_scores(s3: torch.Tensor, plan: _Plan, bi: int, gi: int, p0: int, c0: int, c1: int) -> bool:
    """Set -inf where a block's scores (P, G, W) are masked; return whether any may be.

    Structural masking can only touch two column bands of a block: on the right the
    keys past the span of the block's first query, on the left the keys before the
    span of its last query; the rest of the block runs unmasked.
    """
    masked = False
    p1, sq, sk = p0 + plan.step, plan.sq, plan.sk
    regions = []
    if not plan.structure.trivial:
        unbounded = 1 << 62  # spans unclipped by Sk: the padding is masked below
        first_hi = plan.structure.span(p0 + plan.off, unbounded)[1]  # right band: columns ≥ first_hi
        if first_hi < c1:
            regions.append((max(c0, first_hi), c1))
        last_lo = min(c1, plan.structure.span(p1 - 1 + plan.off, unbounded)[0])  # left band: columns < last_lo
        if last_lo > c0:
            regions.append((c0, last_lo))
    for a0, a1 in regions:
        s3[:, :, a0 - c0:a1 - c0].masked_fill_(plan.band(p0, p1, a0, a1, s3.device)[:, None, :], _NEG_INF)
        masked = True
    if c1 > sk:  # zero padding of K/V
        s3[:, :, max(0, sk - c0):].fill_(_NEG_INF)
        masked = True
    if plan.mask is not None:
        r1, w1 = min(p1, sq), min(c1, sk)  # the caller's mask covers no padding
        m = _mask_block(plan.mask, bi, gi, plan.g, p0, r1, c0, w1)
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
    if acc is None or acc_lse is None:  # the first chunk (the two are set together)
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
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention for few queries (decoding): two batched matmuls over all K/V heads.

    The G query heads of a group share one matmul against their K/V head (no repeat),
    so K and V are each read once. Scores are (B, Hkv, Sq·G, Sk): small when Sq is.

    Args and returns: as :func:`blocked_attention` (output (B, H, Sq, Dv), and lse
    (B, H, Sq) with ``return_lse``).
    """
    b, h, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    dtype = q.dtype
    q, k, v = _upcast(q), _upcast(k), _upcast(v)
    pre_scale, post_scale = _split_scale(scale)
    qs = (q.view(b, hkv, g, sq, d).transpose(2, 3) * pre_scale).reshape(b, hkv, sq * g, d)  # (B, Hkv, Sq·G, D)
    s = torch.matmul(qs, k.transpose(-1, -2))  # (B, Hkv, Sq·G, Sk)
    if post_scale != 1.0:
        s.mul_(post_scale)
    # With one query per row and a causal mask every cached key is visible: no mask.
    structural = window is not None or (causal and sq > 1)
    if mask is not None or structural:
        allowed = _decode_mask(mask, b, h, hkv, g, sq, sk, causal, window, q.device)
        s = s.view(b, hkv, sq, g, sk).masked_fill(~allowed, _NEG_INF).view(b, hkv, sq * g, sk)
    lse = torch.logsumexp(s, dim=-1) if return_lse else None  # (B, Hkv, Sq·G)
    s = safe_softmax(s) if mask is not None or structural else torch._softmax(s, -1, False, out=s)
    o = torch.matmul(s, v)  # (B, Hkv, Sq·G, Dv)
    out = o.view(b, hkv, sq, g, dv).permute(0, 1, 3, 2, 4).reshape(b, h, sq, dv)  # (B, H, Sq, Dv)
    out = out if out.dtype == dtype else out.to(dtype)
    if lse is None:
        return out
    return out, lse.view(b, hkv, sq, g).permute(0, 1, 3, 2).reshape(b, h, sq).to(lse_dtype(dtype))  # (B, H, Sq)


def _decode_mask(mask: torch.Tensor | None, b: int, h: int, hkv: int, g: int, sq: int, sk: int,
                 causal: bool, window: int | None, device: torch.device) -> torch.Tensor:
    """Combined mask broadcastable to (B, Hkv, Sq, G, Sk)."""
    full = full_mask(mask, causal, window, sq, sk, device)
    assert full is not None  # the caller masks, or the structure does
    m = _as_4d(full)  # (B|1, H|1, Sq|1, Sk|1)
    m = m.expand(m.shape[0], m.shape[1], sq, m.shape[3])
    if m.shape[1] == h:
        return m.reshape(m.shape[0], hkv, g, sq, m.shape[3]).transpose(2, 3)  # (B|1, Hkv, Sq, G, Sk|1)
    return m[:, :, :, None, :]  # (B|1, 1, Sq, 1, Sk|1)


@register_backend("blocked", lse=True)
def blocked_backend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    mask: torch.Tensor | None, causal: bool, window: int | None, scale: float,
    dropout_p: float, return_weights: bool, return_lse: bool, features: Features = NO_FEATURES,
) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """The blocked kernel: inference only (no gradients, no dropout, no logit feature; refused by
    the registry; packed sequences reach it as a mask).

    Why not our forward with torch's flash backward (fed our output and log-sum-exp): the
    backward recomputes the logits with its own GEMM, and the few-ulp mismatch with ours
    leaves the probabilities summing to 1 ± ε, which its Δ = rowsum(dO·O) term turns into
    gradient errors several times those of a plain float32 implementation.
    """
    result = blocked_attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask, return_lse=return_lse)
    if isinstance(result, tuple):
        return result[0], None, result[1]
    return result, None, None
