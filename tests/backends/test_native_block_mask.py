"""The native kernels with a block mask (tile classes and partial tiles' bytes): exact against
the float64 reference on the dense mask it stands for, forward and backward, and skipping its
empty tiles (the kernel's own count of the q·kᵀ panels it computed).

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim; bq, bk
the block sizes, nQ = ⌈Sq/bq⌉, nK = ⌈Sk/bk⌉.

The tiles are built here from a dense mask by a few lines of torch (:func:`tiles_of`), not by
:class:`multihead.BlockMask`, so that the kernels are checked against an oracle of their own.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import native
from multihead.backends.native import ops
from multihead.backends.native.attention import Tiles

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler: " + native.status())


def tiles_of(mask: torch.Tensor, bq: int, bk: int) -> Tiles:
    """The block mask of a dense bool mask (Bm, Hm, Sq, Sk): -1 where no pair of a tile may attend,
    -2 where every pair inside [0, Sq) × [0, Sk) may, else the index of its bytes."""
    bm, hm, sq, sk = mask.shape
    nq, nk = -(-sq // bq), -(-sk // bk)
    padded = torch.zeros(bm, hm, nq * bq, nk * bk, dtype=torch.bool)
    padded[:, :, :sq, :sk] = mask
    inside = torch.zeros(nq * bq, nk * bk, dtype=torch.bool)
    inside[:sq, :sk] = True
    blocks = padded.view(bm, hm, nq, bq, nk, bk).permute(0, 1, 2, 4, 3, 5)  # (Bm, Hm, nQ, nK, bq, bk)
    inside_blocks = inside.view(nq, bq, nk, bk).permute(0, 2, 1, 3)  # (nQ, nK, bq, bk)
    some = blocks.flatten(-2).any(-1)
    every = (blocks | ~inside_blocks).flatten(-2).all(-1)
    classes = torch.full((bm, hm, nq, nk), -1, dtype=torch.int32)
    classes[some & every] = -2
    partial = some & ~every
    classes[partial] = torch.arange(int(partial.sum()), dtype=torch.int32)
    return Tiles(classes, blocks[partial].to(torch.uint8).contiguous(), bq, bk)


def block_pattern(b: int, h: int, sq: int, sk: int, bq: int, bk: int, keep: float, seed: int) -> torch.Tensor:
    """A random block-sparse bool mask (b, h, Sq, Sk): a fraction ``keep`` of the tiles live,
    each pair of a live tile allowed with probability 0.9 (or 1 in one tile of four: full tiles)."""
    gen = torch.Generator().manual_seed(seed)
    nq, nk = -(-sq // bq), -(-sk // bk)
    live = torch.rand(b, h, nq, nk, generator=gen) < keep
    solid = torch.rand(b, h, nq, nk, generator=gen) < 0.25
    grow = lambda t: t.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[:, :, :sq, :sk]  # noqa: E731
    return grow(live) & (grow(solid) | (torch.rand(b, h, sq, sk, generator=gen) < 0.9))


def max_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    return (got.double() - truth).abs().max().item()


CASES = [  # B, H, Hkv, Sq, Sk, bq, bk, per-head pattern, causal
    (2, 4, 2, 300, 300, 64, 64, False, False),
    (1, 6, 2, 257, 513, 128, 128, True, True),
    (2, 2, 1, 100, 700, 32, 96, False, False),
    (1, 2, 2, 1, 640, 16, 128, True, False),
]


@pytest.mark.parametrize("b, h, hkv, sq, sk, bq, bk, per_head, causal", CASES)
def test_forward_equals_the_dense_mask(b: int, h: int, hkv: int, sq: int, sk: int, bq: int, bk: int,
                                       per_head: bool, causal: bool) -> None:
    """float32 within 2× the naive error of the float64 truth on the dense mask; bfloat16 and
    float16 within their rounding; rows of empty tiles only give zeros."""
    mask = block_pattern(b, h if per_head else 1, sq, sk, bq, bk, keep=0.35, seed=sq)
    mask[:, :, :3] = False  # rows with no key at all
    tiles = tiles_of(mask, bq, bk)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, sq, 64, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, sk, 64, generator=gen, dtype=torch.float64) for _ in range(2))
    truth = mh.attention(q, k, v, mask=mask, causal=causal, backend="explicit")
    with torch.no_grad():
        low = q.float(), k.float(), v.float()
        ours = native.attention_f32(*low, scale=64 ** -0.5, causal=causal, tiles=tiles)
        naive = mh.attention(*low, mask=mask, causal=causal, backend="explicit")
        assert max_error(ours, truth) <= 2 * max_error(naive, truth)
        assert torch.equal(ours[:, :, :3], torch.zeros_like(ours[:, :, :3]))
        for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 4e-3)):
            half = native.attention_f32(*(t.to(dtype) for t in (q, k, v)), scale=64 ** -0.5, causal=causal,
                                        tiles=tiles)
            assert max_error(half, truth) < tol, dtype


def expected_panels(tiles: Tiles, b: int, h: int, sq: int, sk: int) -> int:
    """The panels (NR keys × a group of MR query rows) of key blocks some row of the group may
    see by the tiles (no structure: every row's keys are [0, Sk)); nothing else."""
    wide = native.vector_bits() == 512
    mr, nr, qt = (12, 32, native.attention.query_tile()) if wide else (6, 16, native.attention.query_tile())
    classes = tiles.classes.expand(b, h, *tiles.classes.shape[2:])  # (B, H, nQ, nK)
    total = 0
    for p0 in range(0, sq, qt):
        rows = min(qt, sq - p0)
        for r0 in range(0, rows, mr):
            first, last = p0 + r0, p0 + min(r0 + mr, rows) - 1
            live = (classes[:, :, first // tiles.bq:last // tiles.bq + 1] != -1).any(2)  # (B, H, nK)
            for pan in range(-(-sk // nr)):
                total += int(live[:, :, pan * nr // tiles.bk].sum())
    return total


def test_empty_tiles_are_never_computed() -> None:
    """The kernel's own panel count equals the panels of the live tiles exactly; a 90%-empty
    pattern computes at most about a tenth of the dense problem's panels; an all-empty one none."""
    b, h, s, bq, bk = 1, 2, 1024, 96, 128
    q, k, v = (torch.randn(b, h, s, 64) for _ in range(3))
    dense_panels = native.key_panels(q, k, v, scale=0.125)
    for keep in (0.1, 0.5):
        tiles = tiles_of(block_pattern(b, h, s, s, bq, bk, keep=keep, seed=7), bq, bk)
        got = native.key_panels(q, k, v, scale=0.125, tiles=tiles)
        assert got == expected_panels(tiles, b, h, s, s)
        if keep == 0.1:
            assert got <= 0.15 * dense_panels, (got, dense_panels)
    nothing = tiles_of(torch.zeros(1, 1, s, s, dtype=torch.bool), bq, bk)
    assert native.key_panels(q, k, v, scale=0.125, tiles=nothing) == 0


@pytest.mark.parametrize("window", [None, 200])
def test_partial_tiles_compute_only_the_panels_their_rows_reach(window: int | None) -> None:
    """A causal (or causal windowed) mask_mod as a plain lambda gives partial tiles on its edges: the
    kernel computes only the key panels their rows' allowed bytes reach, exactly the panels of the
    same structure given as causal=/window= (tiles of 96: row groups align with both loops')."""
    q, k, v = (torch.randn(1, 2, 700, 64) for _ in range(3))
    w = window or 10**9

    def mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        return (qi >= ki) & (qi - ki < w)

    block = mh.BlockMask.from_mask_mod(mod, None, None, 700, 700, block_size=96)
    assert block.counts()[2] > 0  # partial tiles
    tiles = native.Tiles(block.tiles, block.partial, *block.block_size)
    structured = native.key_panels(q, k, v, scale=0.125, causal=True, window=window)
    assert native.key_panels(q, k, v, scale=0.125, tiles=tiles) == structured


@pytest.mark.parametrize("b, hkv", [(1, 1), (2, 2)])  # the two-pass backward, and the fused one (B·Hkv ≥ 4)
def test_gradients_equal_the_dense_mask(b: int, hkv: int) -> None:
    """dq, dk, dv through the operator with a block mask: float32 within 3× the naive error,
    float64 (its plain loop, the block mask as a dense one) equal to the reference; rows with no
    key give zero gradients."""
    h, sq, sk, bq, bk = 2 * hkv, 200, 264, 32, 64
    mask = block_pattern(b, h, sq, sk, bq, bk, keep=0.4, seed=3)
    mask[:, :, :4] = False
    tiles = tiles_of(mask, bq, bk)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(b, h, sq, 64, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, sk, 64, generator=gen, dtype=torch.float64) for _ in range(2))
    up = torch.randn(b, h, sq, 64, generator=gen, dtype=torch.float64)

    def grads(dtype: torch.dtype, run_native: bool) -> tuple[torch.Tensor, ...]:
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        if run_native:
            out = ops.run(*leaves, scale=64 ** -0.5, causal=False, window=None, mask=None, tiles=tiles)[0]
        else:
            out = mh.attention(*leaves, mask=mask, backend="explicit")
        return torch.autograd.grad(out, leaves, up.to(dtype))

    truth, ours, naive = grads(torch.float64, False), grads(torch.float32, True), grads(torch.float32, False)
    for name, got, want, base in zip(("dq", "dk", "dv"), ours, truth, naive):
        assert max_error(got, want) <= 3 * max_error(base, want), name
    assert torch.equal(ours[0][:, :, :4], torch.zeros_like(ours[0][:, :, :4]))
    for got, want in zip(grads(torch.float64, True), truth):
        assert max_error(got, want) < 1e-12


def test_operator_with_a_block_mask_passes_opcheck() -> None:
    """``multihead::attention`` with tiles: schema, fake tensor, autograd registration."""
    mask = block_pattern(1, 1, 70, 96, 32, 32, keep=0.5, seed=2)
    tiles = tiles_of(mask, 32, 32)
    q = torch.randn(1, 2, 70, 16, requires_grad=True)
    k, v = (torch.randn(1, 1, 96, 16, requires_grad=True) for _ in range(2))
    torch.library.opcheck(torch.ops.multihead.attention.default,
                          (q, k, v, None, 0.25, False, None, False, None, None, None, None, *tiles))


BAD = [
    (lambda t: t._replace(classes=t.classes.long()), "int32"),
    (lambda t: t._replace(classes=t.classes[:, :, :-1]), "nQ"),
    (lambda t: t._replace(classes=t.classes.clone().fill_(-3)), "-1, -2 or an index"),
    (lambda t: t._replace(classes=t.classes.clone().fill_(10**6)), "-1, -2 or an index"),
    (lambda t: t._replace(partial=t.partial[:, :, :16]), "partial tiles"),
    (lambda t: t._replace(partial=t.partial.transpose(1, 2)), "partial tiles"),
    (lambda t: t._replace(bk=48), "bk"),
    (lambda t: t._replace(bk=2048), "bk"),
    (lambda t: t._replace(bq=0), "bq"),
]


@pytest.mark.parametrize("corrupt, words", BAD)
def test_bad_tiles_are_refused_before_the_kernel_reads_them(corrupt, words: str) -> None:  # type: ignore[no-untyped-def]
    """Each field the kernel reads as raw memory is checked first (eager and operator entries)."""
    tiles = tiles_of(block_pattern(1, 1, 64, 64, 32, 32, keep=0.5, seed=4), 32, 32)
    q, k, v = (torch.randn(1, 1, 64, 32) for _ in range(3))
    bad = corrupt(tiles)
    with pytest.raises(ValueError, match=words):
        native.attention_f32(q, k, v, scale=0.1, tiles=bad)
    with pytest.raises(ValueError, match=words):
        torch.ops.multihead.attention(q, k, v, None, 0.1, False, None, False, None, None, None, None, *bad)


def test_a_block_mask_with_a_dense_mask_is_refused() -> None:
    tiles = tiles_of(torch.ones(1, 1, 64, 64, dtype=torch.bool), 32, 32)
    q, k, v = (torch.randn(1, 1, 64, 32) for _ in range(3))
    with pytest.raises(ValueError, match="fold the mask"):
        native.attention_f32(q, k, v, scale=0.1, mask=torch.ones(64, 64, dtype=torch.bool), tiles=tiles)
