"""The native FlashAttention loop with soft-capping, ALiBi, sinks and packed sequences.

Notation: B batch, H query heads, Hkv key/value heads, S tokens (Sq queries, Sk keys), D head dim.

Accuracy criterion (tests/backends/test_native_accuracy.py): the native float32 error vs
float64 ("explicit" in float64, itself held to a from-the-definitions oracle in
test_logit_features.py) at most 2× the naive float32 one ("explicit" in float32), plus 8
ulps for tiny problems. Packed sequences run as structure: a NaN-poison test shows no key
outside a query's sequence is read (sequences aligned to the kernel's tiles), and the
kernel's panel counter equals the panels the query tiles' sequences cover (any lengths).
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from multihead import native
from multihead.backends.eager import explicit_attention
from multihead.logits import Features

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler: " + native.status())

F64 = torch.float64
ULPS = 8 * 2.0**-23
LENGTHS = [37, 0, 64, 5, 0, 90]  # unequal and empty sequences: S = 196
CU = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])


def _qkv(b: int = 2, h: int = 6, hkv: int = 2, sq: int = 196, sk: int = 196, d: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(b, h, sq, d, generator=g, dtype=F64)
    k, v = (torch.randn(b, hkv, sk, d, generator=g, dtype=F64) for _ in range(2))
    return q, k, v


def _features(h: int, names: tuple[str, ...], seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    kw: dict = {}
    if "softcap" in names:
        kw["softcap"] = 4.0
    if "alibi" in names:
        kw["alibi_slopes"] = mh.logits.alibi_slopes(h).double() * 2  # H = 6: not a power of two
    if "sinks" in names:
        kw["sinks"] = torch.randn(h, generator=g, dtype=F64)
    if "packed" in names:
        kw["cu_seqlens"] = CU
    return kw


def _f32(kw: dict) -> dict:
    return {n: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}


STRUCTURES = {"full": {}, "causal": {"causal": True}, "causal-window": {"causal": True, "window": 17},
              "window": {"window": 23}, "key-mask": {"mask": "keys"}}
FEATURES = [("softcap",), ("alibi",), ("sinks",), ("packed",), ("softcap", "alibi", "sinks", "packed")]


def _structure(name: str, b: int, sk: int) -> dict:
    kw = dict(STRUCTURES[name])
    if kw.get("mask") == "keys":  # key padding: each row's last keys are padding
        kw["mask"] = (torch.arange(sk)[None, :] < torch.tensor([sk - 30, sk - 3])[:b, None])[:, None, None]
    return kw


@pytest.mark.parametrize("names", FEATURES, ids=["+".join(n) for n in FEATURES])
@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_native_within_twice_naive_float32_of_float64(names: tuple[str, ...], structure: str) -> None:
    q, k, v = _qkv()
    kw = {**_features(q.shape[1], names), **_structure(structure, q.shape[0], k.shape[2])}
    truth = mh.attention(q, k, v, backend="explicit", **kw)
    with torch.no_grad():
        ours = mh.attention(q.float(), k.float(), v.float(), backend="native", **_f32(kw))
        naive = mh.attention(q.float(), k.float(), v.float(), backend="explicit", **_f32(kw))
    err = (ours.double() - truth).abs().max().item()
    naive_err = (naive.double() - truth).abs().max().item()
    assert err <= 2 * naive_err + ULPS, (err, naive_err)


@pytest.mark.parametrize("decode_rows", [1, 3])
def test_few_rows_and_gqa_take_the_flash_loop_with_features(decode_rows: int) -> None:
    """Few query rows (decoding shapes, Sq < Sk, bottom-right ALiBi distances) with every logit feature."""
    q, k, v = _qkv(b=1, h=8, hkv=2, sq=decode_rows, sk=300)
    kw = {**_features(8, ("softcap", "alibi", "sinks")), "causal": True}
    truth = mh.attention(q, k, v, backend="explicit", **kw)
    with torch.no_grad():
        ours = mh.attention(q.float(), k.float(), v.float(), backend="native", **_f32(kw))
        naive = mh.attention(q.float(), k.float(), v.float(), backend="explicit", **_f32(kw))
    assert (ours.double() - truth).abs().max() <= 2 * (naive.double() - truth).abs().max() + ULPS


def test_softcap_tanh_is_accurate_over_the_whole_range() -> None:
    """Scores spread from tiny to far past the cap: the vectorised tanh's two branches and its clamp."""
    q, k, v = _qkv(b=1, h=2, hkv=1, sq=64, sk=64)
    q = q * torch.logspace(-4, 2, 64, dtype=F64)[None, None, :, None]  # rows from |s| ~ 1e-4 to ~1e3
    for cap in (0.3, 5.0, 50.0):
        truth = mh.attention(q, k, v, backend="explicit", softcap=cap)
        with torch.no_grad():
            ours = mh.attention(q.float(), k.float(), v.float(), backend="native", softcap=cap)
            naive = mh.attention(q.float(), k.float(), v.float(), backend="explicit", softcap=cap)
        assert (ours.double() - truth).abs().max() <= 2 * (naive.double() - truth).abs().max() + ULPS, cap


def test_softcap_keeps_a_nan_score_nan_and_caps_huge_ones() -> None:
    """A NaN key in a row's span poisons that row as in the torch backends (never capped into
    a finite logit); scores far past the cap (the clamped branch) are capped at ±cap."""
    q, k, v = (t.float() for t in _qkv(b=1, h=2, hkv=2, sq=40, sk=40))
    poisoned = k.clone()
    poisoned[0, :, 5] = math.nan
    huge = q * 1e6  # scores ~1e6: tanh = ±1
    with torch.no_grad():
        for qq, kk in ((q, poisoned), (huge, k)):
            ours = mh.attention(qq, kk, v, backend="native", softcap=3.0, causal=True)
            theirs = mh.attention(qq, kk, v, backend="explicit", softcap=3.0, causal=True)
            assert torch.equal(ours.isnan(), theirs.isnan())
            torch.testing.assert_close(ours.nan_to_num(), theirs.nan_to_num(), rtol=0, atol=1e-5)
    assert ours.isfinite().all()


def test_rows_with_no_visible_key_give_zeros_never_nan() -> None:
    q, k, v = (t.float() for t in _qkv(b=1, h=6, hkv=2, sq=40, sk=40))
    mask = torch.ones(40, 40, dtype=torch.bool)
    mask[3] = False  # row 3 sees nothing
    mask[10:20, :] = False  # rows 10..19 see nothing either
    kw = {**_f32(_features(6, ("softcap", "alibi", "sinks"))), "cu_seqlens": torch.tensor([0, 12, 12, 40])}
    with torch.no_grad():
        out, lse = mh.attention(q, k, v, backend="native", mask=mask, causal=True, return_lse=True,
                                **{n: t for n, t in kw.items() if n != "sinks"})
        with_sinks = mh.attention(q, k, v, backend="native", mask=mask, causal=True, **kw)
    for o in (out, with_sinks):
        assert not o.isnan().any()
        assert torch.equal(o[:, :, 3], torch.zeros_like(o[:, :, 3]))
        assert torch.equal(o[:, :, 10:20], torch.zeros_like(o[:, :, 10:20]))
    assert torch.isneginf(lse[:, :, 3]).all() and torch.isneginf(lse[:, :, 10:20]).all()
    assert torch.isfinite(lse[:, :, 4:10]).all()


@pytest.mark.parametrize("names", [("softcap", "alibi", "packed"), ("softcap", "alibi", "sinks", "packed")],
                         ids=["without-sinks", "with-sinks"])
def test_lse_equals_the_torch_backends(names: tuple[str, ...]) -> None:
    """Of the scaled, capped, biased, masked scores; with sinks the sink is left out of it, as
    in 'explicit' (which mh.attention does not let return it: native.attention_f32 does)."""
    q, k, v = _qkv()
    kw = _features(q.shape[1], names)
    cu = kw.pop("cu_seqlens")
    mask = mh.masks.segment_mask(cu, q.shape[2])
    _, _, want = explicit_attention(q, k, v, mask=mask, causal=True, window=None, scale=0.2, dropout_p=0.0,
                                    return_weights=False, return_lse=True, features=Features(**kw))
    out, lse = native.attention_f32(q.float(), k.float(), v.float(), scale=0.2, causal=True, return_lse=True,
                                    cu_seqlens=cu, **_f32(kw))
    assert want is not None
    torch.testing.assert_close(lse.double(), want, rtol=0, atol=2e-5)
    if "sinks" not in names:
        with torch.no_grad():
            _, lse2 = mh.attention(q.float(), k.float(), v.float(), scale=0.2, causal=True, return_lse=True,
                                   cu_seqlens=cu, backend="native", **_f32(kw))
        assert torch.equal(lse, lse2)


@pytest.mark.parametrize("causal", [True, False])
def test_no_key_outside_a_query_s_sequence_is_read(causal: bool) -> None:
    """Sequences aligned to the kernel's tiles (multiples of 96: query tile 48, panels of 16
    or 32 keys, rows of 6 or 12): poisoning every key and value outside a sequence with NaN
    changes none of that sequence's outputs, bit for bit."""
    lengths = [96, 192, 0, 96]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v = (t.float() for t in _qkv(b=1, h=4, hkv=2, sq=384, sk=384))
    kw = dict(causal=causal, cu_seqlens=cu, **_f32(_features(4, ("softcap", "alibi", "sinks"))))
    with torch.no_grad():
        clean = mh.attention(q, k, v, backend="native", **kw)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            if a == b:
                continue
            kp, vp = torch.full_like(k, math.nan), torch.full_like(v, math.nan)
            kp[:, :, a:b], vp[:, :, a:b] = k[:, :, a:b], v[:, :, a:b]
            poisoned = mh.attention(q, kp, vp, backend="native", **kw)
            assert torch.equal(poisoned[:, :, a:b], clean[:, :, a:b]), (a, b)


def _expected_panels(b: int, hkv: int, g: int, s: int, bounds: list[tuple[int, int]], causal: bool,
                     window: int | None) -> int:
    """The key panels of the query tiles' row blocks (MR rows, fewer where the tile or the rows'
    sequence ends): the hull of their rows' spans (structure and own sequence), in panels of NR
    keys; nothing else."""
    wide = native.vector_bits() == 512
    mr, nr, qt = (12, 32, native.attention.query_tile()) if wide else (6, 16, native.attention.query_tile())

    def span(i: int) -> tuple[int, int]:
        lo, hi = bounds[i]
        if causal:
            hi = min(hi, i + 1)
        if window:
            lo = max(lo, i - window + 1)
            hi = hi if causal else min(hi, i + window)
        return lo, max(hi, lo)

    per_kv = 0
    for p0 in range(0, s, qt):
        rows = min(qt, s - p0)
        r0 = 0
        while r0 < rows:
            n = min(mr, rows - r0, bounds[p0 + r0][1] - (p0 + r0))
            lo, hi = span(p0 + r0)[0], span(p0 + r0 + n - 1)[1]
            per_kv += (-(-hi // nr) - lo // nr) if hi > lo else 0
            r0 += n
    return b * hkv * g * per_kv


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 20)])
def test_packed_sequences_compute_only_the_panels_of_their_tiles(causal: bool, window: int | None) -> None:
    """The kernel's own count of q·kᵀ panels: exactly those the row blocks' sequences cover
    (no padding FLOPs), and far fewer than the dense problem's."""
    q, k, v = (t.float() for t in _qkv(b=2, h=4, hkv=2, sq=196, sk=196))
    bounds = [(a, b) for a, b in zip(CU[:-1].tolist(), CU[1:].tolist()) for _ in range(b - a)]
    got = native.key_panels(q, k, v, scale=0.1, causal=causal, window=window, cu_seqlens=CU)
    assert got == _expected_panels(2, 2, 2, 196, bounds, causal, window)
    dense = native.key_panels(q, k, v, scale=0.1, causal=causal, window=window)
    assert dense == _expected_panels(2, 2, 2, 196, [(0, 196)] * 196, causal, window)
    if window is None:
        assert got < 0.7 * dense


def test_per_row_packing_of_the_module_equals_each_sequence_alone() -> None:
    """(B, N+1) cu_seqlens, one packing per batch row (what the module's packed path passes)."""
    q, k, v = (t.float() for t in _qkv(b=2, h=4, hkv=2, sq=50, sk=50))
    cu = torch.tensor([[0, 20, 50, 50], [0, 7, 8, 50]])
    with torch.no_grad():
        packed = mh.attention(q, k, v, causal=True, backend="native", cu_seqlens=cu)
        for row in range(2):
            for a, b in zip(cu[row, :-1].tolist(), cu[row, 1:].tolist()):
                if a < b:
                    alone = mh.attention(q[row:row + 1, :, a:b], k[row:row + 1, :, a:b], v[row:row + 1, :, a:b],
                                         causal=True, backend="native")
                    torch.testing.assert_close(packed[row:row + 1, :, a:b], alone, rtol=0, atol=2e-6)


def test_module_packed_path_gives_the_native_backend_structure_not_a_dense_mask(monkeypatch) -> None:
    """B = 1 packing as Hugging Face does it (positions restarting): the native backend gets
    cu_seqlens, no S×S mask is built, and the output equals the dense-mask path's."""
    layer = mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, rope=mh.RoPE(16, 10000.0),
                                  backend="native").eval()
    x = torch.randn(1, 30, 64)
    positions = torch.tensor([list(range(12)) + list(range(5)) + list(range(13))])
    with torch.no_grad():
        layer.backend = "explicit"
        want = layer(x, positions=positions, packed=True)
        layer.backend = "native"

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError("a dense segment mask was built")

        monkeypatch.setattr(mh.masks, "segments_from_positions", refuse)
        monkeypatch.setattr(mh.masks, "segment_mask", refuse)
        monkeypatch.setattr("multihead.backends.registry.segment_mask", refuse)  # the one dense fallback
        got = layer(x, positions=positions, packed=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


SHORT = [11, 0, 30, 1, 17]  # S = 59: at most 128 keys, the rows-in-lanes path with AVX-512 and AVX2
SHORT_CU = torch.tensor([0, *torch.tensor(SHORT).cumsum(0).tolist()])


def _flash_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
    """The FlashAttention loop's own result: asking for its panel count keeps the call there."""
    counter = torch.zeros(1, dtype=torch.int64)
    mask = kw.pop("mask", None)
    out = native.attention.run_kernel("mh_attention_f32", q, k, v, q.shape[-1] ** -0.5, bool(kw.pop("causal", False)),
                                      kw.pop("window", None), mask, False, native.attention.query_tile(),
                                      logits=native.attention.Logits(cu_seqlens=SHORT_CU, panels=counter))
    assert not kw and int(counter) > 0
    return out


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_short_packed_sequences_in_the_lanes_within_twice_naive(structure: str) -> None:
    """Packed sequences of at most 128 keys take the rows-in-lanes path (AVX-512 and AVX2; the
    FlashAttention loop on the builds without AVX): each query's keys are limited to its own
    sequence lane by lane. Within the accuracy criterion of float64, and a different summation
    than the FlashAttention loop's on those builds (so the lanes path is what ran)."""
    q, k, v = _qkv(b=2, h=6, hkv=2, sq=59, sk=59)
    kw = {"cu_seqlens": SHORT_CU, **_structure(structure, 2, 59)}
    truth = mh.attention(q, k, v, backend="explicit", **kw)
    q32, k32, v32 = q.float(), k.float(), v.float()
    with torch.no_grad():
        ours = mh.attention(q32, k32, v32, backend="native", **kw)
        naive = mh.attention(q32, k32, v32, backend="explicit", **kw)
        flash = _flash_loop(q32, k32, v32, **{n: t for n, t in kw.items() if n != "cu_seqlens"})
    naive_err = (naive.double() - truth).abs().max().item()
    for got in (ours, flash):
        assert (got.double() - truth).abs().max().item() <= 2 * naive_err + ULPS
    assert torch.equal(ours, flash) == (native.vector_bits() < 256)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths", [[32, 0, 48, 16], [7, 100, 0, 61, 1, 31]], ids=["lanes", "flash-loop"])
def test_packed_sequences_read_no_other_sequence(causal: bool, lengths: list[int]) -> None:
    """Poisoning every key and value outside a packed sequence with NaN changes none of its
    outputs, bit for bit: sequences aligned to the lanes' blocks of 16 rows (S = 96 ≤ 128 keys:
    the rows-in-lanes path with AVX-512 and AVX2), and sequences at odd
    offsets over 200 keys (the FlashAttention loop on every build: its groups of rows end where a
    sequence does, and p · v reads only their own keys)."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    s = sum(lengths)
    q, k, v = (t.float() for t in _qkv(b=1, h=4, hkv=2, sq=s, sk=s))
    with torch.no_grad():
        clean = mh.attention(q, k, v, causal=causal, cu_seqlens=cu, backend="native")
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            if a == b:
                continue
            kp, vp = torch.full_like(k, math.nan), torch.full_like(v, math.nan)
            kp[:, :, a:b], vp[:, :, a:b] = k[:, :, a:b], v[:, :, a:b]
            poisoned = mh.attention(q, kp, vp, causal=causal, cu_seqlens=cu, backend="native")
            assert torch.equal(poisoned[:, :, a:b], clean[:, :, a:b]), (a, b)


# -- the operator, the registry and "auto" ---------------------------------------------------------


@pytest.mark.parametrize("names", FEATURES, ids=["+".join(n) for n in FEATURES])
def test_opcheck_attention_with_features(names: tuple[str, ...]) -> None:
    q, k, v = (t.float() for t in _qkv(b=2, h=6, hkv=2, sq=196, sk=196, d=16))
    kw = _f32(_features(6, names))
    args = (q, k, v, None, 0.25, True, None, False, kw.get("softcap"), kw.get("alibi_slopes"), kw.get("sinks"),
            kw.get("cu_seqlens"))
    torch.library.opcheck(torch.ops.multihead.attention.default, args)


def test_gradients_with_a_feature_are_refused_by_native_naming_its_backward() -> None:
    q, k, v = (t.float() for t in _qkv(b=1, h=6, hkv=2, sq=20, sk=20))
    q.requires_grad_()
    for name, value in (("soft-capping", {"softcap": 3.0}), ("ALiBi", {"alibi_slopes": torch.ones(6)}),
                        ("sinks", {"sinks": torch.zeros(6)})):
        with pytest.raises(ValueError, match=f"native.*gradients with .*{name}.*native backward"):
            mh.attention(q, k, v, backend="native", **value)
    with pytest.raises(ValueError, match="native backward"):  # learned sinks alone need gradients too
        mh.attention(q.detach(), k, v, backend="native", sinks=torch.zeros(6, requires_grad=True))
    with pytest.raises(ValueError, match="native backward does not apply softcap"):  # the operator itself
        torch.ops.multihead.attention(q, k, v, None, 0.25, False, None, False, 3.0, None, None, None)


def test_gradients_with_packed_sequences_take_the_dense_mask_on_native() -> None:
    """The native backward takes no packing: with gradients it gets the block-diagonal mask."""
    q, k, v = (t.float().requires_grad_() for t in _qkv(b=1, h=4, hkv=2, sq=60, sk=60))
    cu = torch.tensor([0, 25, 25, 60])
    grads = []
    for backend in ("native", "explicit"):
        out = mh.attention(q, k, v, causal=True, cu_seqlens=cu, backend=backend)
        grads.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
