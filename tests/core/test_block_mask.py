"""Block masks and mask_mods (FlexAttention's interface): the tiles equal the dense mask's blocks.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim,
bq x bk the tile size.

The oracle of a classification is the dense mask cut into tiles by hand (a loop over tiles,
which the implementation never does); the oracle of attention with a block mask or a
mask_mod is the float64 ``"explicit"`` backend given the dense mask.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.backends import registry
from multihead.block_mask import EMPTY, FULL, BlockMask, create_block_mask, evaluate_mask_mod
from multihead.mask_mods import (StructureMaskMod, and_masks, causal_mask_mod, document_mask_mod, or_masks,
                                 prefix_lm_mask_mod, sliding_window_mask_mod)
from multihead.masks import Structure

PROFILE = settings(max_examples=60, deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def tiles_by_hand(mask: torch.Tensor, bq: int, bk: int) -> list[tuple[tuple[int, int, int, int], int, torch.Tensor]]:
    """Each tile of ``mask`` (B, H, Sq, Sk): its index, EMPTY / FULL / 0 (partial), its in-range part."""
    b, h, sq, sk = mask.shape
    out = []
    for bi in range(b):
        for hi in range(h):
            for qi, q0 in enumerate(range(0, sq, bq)):
                for ki, k0 in enumerate(range(0, sk, bk)):
                    part = mask[bi, hi, q0:q0 + bq, k0:k0 + bk]
                    kind = EMPTY if not part.any() else FULL if part.all() else 0
                    out.append(((bi, hi, qi, ki), kind, part))
    return out


def check_classification(block: BlockMask, mask: torch.Tensor) -> None:
    """``block``'s tiles are exactly ``mask``'s (B, H, Sq, Sk) blocks, its partial masks their bytes."""
    bq, bk = block.block_size
    tiles = block.tiles.expand(mask.shape[0], mask.shape[1], -1, -1)
    for (bi, hi, qi, ki), kind, part in tiles_by_hand(mask, bq, bk):
        got = int(tiles[bi, hi, qi, ki])
        if kind != 0:
            assert got == kind, f"tile {(bi, hi, qi, ki)}: {got}, want {kind}"
            continue
        assert got >= 0, f"tile {(bi, hi, qi, ki)} is partial, got {got}"
        want = torch.zeros(bq, bk, dtype=torch.uint8)
        want[:part.shape[0], :part.shape[1]] = part
        assert torch.equal(block.partial[got], want), f"tile {(bi, hi, qi, ki)}'s bytes"


@st.composite
def dense_masks(draw: st.DrawFn) -> tuple[torch.Tensor, tuple[int, int]]:
    b, h = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3]))
    sq, sk = draw(st.integers(1, 70)), draw(st.integers(1, 100))
    bq, bk = draw(st.sampled_from([1, 3, 8, 16, 33])), draw(st.sampled_from([32, 64]))
    density = draw(st.sampled_from([0.0, 0.05, 0.5, 0.95, 1.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    mask = torch.rand(b, h, sq, sk, generator=gen) < density
    if draw(st.booleans()):  # whole rows and columns of one value, so full and empty tiles occur at any density
        mask[..., : sq // 3, :] = True
        mask[..., :, -(sk // 4) or sk:] = False
    return mask, (bq, bk)


@PROFILE
@given(dense_masks())
def test_tiles_equal_the_dense_masks_blocks_ragged_edges_included(case: tuple[torch.Tensor, tuple[int, int]]) -> None:
    mask, size = case
    block = BlockMask.from_dense(mask, size)
    check_classification(block, mask)
    assert block.partial.is_contiguous() and block.partial.dtype == torch.uint8 and block.tiles.dtype == torch.int32
    assert torch.equal(block.dense().expand(mask.shape), mask)  # the round trip
    empty, full, partial = block.counts()
    assert empty + full + partial == block.tiles.numel() and partial == block.partial.shape[0]


@PROFILE
@given(dense_masks())
def test_from_mask_mod_equals_from_dense_of_the_evaluated_mask(case: tuple[torch.Tensor, tuple[int, int]]) -> None:
    """A table indexed by (b, h, row, key) as a mask_mod: per batch row and per head, Sq != Sk."""
    table, size = case
    b, h, sq, sk = table.shape

    def lookup(bi: torch.Tensor, hi: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return table[bi, hi, q_idx - (sk - sq), kv_idx]  # q_idx is the position i + Sk - Sq
    block = BlockMask.from_mask_mod(lookup, b, h, sq, sk, size)
    check_classification(block, table)
    assert block.shape == (b, h, sq, sk)


def test_a_mask_mod_that_ignores_b_and_h_is_kept_once() -> None:
    block = BlockMask.from_mask_mod(causal_mask_mod, 4, 8, 300, 260)
    assert block.tiles.shape == (1, 1, 3, 3) and block.shape == (4, 8, 300, 260)
    per_head = BlockMask.from_mask_mod(lambda b, h, q, k: (k % (h + 1)) == 0, None, 3, 40, 64, (8, 32))
    assert per_head.tiles.shape == (1, 3, 5, 2)


@pytest.mark.parametrize("sq, sk", [(7, 7), (5, 9), (9, 5), (1, 40), (130, 300)])
@pytest.mark.parametrize("window", [None, 1, 3, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_causal_and_window_mask_mods_are_structures_rule(sq: int, sk: int, window: int | None, causal: bool) -> None:
    """Bottom-right aligned (query i at i + Sk - Sq), as Structure.dense, for every Sq, Sk."""
    if not causal and window is None:
        return
    mod = causal_mask_mod if window is None else sliding_window_mask_mod(window, causal=causal)
    got = evaluate_mask_mod(mod, 1, 1, sq, sk)[0, 0]
    assert torch.equal(got, Structure(causal, window).dense(sq, sk))
    block = BlockMask.from_mask_mod(mod, None, None, sq, sk, (16, 32))
    assert torch.equal(block.dense()[0, 0], Structure(causal, window).dense(sq, sk))


@PROFILE
@given(st.integers(0, 90), st.integers(1, 130), st.sampled_from([None, 1, 2, 5, 40, 200]), st.booleans(),
       st.sampled_from([1, 7, 16, 64]), st.sampled_from([32, 64]))
def test_structure_mask_mods_are_classified_from_their_spans_as_by_evaluation(
        sq: int, sk: int, window: int | None, causal: bool, bq: int, bk: int) -> None:
    """The built-in causal / window mask_mods take from_structure (no pair evaluated): the same
    tiles and bytes as evaluating them pair by pair (a plain function hides their structure)."""
    if not causal and window is None:
        causal = True
    mod = causal_mask_mod if window is None else sliding_window_mask_mod(window, causal=causal)
    fast = BlockMask.from_mask_mod(mod, 2, 3, sq, sk, (bq, bk))

    def plain(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return mod(b, h, q_idx, kv_idx)
    slow = BlockMask.from_mask_mod(plain, 2, 3, sq, sk, (bq, bk))
    assert torch.equal(fast.tiles, slow.tiles) and torch.equal(fast.partial, slow.partial)
    assert fast.shape == slow.shape == (2, 3, sq, sk)
    check_classification(fast, Structure(causal, window).dense(sq, sk)[None, None])


@PROFILE
@given(dense_masks(), st.sampled_from([None, 1, 9, 40]), st.booleans())
def test_a_mask_mod_within_a_structure_is_evaluated_only_where_it_reaches_with_the_same_tiles(
        case: tuple[torch.Tensor, tuple[int, int]], window: int | None, causal: bool) -> None:
    """and_masks(structure, table): the key blocks outside the structure's reach are not evaluated
    (a spy sees only keys it reaches), and the tiles are the evaluated dense mask's."""
    table, size = case
    b, h, sq, sk = table.shape
    if not causal and window is None:
        causal = True
    seen = []

    def lookup(bi: torch.Tensor, hi: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        seen.append((int(q_idx.min()), int(q_idx.max()), int(kv_idx.min()), int(kv_idx.max())))
        return table[bi, hi, q_idx - (sk - sq), kv_idx]
    structure = Structure(causal, window)
    mod = and_masks(StructureMaskMod(structure), lookup)
    assert mod.within == structure
    dense = evaluate_mask_mod(mod, b, h, sq, sk)  # every pair, for the oracle
    seen.clear()
    block = BlockMask.from_mask_mod(mod, b, h, sq, sk, size)
    check_classification(block, dense.expand(b, h, sq, sk))
    bk = size[1]
    for q_lo, q_hi, k_lo, k_hi in seen:  # each block-row evaluated on the key blocks its rows reach
        lo, hi = structure.key_range(q_lo, q_hi + 1, sk)
        assert k_lo == lo // bk * bk and k_hi == min(sk, -(-hi // bk) * bk) - 1


def test_and_masks_of_structures_is_their_structure() -> None:
    both = and_masks(causal_mask_mod, sliding_window_mask_mod(7, causal=False), sliding_window_mask_mod(5))
    assert isinstance(both, StructureMaskMod) and both.structure == Structure(causal=True, window=5)
    assert torch.equal(evaluate_mask_mod(both, 1, 1, 20, 30)[0, 0], Structure(True, 5).dense(20, 30))


def test_document_and_prefix_lm_mask_mods() -> None:
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]])
    got = evaluate_mask_mod(document_mask_mod(ids), 2, 1, 8, 8)[:, 0]
    assert torch.equal(got, ids[:, :, None] == ids[:, None, :])
    with pytest.raises(ValueError, match="document_mask_mod needs query positions >= 0 .* got -2"):
        evaluate_mask_mod(document_mask_mod(ids), 2, 1, 10, 8)
    causal = Structure(causal=True).dense(6, 6)
    prefix = torch.zeros(6, 6, dtype=torch.bool)
    prefix[:, :3] = True
    assert torch.equal(evaluate_mask_mod(prefix_lm_mask_mod(3), 1, 1, 6, 6)[0, 0], causal | prefix)
    lengths = torch.tensor([1, 4])
    per_row = evaluate_mask_mod(prefix_lm_mask_mod(lengths), 2, 1, 6, 6)[:, 0]
    for bi, n in enumerate(lengths.tolist()):
        want = causal.clone()
        want[:, :n] = True
        assert torch.equal(per_row[bi], want)


def test_and_masks_and_or_masks() -> None:
    window = sliding_window_mask_mod(3, causal=False)
    both = evaluate_mask_mod(and_masks(causal_mask_mod, window), 1, 1, 9, 9)
    either = evaluate_mask_mod(or_masks(causal_mask_mod, window), 1, 1, 9, 9)
    c, w = Structure(causal=True).dense(9, 9), Structure(window=3).dense(9, 9)
    assert torch.equal(both[0, 0], c & w) and torch.equal(either[0, 0], c | w)
    with pytest.raises(ValueError, match="and_masks needs at least one mask_mod"):
        and_masks()
    with pytest.raises(TypeError, match="or_masks's mask_mod 1 must be callable"):
        or_masks(causal_mask_mod, 3)  # type: ignore[arg-type]


def test_intersection_with_a_block_mask_and_a_dense_mask() -> None:
    causal = BlockMask.from_mask_mod(causal_mask_mod, None, None, 70, 90, (16, 32))
    ids = torch.tensor([0] * 30 + [1] * 60)
    docs = BlockMask.from_mask_mod(document_mask_mod(ids), None, None, 70, 90, (16, 32))
    both = causal & docs
    want = causal.dense() & docs.dense()
    check_classification(both, want)
    keys = torch.rand(2, 1, 1, 90) < 0.7  # (B, 1, 1, Sk): padding per batch row
    padded = causal & keys
    check_classification(padded, causal.dense() & keys)
    assert padded.tiles.shape[0] == 2
    with pytest.raises(ValueError, match=r"other must have \(Sq, Sk\) = \(70, 90\)"):
        causal & BlockMask.from_mask_mod(causal_mask_mod, None, None, 70, 91, (16, 32))


@PROFILE
@given(dense_masks(), st.integers(0, 2**16), st.sampled_from(["block", "dense", "keys"]))
def test_an_intersection_is_classified_as_the_and_of_the_dense_masks(
        case: tuple[torch.Tensor, tuple[int, int]], seed: int, kind: str) -> None:
    mask, size = case
    b, h, sq, sk = mask.shape
    gen = torch.Generator().manual_seed(seed)
    shape = (1, 1, 1, sk) if kind == "keys" else (b, 1, sq, sk)
    other = torch.rand(*shape, generator=gen) < 0.7
    other[..., :, : sk // 2] = True  # full tiles on both sides, so each pairing occurs
    block = BlockMask.from_dense(mask, size)
    both = block & (BlockMask.from_dense(other.expand(b, 1, sq, sk), size) if kind == "block" else other)
    check_classification(both, mask & other)
    assert torch.equal(both.dense().expand(b, h, sq, sk), mask & other)


def test_counts_sparsity_and_repr() -> None:
    block = BlockMask.from_mask_mod(causal_mask_mod, None, None, 512, 512)
    assert block.counts() == (6, 6, 4) and block.sparsity() == pytest.approx(6 / 16)
    text = repr(block)
    assert "shape=(1, 1, 512, 512)" in text and "sparsity=37.50%" in text and "█" in text


def test_create_block_mask_has_flex_attentions_argument_names() -> None:
    block = create_block_mask(causal_mask_mod, B=None, H=None, Q_LEN=300, KV_LEN=300, block_size=128)
    assert torch.equal(block.tiles, BlockMask.from_mask_mod(causal_mask_mod, None, None, 300, 300).tiles)
    assert mh.create_block_mask is create_block_mask and mh.BlockMask is BlockMask


def test_flex_attentions_block_mask_on_the_cpu_agrees() -> None:
    """torch's own create_block_mask runs on the CPU without compiling: its non-empty tiles
    (to_dense) and its full tiles are ours, Sq == Sk (both alignments agree), ragged edges."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    ids = torch.tensor([0] * 100 + [1] * 150 + [2] * 50)

    def mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (q_idx >= kv_idx) & (ids[q_idx] == ids[kv_idx])
    theirs = flex.create_block_mask(mod, None, None, 300, 300, device="cpu", BLOCK_SIZE=64)
    ours = BlockMask.from_mask_mod(mod, None, None, 300, 300, 64)
    assert torch.equal(theirs.to_dense()[0, 0].bool(), ours.tiles[0, 0] != EMPTY)
    n = 300 // 64  # Flex counts a ragged edge tile as partial (it pads with masked positions)
    full = torch.zeros(5, 5, dtype=torch.bool)
    for row, (count, cols) in enumerate(zip(theirs.full_kv_num_blocks[0, 0], theirs.full_kv_indices[0, 0])):
        full[row, cols[:int(count)].long()] = True
    assert torch.equal(full[:n, :n], (ours.tiles[0, 0] == FULL)[:n, :n])


def test_a_mask_mod_must_return_a_bool_tensor_that_broadcasts() -> None:
    with pytest.raises(TypeError, match="mask_mod must return a bool tensor .* got dtype torch.int64"):
        BlockMask.from_mask_mod(lambda b, h, q, k: q - k, None, None, 8, 8, 32)
    with pytest.raises(TypeError, match="mask_mod must return a bool tensor .* got bool"):
        BlockMask.from_mask_mod(lambda b, h, q, k: True, None, None, 8, 8, 32)
    with pytest.raises(ValueError, match=r"mask_mod must return a bool tensor broadcastable to \(B, H, Sq, Sk\)"):
        BlockMask.from_mask_mod(lambda b, h, q, k: torch.ones(3, 5, dtype=torch.bool), None, None, 8, 8, 32)
    with pytest.raises(TypeError, match="mask_mod must be a callable"):
        BlockMask.from_mask_mod("causal", None, None, 8, 8, 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key block .* multiple of 32, got 48"):
        BlockMask.from_mask_mod(causal_mask_mod, None, None, 8, 8, (16, 48))
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        BlockMask.from_dense(torch.ones(1, 1, 4, 4), 32)


# -- attention with a block mask -----------------------------------------------------------------


def qkv(b: int = 2, h: int = 4, hkv: int = 2, sq: int = 70, sk: int = 90, d: int = 32,
        dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, sq, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hkv, sk, d, generator=gen, dtype=dtype)
    return q, k, torch.randn(b, hkv, sk, d, generator=gen, dtype=dtype)


def random_mod(b: int, h: int, sq: int, sk: int) -> tuple[object, torch.Tensor]:
    """A per-batch, per-head random mask_mod with fully masked rows, and its dense (B, H, Sq, Sk) mask."""
    gen = torch.Generator().manual_seed(5)
    table = torch.rand(b, h, sq, sk, generator=gen) < 0.4
    table[:, :, :20] &= torch.arange(sk) < 40  # tiles that are empty, and some that are not
    table[0, 1, 3] = False  # a row with no key
    table[1, :, 60:] = False  # rows with no key, in every head of one batch row

    def mod(bi: torch.Tensor, hi: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return table[bi, hi, q_idx - (sk - sq), kv_idx]
    return mod, table


def able(grad: bool = False) -> list[str]:
    """The registered backends that take a call with a mask (every one that runs here), with
    gradients or not."""
    q, k, v = (t.requires_grad_(grad) for t in qkv())
    return [name for name in registry.available_backends()
            if registry.missing_capability(registry.get_spec(name), q, k, v) is None]


@pytest.mark.parametrize("backend", able())
def test_a_random_mask_mod_through_every_backend_equals_the_float64_reference(backend: str) -> None:
    q, k, v = qkv()
    mod, dense = random_mod(2, 4, 70, 90)
    want = mh.attention(q.double(), k.double(), v.double(), mask=dense, backend="explicit")
    with torch.no_grad():
        got = mh.attention(q, k, v, mask_mod=mod, backend=backend)
        built = mh.attention(q, k, v, block_mask=BlockMask.from_mask_mod(mod, 2, 4, 70, 90, (16, 32)),
                             backend=backend)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    torch.testing.assert_close(built.double(), want, atol=2e-5, rtol=0)
    assert got[0, 1, 3].abs().max() == 0 and got[1, :, 60:].abs().max() == 0  # rows with no key: zeros


@pytest.mark.parametrize("backend", able())
def test_a_block_mask_combines_with_causal_window_and_mask(backend: str) -> None:
    q, k, v = qkv(sq=90)
    ids = torch.tensor([0] * 30 + [1] * 45 + [2] * 15)
    keys = torch.rand(2, 1, 1, 90) < 0.8
    want = mh.attention(q.double(), k.double(), v.double(), causal=True, window=20, backend="explicit",
                        mask=keys & (ids[:, None] == ids[None, :]))
    with torch.no_grad():
        got = mh.attention(q, k, v, causal=True, window=20, mask=keys, mask_mod=document_mask_mod(ids),
                           backend=backend)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", able(grad=True))
def test_gradients_with_a_mask_mod_are_the_float64_references_and_zero_on_empty_rows(backend: str) -> None:
    q, k, v = qkv(b=2, h=4, sq=70, sk=90)
    mod, dense = random_mod(2, 4, 70, 90)
    upstream = torch.randn(2, 4, 70, 32)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(mh.attention(*leaves64, mask=dense, backend="explicit"), leaves64, upstream.double())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(mh.attention(*leaves, mask_mod=mod, backend=backend), leaves, upstream)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=0, msg=f"d{name}")
    assert got[0][0, 1, 3].abs().max() == 0 and got[0][1, :, 60:].abs().max() == 0  # dq of rows with no key


@pytest.mark.parametrize("backend", able())
def test_a_mask_mod_is_evaluated_at_cache_positions_when_decoding(backend: str) -> None:
    """Sq new queries after Sk - Sq cached keys: q_idx is each query's cache position, so the
    last rows of the full self-attention are what a decoding step with the same mask_mod gives."""
    q, k, v = qkv(b=1, h=4, sq=50, sk=50)
    ids = torch.tensor([0] * 20 + [1] * 30)
    mod = and_masks(causal_mask_mod, document_mask_mod(ids))
    with torch.no_grad():
        full = mh.attention(q, k, v, mask_mod=mod, backend=backend)
        step = mh.attention(q[:, :, -3:], k, v, mask_mod=mod, backend=backend)
    torch.testing.assert_close(step, full[:, :, -3:], atol=1e-5, rtol=0)


def test_a_backend_declaring_block_mask_receives_the_tiles_the_others_a_dense_mask(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, dict[str, object]] = {}

    def spy(name: str):
        def run(q, k, v, **kwargs):
            seen[name] = kwargs
            return torch.zeros_like(q), None, None
        return run
    monkeypatch.setitem(registry._SPECS, "tiles", registry.BackendSpec("tiles", spy("tiles"), block_mask=True))
    monkeypatch.setitem(registry._SPECS, "dense", registry.BackendSpec("dense", spy("dense")))
    q, k, v = qkv()
    block = BlockMask.from_mask_mod(causal_mask_mod, None, None, 70, 90)
    keys = torch.rand(2, 1, 1, 90) < 0.5
    for name in ("tiles", "dense"):
        mh.attention(q, k, v, mask=keys, block_mask=block, backend=name)
    assert seen["tiles"]["features"].block_mask is block and seen["tiles"]["mask"] is not None
    assert seen["dense"]["features"].block_mask is None
    assert torch.equal(seen["dense"]["mask"], keys & block.dense())


@pytest.mark.skipif(not mh.native.available(), reason="no C++ compiler: the native kernels are not built")
@pytest.mark.parametrize("grad", [False, True])
def test_auto_gives_a_native_path_the_tiles(monkeypatch: pytest.MonkeyPatch, grad: bool) -> None:
    """A call large enough for a native rule: the kernel receives the block mask itself (not its
    dense form), forward and with gradients, and the result is the float64 reference's."""
    q, k, v = qkv(b=1, h=4, hkv=2, sq=1024, sk=1024, d=32)
    block = BlockMask.from_mask_mod(and_masks(causal_mask_mod, sliding_window_mask_mod(200)), None, None, 1024, 1024)
    received = []
    real = mh.native.native_backend

    def spy(*args, **kwargs):
        received.append((kwargs["features"].block_mask, kwargs["mask"]))
        return real(*args, **kwargs)
    monkeypatch.setattr(mh.native, "native_backend", spy)
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    path = mh.backends.auto.auto_path(*leaves)
    assert path.startswith("native"), path
    out = mh.attention(*leaves, block_mask=block)
    assert len(received) == 1 and received[0][0] is block and received[0][1] is None
    want = mh.attention(q.double(), k.double(), v.double(), mask=block.dense(), backend="explicit")
    torch.testing.assert_close(out.detach().double(), want, atol=2e-5, rtol=0)


def test_a_block_mask_for_other_sizes_is_refused_naming_it() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"block_mask must be built for \(B, H, Sq, Sk\) = \(2, 4, 70, 90\)"):
        mh.attention(q, k, v, block_mask=BlockMask.from_mask_mod(causal_mask_mod, None, None, 70, 91))
    with pytest.raises(ValueError, match=r"block_mask must be built for .* got \(3, 1, 70, 90\)"):
        mh.attention(q, k, v, block_mask=BlockMask.from_mask_mod(causal_mask_mod, 3, None, 70, 90))
    with pytest.raises(TypeError, match="block_mask must be a multihead.BlockMask, got Tensor"):
        mh.attention(q, k, v, block_mask=torch.ones(1, 1, 70, 90, dtype=torch.bool))  # type: ignore[arg-type]
    mh.attention(q, k, v, block_mask=BlockMask.from_mask_mod(causal_mask_mod, 2, 4, 70, 90))  # B, H: fine
