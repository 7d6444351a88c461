"""The native kernels in bfloat16 and float16: half precision in and out, float32 inside.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim,
Dv value head dim, E embed_dim.

The kernels read q, k, v (and the decoding step's weights and cache) in their dtype,
widen them to float32 in registers, accumulate and take the softmax in float32, and
round the output once, to nearest even. Accuracy criterion (the issue's): versus the
float64 ground truth on the same (rounded) inputs, the error is at most 2× that of a
naive implementation in the same dtype. The naive baseline is stated here: torch's ops
in that dtype as written, ``softmax(q kᵀ · scale) v``, every op's output rounded to the
dtype (torch's CPU matmul and softmax accumulate in float32 inside, so this is the
kindest naive baseline). The ``"explicit"`` backend is not naive here: it computes
half precision in float32 and rounds once, like the kernels, and the kernels are held
to its error too (within 10%).
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import decode
from multihead.backends import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler: " + native.status())

HALF = [torch.bfloat16, torch.float16]


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor) -> torch.Tensor:
    """The naive baseline in q's dtype: scores, softmax and weighted sum as written."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)  # fully masked rows: 0
    return probs @ v


def _allowed(sq: int, sk: int, causal: bool, window: int | None, mask: torch.Tensor | None) -> torch.Tensor:
    """The dense (…, Sq, Sk) rule: bottom-right causal, window, the caller's mask."""
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= j > i - window
        if not causal:
            ok &= j < i + window
    return ok if mask is None else ok & mask


def _errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = out.double() - ref
    return diff.abs().max().item(), diff.square().mean().sqrt().item()


# (B, H, Hkv, Sq, Sk, D, Dv, causal, window, mask kind)
CASES = {
    "full": (2, 4, 4, 70, 70, 64, 64, False, None, None),
    "causal-gqa": (1, 8, 2, 100, 130, 64, 64, True, None, None),
    "window": (1, 4, 2, 90, 90, 32, 32, True, 17, None),
    "window-bidirectional": (1, 4, 1, 60, 75, 16, 16, False, 9, None),
    "key-padding": (2, 4, 2, 50, 83, 64, 48, False, None, "keys"),
    "odd-head-dims": (1, 6, 3, 37, 41, 13, 20, True, None, None),  # D, Dv not multiples of 8: scalar tails
    "decode-rows": (2, 8, 2, 1, 600, 64, 64, True, None, None),  # few rows: the decoding loop
}


def _problem(name: str, dtype: torch.dtype) -> tuple:
    b, h, hkv, sq, sk, d, dv, causal, window, kind = CASES[name]
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    q, k = torch.randn(b, h, sq, d, generator=gen), torch.randn(b, hkv, sk, d, generator=gen)
    v = torch.randn(b, hkv, sk, dv, generator=gen)
    mask = None
    if kind == "keys":
        mask = torch.ones(b, 1, 1, sk, dtype=torch.bool)
        mask[1, ..., sk // 2:] = False
    return (q.to(dtype), k.to(dtype), v.to(dtype)), causal, window, mask


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(CASES))
def test_half_precision_within_the_criterion_and_in_its_dtype(name: str, dtype: torch.dtype, amx: bool) -> None:
    """amx: the bfloat16 loop on AMX tiles where the CPU has them (p rounded to bfloat16 there, so
    held to 1.5× the one-rounding error: test_native_amx.py), else the vector loop (1.1×)."""
    (q, k, v), causal, window, mask = _problem(name, dtype)
    scale = q.shape[-1] ** -0.5
    with native.amx_enabled(amx):
        out, lse = native.run(q, k, v, scale=scale, causal=causal, window=window, mask=mask, return_lse=True)
        tiles = dtype == torch.bfloat16 and q.shape[2] > 1 and native.amx()  # (one row: the decoding loop)
    assert out.dtype == dtype and lse is not None and lse.dtype == torch.float32
    ref, ref_lse = mh.attention(q.double(), k.double(), v.double(), scale=scale, causal=causal, window=window,
                                mask=mask, backend="explicit", return_lse=True)
    naive = _naive(q, k, v, scale, _allowed(q.shape[2], k.shape[2], causal, window, mask))
    explicit = mh.attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask, backend="explicit")
    ours, theirs, one_rounding = _errors(out, ref), _errors(naive, ref), _errors(explicit, ref)
    assert ours[0] <= 2 * theirs[0] and ours[1] <= 2 * theirs[1], (ours, theirs)
    assert ours[1] <= (1.5 if tiles else 1.1) * one_rounding[1] + 1e-7, (ours, one_rounding)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("decode_loop", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_fully_masked_rows_give_zeros_and_minus_infinity_not_nan(dtype: torch.dtype, decode_loop: bool) -> None:
    sq = 1 if decode_loop else 30
    q, k, v = torch.randn(1, 2, sq, 16, dtype=dtype), torch.randn(1, 2, 40, 16, dtype=dtype), torch.randn(
        1, 2, 40, 16, dtype=dtype)
    mask = torch.rand(1, 2, sq, 40) < 0.5
    mask[0, 1] = False  # head 1: no key at all
    out, lse = torch.ops.multihead.attention(q, k, v, mask, 0.25, False, None, decode_loop)
    assert not out.isnan().any() and (out[0, 1] == 0).all()
    assert (lse[0, 1] == float("-inf")).all() and lse[0, 0].isfinite().all()


@pytest.mark.parametrize("dtype", HALF)
def test_the_output_is_rounded_to_nearest_even_once(dtype: torch.dtype) -> None:
    """q = 0: every key weighs the same, so with two keys out = (v0 + v1) / 2, exact in
    float32 (v0, v1 of one binade): the kernel's rounding must be torch's, bit for bit,
    ties (half of these sums) included; Dv = 20 runs both the vector and the scalar loads."""
    gen = torch.Generator().manual_seed(0)
    v = (torch.rand(1, 1, 2, 20 * 512, generator=gen) + 1).to(dtype)  # [1, 2]: one binade
    v = v.view(1, 1, 2, 512, 20).permute(0, 3, 2, 1, 4).reshape(1, 512, 2, 20).contiguous()  # (B, H=512, Sk, Dv)
    q, k = torch.zeros(1, 512, 1, 8, dtype=dtype), torch.randn(1, 512, 2, 8).to(dtype)
    want = ((v[:, :, 0].float() + v[:, :, 1].float()) * 0.5).to(dtype)[:, :, None]
    for decode_loop in (False, True):
        out, _ = torch.ops.multihead.attention(q, k, v, None, 1.0, False, None, decode_loop)
        assert torch.equal(out, want)


@pytest.mark.parametrize("kind, dtype", [(0, torch.bfloat16), (1, torch.float16)])
def test_the_scalar_conversions_equal_torchs(kind: int, dtype: torch.dtype) -> None:
    """The fallback of builds without AVX2 / F16C: every 16-bit pattern widened, and float32
    values of every kind (normal, subnormal in the target, overflowing, ties, inf, NaN) rounded."""
    lib = native.loader.require()
    halves = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16)
    wide = torch.empty(1 << 16, dtype=torch.float32)
    assert lib.mh_convert_scalar(kind, 0, halves.data_ptr(), wide.data_ptr(), 1 << 16) == 0
    want = halves.view(dtype).float()
    assert torch.equal(wide.isnan(), want.isnan()) and torch.equal(wide[~want.isnan()], want[~want.isnan()])
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(-(1 << 31), 1 << 31, (1 << 18,), generator=gen, dtype=torch.int64).to(torch.int32)
    # Random patterns, then values near the target's range and ties between its neighbours.
    near = torch.randn(1 << 16, generator=gen) * torch.tensor(2.0) ** torch.randint(-30, 20, (1 << 16,),
                                                                                   generator=gen).float()
    ties = (want[:-1].double() + want[1:].double()).div(2).float()
    floats = torch.cat([bits.view(torch.float32), near, ties[ties.isfinite()], want,
                        torch.tensor([0.0, -0.0, 65504.0, 65520.0, 1e-8, -1e-8, 3e38, float("inf"), float("nan")])])
    got = torch.empty(floats.numel(), dtype=torch.int16)
    assert lib.mh_convert_scalar(kind, 1, floats.data_ptr(), got.data_ptr(), floats.numel()) == 0
    got_f, want_f = got.view(dtype).float(), floats.to(dtype).float()
    assert torch.equal(got_f.isnan(), want_f.isnan())
    finite = ~want_f.isnan()
    assert torch.equal(got.view(dtype)[finite].view(torch.int16), floats.to(dtype)[finite].view(torch.int16))


@pytest.mark.parametrize("dtype", HALF)
def test_results_do_not_depend_on_the_thread_count(dtype: torch.dtype) -> None:
    q, k, v = (torch.randn(1, 4, 300, 64).to(dtype) for _ in range(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [native.run(q, k, v, scale=0.125, causal=True, window=None, mask=None, decode=d)[0] for d in (0, 1)]
    finally:
        torch.set_num_threads(threads)
    for d in (0, 1):
        assert torch.equal(one[d], native.run(q, k, v, scale=0.125, causal=True, window=None, mask=None,
                                              decode=bool(d))[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("masked, causal, window, decode_loop", [(False, False, None, False),
                                                                 (True, True, None, False), (True, False, 3, True)])
def test_opcheck_attention_half(dtype: torch.dtype, masked: bool, causal: bool, window: int | None,
                                decode_loop: bool) -> None:
    q, k, v = torch.randn(1, 4, 20, 16, dtype=dtype), torch.randn(1, 2, 33, 16, dtype=dtype), torch.randn(
        1, 2, 33, 24, dtype=dtype)
    mask = torch.rand(1, 1, 20, 33) < 0.7 if masked else None
    torch.library.opcheck(torch.ops.multihead.attention.default, (q, k, v, mask, 0.25, causal, window, decode_loop))


def _layers(dtype: torch.dtype) -> tuple[mh.MultiHeadAttention, mh.MultiHeadAttention]:
    """A GQA layer with RoPE in ``dtype`` and its float64 twin with the same (rounded) weights."""
    torch.random.default_generator.manual_seed(0)
    layer = mh.MultiHeadAttention(128, 8, num_kv_heads=2, causal=True, rope=mh.RoPE(16)).eval().to(dtype)
    twin = mh.MultiHeadAttention(128, 8, num_kv_heads=2, causal=True, rope=mh.RoPE(16)).eval().double()
    twin.load_state_dict({name: t.double() for name, t in layer.state_dict().items()})
    return layer, twin


@pytest.mark.parametrize("dtype", HALF)
def test_opcheck_decode_step_half(dtype: torch.dtype) -> None:
    layer, _ = _layers(dtype)
    cache = layer.new_cache(2, 16)
    assert cache.k.dtype == dtype
    projs = [layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj]
    args = (torch.randn(2, 128, dtype=dtype), [p.weight.detach() for p in projs], [p.bias.detach() for p in projs],
            layer.rope.cos, layer.rope.sin, 16, False, cache.k, cache.v, cache.lengths, 8, 2, 16, 0.25)
    torch.library.opcheck(torch.ops.multihead.decode_step.default, args)


@pytest.mark.parametrize("window", [3, 40], ids=["window 3 of 7 keys", "window 40 over 16 slots"])
@pytest.mark.parametrize("dtype", HALF)
def test_opcheck_decode_step_half_with_a_window(dtype: torch.dtype, window: int) -> None:
    """The window as the traced fused step passes it (a keyword), on a half cache whose rows hold
    7 and 2 keys: a window shorter than the first row, and one longer than the whole cache."""
    layer, _ = _layers(dtype)
    cache = layer.new_cache(2, 16)
    with torch.no_grad():
        layer(torch.randn(2, 7, 128, dtype=dtype), cache=cache)
    cache.crop([7, 2])
    projs = [layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj]
    args = (torch.randn(2, 128, dtype=dtype), [p.weight.detach() for p in projs], [p.bias.detach() for p in projs],
            layer.rope.cos, layer.rope.sin, 16, False, cache.k, cache.v, cache.lengths, 8, 2, 16, 0.25)
    torch.library.opcheck(torch.ops.multihead.decode_step.default, args, {"window": window})


@pytest.mark.parametrize("dtype", HALF)
def test_half_cache_decoding_fused_equals_unfused_prefill_and_float64(dtype: torch.dtype) -> None:
    """A bf16 / f16 layer and cache: the fused step (half weights and cache read in place),
    the unfused step and the prefill of the same tokens agree, and each is within the
    criterion of the float64 layer (the naive error: the unfused step's, op by op in the dtype)."""
    layer, twin = _layers(dtype)
    x = torch.randn(2, 41, 128).to(dtype)
    fused_cache, plain_cache, cache64 = layer.new_cache(2, 64), layer.new_cache(2, 64), twin.new_cache(2, 64)
    assert fused_cache.k.dtype == dtype
    with torch.no_grad():
        for layer_, cache, x_ in ((layer, fused_cache, x), (layer, plain_cache, x), (twin, cache64, x.double())):
            layer_(x_[:, :40], cache=cache)
        assert decode.why_not_fused(layer, x[:, 40:], fused_cache) is None
        fused = layer(x[:, 40:], cache=fused_cache)
        plain = layer(x[:, 40:], cache=plain_cache, positions=torch.tensor([40]))  # positions: not fused
        prefill = layer(x)[:, 40:]
        want = twin(x[:, 40:].double(), cache=cache64)
    assert fused.dtype == plain.dtype == dtype
    naive = _errors(plain, want)
    for got in (fused, prefill):
        ours = _errors(got, want)
        assert ours[0] <= 2 * naive[0] and ours[1] <= 2 * naive[1], (ours, naive)
    ulp = torch.finfo(dtype).eps * want.abs().max().item()
    torch.testing.assert_close(fused.double(), prefill.double(), atol=2 * ulp, rtol=0)
    k_ulp = torch.finfo(dtype).eps * plain_cache.k.abs().max().item()
    torch.testing.assert_close(fused_cache.k.double(), plain_cache.k.double(), atol=2 * k_ulp, rtol=0)
    assert fused_cache.host_lengths() == plain_cache.host_lengths() == [41, 41]


@pytest.mark.parametrize("dtype", HALF)
def test_native_decoding_attention_over_a_half_cache(dtype: torch.dtype) -> None:
    """The decoding loop over a long bf16 / f16 cache (key splits merged) vs float64."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 32, 1, 64, generator=gen).to(dtype)
    k, v = (torch.randn(1, 8, 4096, 64, generator=gen).to(dtype) for _ in range(2))
    out, _ = native.run(q, k, v, scale=0.125, causal=True, window=None, mask=None, decode=True)
    assert out.dtype == dtype
    ref = mh.attention(q.double(), k.double(), v.double(), scale=0.125, causal=True, backend="explicit")
    naive = _naive(q, k, v, 0.125, _allowed(1, 4096, True, None, None))
    ours, theirs = _errors(out, ref), _errors(naive, ref)
    assert ours[0] <= 2 * theirs[0] and ours[1] <= 2 * theirs[1], (ours, theirs)


# (H, Hkv, Sq, Sk, D, Dv, causal, window, key mask): the decoding loop's register blocks in half
# precision (G·Sq rows in blocks of 4, then 1-3 left; keys two at a time, then one; blocks of 64
# keys; chunks of 2048), head dims multiples of 16 (the blocked path) and one not (the other).
DECODE_GRID = {
    "1-row-1-key": (4, 4, 1, 1, 16, 16, True, None, False),
    "2-rows-odd-keys-dv": (8, 4, 1, 67, 32, 48, True, None, False),
    "3-rows-mask": (6, 2, 1, 129, 64, 64, False, None, True),
    "4-rows-window": (8, 2, 1, 1001, 128, 128, True, 100, False),
    "5-rows-mask": (10, 2, 1, 300, 80, 80, True, None, True),
    "8-rows-chunks": (16, 2, 1, 4099, 64, 64, True, None, False),
    "3-queries": (4, 1, 3, 77, 64, 64, True, None, False),
    "4-rows-d-24": (8, 2, 1, 200, 24, 24, True, None, False),
}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", list(DECODE_GRID))
def test_the_half_decoding_loop_at_every_block_edge(name: str, dtype: torch.dtype) -> None:
    """Each case through the decoding loop (2 batch rows, the second's keys half masked where a
    mask is asked for): within the criterion of float64 and of the float32-inside path's error."""
    h, hkv, sq, sk, d, dv, causal, window, masked = DECODE_GRID[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    q = torch.randn(2, h, sq, d, generator=gen).to(dtype)
    k = torch.randn(2, hkv, sk, d, generator=gen).to(dtype)
    v = torch.randn(2, hkv, sk, dv, generator=gen).to(dtype)
    mask = None
    if masked:
        mask = torch.rand(2, 1, 1, sk, generator=gen) > 0.3
        mask[..., 0] = True
    scale = d ** -0.5
    out, lse = native.run(q, k, v, scale=scale, causal=causal, window=window, mask=mask, return_lse=True,
                          decode=True)
    ref, ref_lse = mh.attention(q.double(), k.double(), v.double(), scale=scale, causal=causal, window=window,
                                mask=mask, backend="explicit", return_lse=True)
    naive = _naive(q, k, v, scale, _allowed(sq, sk, causal, window, mask))
    explicit = mh.attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask, backend="explicit")
    ours, theirs, one_rounding = _errors(out, ref), _errors(naive, ref), _errors(explicit, ref)
    assert out.dtype == dtype
    assert ours[0] <= 2 * theirs[0] and ours[1] <= 2 * theirs[1], (ours, theirs)
    assert ours[1] <= 1.1 * one_rounding[1] + 1e-7, (ours, one_rounding)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_the_decoding_step_refuses_mixed_dtypes_by_name() -> None:
    """It reads raw memory of x's dtype: a weight or cache of another dtype is refused."""
    layer, _ = _layers(torch.bfloat16)
    cache = layer.new_cache(1, 8)
    projs = [layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj]
    layers = [(p.weight.detach(), p.bias.detach()) for p in projs]
    kw = dict(num_heads=8, num_kv_heads=2, head_dim=16, rope=(layer.rope.cos, layer.rope.sin, 16, False),
              lengths=cache.lengths, scale=0.25)
    x = torch.randn(1, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"cache_k must have x's dtype torch.bfloat16, got torch.float32"):
        native.decode_step(x, layers, cache_k=cache.k.float(), cache_v=cache.v, **kw)
    with pytest.raises(TypeError, match=r"layers\[3\]\[0\] must have x's dtype"):
        native.decode_step(x, layers[:3] + [(layers[3][0].half(), layers[3][1])], cache_k=cache.k, cache_v=cache.v,
                           **kw)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        native.decode_step(x.double(), layers, cache_k=cache.k, cache_v=cache.v, **kw)
    y = native.decode_step(x, layers, cache_k=cache.k, cache_v=cache.v, **kw)
    assert y.dtype == torch.bfloat16 and y.isfinite().all()


# (E, H, Hkv, rows B): E a multiple of 16 (the AVX2 bf16 GEMV's even/odd widening) with odd
# weight-row counts (Hkv·D = 3: the row loop's tails), and E = 40 (its plain fallback).
GEMV_SHAPES = {"even-odd, odd rows, B=1": (48, 16, 1, 1), "even-odd, B=3": (48, 16, 1, 3),
               "even-odd, B=4, GQA": (96, 6, 2, 4), "fallback E=40, B=2": (40, 5, 1, 2),
               "even-odd, B=7": (48, 16, 1, 7), "even-odd, B=8, GQA": (96, 6, 2, 8)}


@pytest.mark.parametrize("shape", list(GEMV_SHAPES))
def test_half_fused_step_projections_at_every_tail(shape: str) -> None:
    """The bf16 step's projections (widened 16 at a time into even and odd halves against a
    de-interleaved x where E allows, plainly elsewhere) at row tails and 1–8 rows: within the
    criterion of the float64 layer (the naive error: the unfused bf16 step's)."""
    e, h, hkv, b = GEMV_SHAPES[shape]
    torch.random.default_generator.manual_seed(e + b)
    layer = mh.MultiHeadAttention(e, h, num_kv_heads=hkv, causal=True).eval().to(torch.bfloat16)
    twin = mh.MultiHeadAttention(e, h, num_kv_heads=hkv, causal=True).eval().double()
    twin.load_state_dict({name: t.double() for name, t in layer.state_dict().items()})
    x = torch.randn(b, 6, e).to(torch.bfloat16)
    fused_cache, plain_cache, cache64 = layer.new_cache(b, 8), layer.new_cache(b, 8), twin.new_cache(b, 8)
    with torch.no_grad():
        for layer_, cache, x_ in ((layer, fused_cache, x), (layer, plain_cache, x), (twin, cache64, x.double())):
            layer_(x_[:, :5], cache=cache)
        assert decode.why_not_fused(layer, x[:, 5:], fused_cache) is None
        fused = layer(x[:, 5:], cache=fused_cache)
        layer.backend = "sdpa"  # not fused (the layers have no RoPE to take positions)
        assert decode.why_not_fused(layer, x[:, 5:], plain_cache) is not None
        plain = layer(x[:, 5:], cache=plain_cache)
        want = twin(x[:, 5:].double(), cache=cache64)
    ours, naive = _errors(fused, want), _errors(plain, want)
    assert ours[0] <= 2 * naive[0] and ours[1] <= 2 * naive[1], (ours, naive)
