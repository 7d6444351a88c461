"""The compiled kernel (:mod:`multihead.backends.native`) against the float64 reference.

Its tiles: 12 query rows × 32 keys for q·kᵀ, 6 rows × 16·k value columns for p·v,
chunks of 512 keys merged by an online softmax, work items of ``query_tile`` query
positions (patched small here). Shapes are drawn around those edges: Sq and Sk of 1,
11-13, 31-33, 47-49, primes; head dims of 1, 7, 33 and value dims off the 16-grid
(a scalar tail); causal with Sq ≠ Sk (bottom-right), windows, GQA/MQA, masks with
fully masked rows, broadcast and per-head masks, transposed (strided) inputs.

Accuracy criterion (flash-attention's): versus the float64 ground truth, the kernel's
float32 error is at most 2× that of the naive ``"explicit"`` backend in float32, plus
8 ulps of the output's scale.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import MASK_KINDS, core_mask, reference_core, reference_layer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead import native

SCALE = float(os.environ.get("MULTIHEAD_PROPERTY_EXAMPLES", "1"))
PROFILE = settings(max_examples=max(1, int(300 * SCALE)), deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SIZES = [1, 2, 5, 11, 12, 13, 31, 32, 33, 47, 48, 49, 61]


def test_the_kernel_builds_on_this_machine() -> None:
    """CI machines have g++: the fast path must really be there, not silently skipped."""
    if os.environ.get("MULTIHEAD_NATIVE") == "0":
        assert not native.available() and "MULTIHEAD_NATIVE=0" in native.status()
    else:
        assert native.available(), native.status()
        assert native.status().startswith("ready")
        avx512 = "avx512f" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
        assert native.vector_bits() == 512 if avx512 else native.vector_bits() in (128, 256)


@st.composite
def problems(draw: st.DrawFn) -> dict:
    b = draw(st.sampled_from([1, 2]))
    hkv = draw(st.sampled_from([1, 2, 3]))
    g = draw(st.sampled_from([1, 2, 4]))
    h = hkv * g
    sq = draw(st.sampled_from(SIZES))
    sk = draw(st.sampled_from([sq, sq] + SIZES))
    d = draw(st.sampled_from([1, 7, 16, 33, 64]))
    dv = draw(st.sampled_from([d, 8, 16, 24, 48, 80]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    strided = draw(st.booleans())  # as the module makes them: (B, S, H, D) buffers seen as (B, H, S, D)
    q = randn(b, sq, h, d).transpose(1, 2) if strided else randn(b, h, sq, d)
    k = randn(b, sk, hkv, d).transpose(1, 2) if strided else randn(b, hkv, sk, d)
    v = randn(b, sk, hkv, dv).transpose(1, 2) if strided else randn(b, hkv, sk, dv)
    mask = core_mask(draw(st.sampled_from(MASK_KINDS)), b, h, sq, sk, gen)
    return {"q": q, "k": k, "v": v, "causal": draw(st.booleans()), "mask": mask,
            "window": draw(st.sampled_from([None, None, 1, 2, 13, 40])),
            "scale": draw(st.sampled_from([None, 0.3])), "tile": draw(st.sampled_from([1, 5, 12, 48]))}


def _criterion(p: dict, ours: torch.Tensor) -> None:
    """Our float32 error ≤ 2 × the naive float32 error + 8 ulps of the output's scale."""
    kw = dict(causal=p["causal"], window=p["window"], mask=p["mask"], scale=p["scale"])
    ref = reference_core(p["q"], p["k"], p["v"], **kw)[0]
    naive = mh.attention(*(p[n].float() for n in "qkv"), backend="explicit", **kw)
    assert ours.shape == naive.shape and ours.dtype == torch.float32
    err = np.abs(ours.double().numpy() - ref).max(initial=0.0)
    naive_err = np.abs(naive.double().numpy() - ref).max(initial=0.0)
    floor = 8 * 2.0**-23 * max(1.0, np.abs(ref).max(initial=0.0))
    assert err <= 2 * naive_err + floor, (err, naive_err)


@PROFILE
@given(problems(), st.sampled_from([native.attention_f32, native.decode_f32]))
def test_native_meets_the_accuracy_criterion_across_tile_edges(p: dict, kernel) -> None:
    """Both loops: the FlashAttention one (tiles, packed keys) and the decoding one
    (dot products along D, keys in place), on every shape, not only the ones "auto"
    sends to each."""
    q, k, v = (p[n].float() for n in "qkv")
    with mock.patch.object(native.attention, "QUERY_TILE", p["tile"]):
        ours = kernel(q, k, v, scale=p["scale"] or q.shape[-1] ** -0.5, causal=p["causal"], window=p["window"],
                      mask=p["mask"])
    _criterion(p, ours)


@pytest.mark.parametrize("b, hkv, g", [(1, 1, 8), (1, 2, 4), (2, 1, 1), (3, 4, 2)])
@pytest.mark.parametrize("sq, sk", [(1, 1100), (3, 1500), (1, 2048), (2, 600), (1, 2600)])
@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 700)])
def test_decode_splits_long_caches_across_threads(b: int, hkv: int, g: int, sq: int, sk: int, causal: bool,
                                                  window: int | None) -> None:
    """Chunks of 2048 keys; with fewer K/V heads than threads the keys are split and merged by log-sum-exp
    (flash-decoding); splits that see no key (windows) must weigh nothing."""
    gen = torch.Generator().manual_seed(sk + sq)
    q = torch.randn(b, hkv * g, sq, 64, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, sk, 64, generator=gen, dtype=torch.float64) * 2 for _ in range(2))
    mask = torch.rand(b, 1, 1, sk, generator=gen) < 0.9
    p = {"q": q, "k": k, "v": v, "causal": causal, "window": window, "mask": mask, "scale": None}
    _criterion(p, native.decode_f32(q.float(), k.float(), v.float(), scale=0.125, causal=causal, window=window,
                                    mask=mask))


@pytest.mark.parametrize("g, sq, sk", [(1, 24, 24), (1, 8, 8), (2, 4, 9), (1, 17, 128), (4, 8, 129), (1, 32, 61),
                                       (8, 1, 100)])
@pytest.mark.parametrize("mask_kind", ["key padding", "per row", "none"])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, 3)])
def test_decode_loop_with_rows_in_lanes_at_short_lengths(g: int, sq: int, sk: int, mask_kind: str, causal: bool,
                                                         window: int | None) -> None:
    """The decoding loop's few-key path (rows in the vector lanes, up to 128 keys: an encoder's short
    sentences, the bundled model's (3, 12, 24, 32)) in the module's (B, S, H, D) layout, around its lane
    and key edges (half a lane block, 17 rows, 128 and 129 keys), with key padding that leaves a row
    of the batch no key, per-row masks, causal and a window: within the criterion."""
    gen = torch.Generator().manual_seed(g * 1000 + sq * 10 + sk)
    b, hkv, d, dv = 3, 2, 32, 40

    def heads(s: int, n: int, width: int) -> torch.Tensor:  # (B, S, n·width) seen as (B, n, S, width)
        return (torch.randn(b, s, n, width, generator=gen, dtype=torch.float64) * 2).transpose(1, 2)

    q, k, v = heads(sq, hkv * g, d), heads(sk, hkv, d), heads(sk, hkv, dv)
    mask = None
    if mask_kind == "key padding":
        mask = torch.ones(b, 1, 1, sk, dtype=torch.bool)
        mask[1, ..., sk // 2:] = False
        mask[2] = False  # no key at all: zeros
    elif mask_kind == "per row":
        mask = torch.rand(b, hkv * g, sq, sk, generator=gen) < 0.7
    p = {"q": q, "k": k, "v": v, "causal": causal, "window": window, "mask": mask, "scale": None}
    kw = dict(scale=d ** -0.5, causal=causal, window=window, mask=mask)
    ours = native.decode_f32(q.float(), k.float(), v.float(), **kw)
    _criterion(p, ours)
    if mask_kind == "key padding":
        assert (ours[2] == 0).all()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("k_in", [1, 16, 37, 300])
def test_few_row_linear_matches_float64(m: int, k_in: int) -> None:
    """Several layers in one call (rows split across threads over all of them), row
    counts off the 4-row grid, an input width with a tail, with and without bias."""
    gen = torch.Generator().manual_seed(m * k_in)
    x = torch.randn(m, k_in, generator=gen)
    layers = [(torch.randn(n, k_in, generator=gen), torch.randn(n, generator=gen) if n % 2 else None)
              for n in (7, 1, 64, 5)]
    outs = native.linear_few_rows(x, layers)
    for (w, b), out in zip(layers, outs):
        want = x.double() @ w.double().T + (0 if b is None else b.double())
        naive = (x @ w.T + (0 if b is None else b)).double()
        err, naive_err = (out.double() - want).abs().max(), (naive - want).abs().max()
        assert out.shape == (m, w.shape[0]) and err <= 2 * naive_err + 8 * 2.0**-23 * want.abs().max(), (err, naive_err)


def test_few_row_linear_outputs_ignore_the_default_dtype_and_device() -> None:
    """The outputs the kernel writes are float32 CPU tensors whatever ``torch.set_default_dtype``
    and ``torch.set_default_device`` say (a float64 buffer would be filled with float32 bits, a
    meta one has no memory), and a bad layer is named."""
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")
    try:
        (out,) = native.linear_few_rows(x, [(w, None)])
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(before)
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    torch.testing.assert_close(out, x @ w.T, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match=r"layers\[1\]\[1\] must be a contiguous float32"):
        native.linear_few_rows(x, [(w, None), (w, torch.zeros(8, dtype=torch.float64))])
    with pytest.raises(ValueError, match=r"layers\[0\] weight must be \(N, 16\), got \[8, 15\]"):
        native.linear_few_rows(x, [(w[:, :15].contiguous(), None)])


def test_linear_uses_the_few_row_kernel_only_without_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = native.linear_few_rows
    monkeypatch.setattr(native, "linear_few_rows", lambda x, layers: calls.append(len(layers)) or real(x, layers))
    layer = mh.MultiHeadAttention(64, 4)
    x = torch.randn(1, 1, 64)
    y = layer(x)  # autograd: the differentiable oneDNN path
    assert calls == [] and y.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(layer(x), y.detach(), atol=1e-6, rtol=1e-6)
        layer(torch.randn(1, native.MAX_STEP_ROWS + 1, 64))  # 9 rows: oneDNN
    assert calls == [3, 1]  # q, k, v in one call, then o_proj


def test_kernels_write_into_cpu_buffers_under_a_default_device() -> None:
    """Inside ``with torch.device("meta")`` (how models are built without memory) the native
    forward, backward and fused decoding step still allocate what they write on the CPU, and
    give the answers they give outside it (a meta buffer has no memory to write into)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 40, 32, generator=gen) for _ in range(3))
    layer = mh.MultiHeadAttention(64, 4, num_kv_heads=2, rope=mh.RoPE(16, max_positions=64), causal=True).eval()
    x, steps = torch.randn(1, 5, 64, generator=gen), torch.randn(3, 1, 1, 64, generator=gen)

    def run() -> list[torch.Tensor]:
        qg = q.clone().requires_grad_()
        out = mh.attention(qg, k, v, causal=True, backend="native")
        out.sum().backward()
        with torch.no_grad():
            cache = layer.new_cache(1, 16, device="cpu")
            layer(x, cache=cache)
            decoded = [layer(s, cache=cache) for s in steps]  # the checked step, then its repeats
        return [out.detach(), qg.grad, *decoded]

    want = run()
    with torch.device("meta"):
        got = run()
    for a, b in zip(got, want):
        assert a.device.type == "cpu"
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("sq, sk", [(511, 511), (513, 513), (200, 1100), (1025, 1025), (3, 1500)])
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, 300), (False, 700)])
def test_native_at_real_lengths_across_key_chunks(sq: int, sk: int, causal: bool, window: int | None) -> None:
    """Chunks of 512 keys merged by the online softmax, at realistic lengths, with GQA."""
    gen = torch.Generator().manual_seed(sq * sk)
    q = torch.randn(1, 4, sq, 64, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, sk, 64, generator=gen, dtype=torch.float64) * 3 for _ in range(2))
    p = {"q": q, "k": k, "v": v, "causal": causal, "window": window, "mask": None, "scale": None}
    _criterion(p, mh.attention(q.float(), k.float(), v.float(), causal=causal, window=window, backend="native"))


def test_rows_with_no_allowed_key_give_zeros_and_others_are_untouched() -> None:
    q, k, v = (torch.randn(2, 3, 40, 32) for _ in range(3))
    mask = torch.rand(2, 3, 40, 40) < 0.5
    mask[0, 1, 7] = False
    mask[1, :, 20:] = False
    out = mh.attention(q, k, v, mask=mask, backend="native")
    assert torch.isfinite(out).all()
    assert (out[0, 1, 7] == 0).all() and (out[1, :, 20:] == 0).all()
    torch.testing.assert_close(out, mh.attention(q, k, v, mask=mask, backend="explicit"), atol=1e-5, rtol=0)


def test_huge_logits_do_not_overflow() -> None:
    q, k, v = torch.randn(1, 2, 70, 16) * 300, torch.randn(1, 2, 70, 16) * 300, torch.randn(1, 2, 70, 16)
    out = mh.attention(q, k, v, causal=True, backend="native")
    want = mh.attention(q.double(), k.double(), v.double(), causal=True, backend="explicit")
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)


def test_nan_inputs_propagate_instead_of_being_hidden() -> None:
    q, k, v = (torch.randn(1, 1, 20, 16) for _ in range(3))
    v[0, 0, 3, 0] = float("nan")
    out = mh.attention(q, k, v, backend="native")
    assert torch.isnan(out[0, 0, :, 0]).all() and torch.isfinite(out[0, 0, :, 1:]).all()


def test_results_do_not_depend_on_the_thread_count() -> None:
    """Each work item is computed whole by one thread: bitwise the same with 1 or 2 threads."""
    q, k, v = torch.randn(2, 8, 300, 64), torch.randn(2, 2, 300, 64), torch.randn(2, 2, 300, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mh.attention(q, k, v, causal=True, backend="native")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, mh.attention(q, k, v, causal=True, backend="native"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(dtype: torch.dtype) -> None:
    q, k, v = (torch.randn(1, 4, 37, 16) for _ in range(3))
    out = mh.attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, backend="native")
    assert out.dtype == dtype
    ref = mh.attention(q.double(), k.double(), v.double(), causal=True, backend="explicit")
    torch.testing.assert_close(out.double(), ref, atol=4 * torch.finfo(dtype).eps, rtol=0)


def test_float64_and_dropout_are_refused_by_name_never_substituted() -> None:
    """The backend a user names runs, or the call is refused naming what it lacks."""
    q, k, v = (torch.randn(1, 2, 30, 16, dtype=torch.float64) for _ in range(3))
    with pytest.raises(ValueError, match=r"backend 'native' cannot do dtype float64.*'blocked'"):
        mh.attention(q, k, v, causal=True, backend="native")
    qg = q.float().requires_grad_()
    with pytest.raises(ValueError, match=r"backend 'native' cannot do dropout.*'sdpa'"):
        mh.attention(qg, k.float(), v.float(), causal=True, dropout_p=0.1, backend="native")
    out = mh.attention(qg, k.float(), v.float(), causal=True, backend="native")  # gradients: the native backward
    assert out.requires_grad
    want = mh.attention(q, k, v, causal=True, backend="explicit")
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_auto_uses_the_native_kernel_for_prefill(amd_cpu) -> None:
    """"auto" names the native loop for a prefill and runs exactly it (bitwise); tiny problems
    take SDPA (its lower fixed cost)."""
    q = torch.randn(1, 12, 320, 32)  # 2^20.2 scores: native with AVX-512 (from 2^14) and AVX2 (from 2^20)
    assert mh.backends.auto.auto_path(q, q, q) == "native"
    want, _ = native.run(q, q, q, scale=32 ** -0.5, causal=True, window=None, mask=None, decode=False)
    assert torch.equal(mh.attention(q, q, q, causal=True), want)
    tiny = q[:, :, :4]
    assert mh.backends.auto.auto_path(tiny, tiny, tiny) == "sdpa"  # 192 scores


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_without_a_compiler_everything_still_works(tmp_path) -> None:
    """No installed build (the machine's own asked for, as on a package installed without a
    compiler) and no compiler (CXX=false): native is unavailable with a reason, announced on
    stderr, never silent; "auto" uses torch paths."""
    code = """
import torch, multihead as mh
from multihead import native
q, k, v = (torch.randn(1, 4, 600, 64) for _ in range(3))
out = mh.attention(q, k, v, causal=True)
want = mh.attention(q.double(), k.double(), v.double(), causal=True, backend="explicit")
assert (out.double() - want).abs().max() < 1e-5
assert not native.available()
try:
    mh.attention(q, k, v, backend="native")
except ValueError as err:
    print("refused:", err)
"""
    done = _python(code, CXX="false", MULTIHEAD_CACHE_DIR=str(tmp_path), MULTIHEAD_NATIVE_ISA="machine")
    assert done.returncode == 0, done.stderr
    assert ("refused: backend 'native' cannot do running here: the native kernel is not available "
            "(compiling the native kernel failed") in done.stdout
    assert "multihead: compiling the native kernels for this machine" in done.stderr
    assert "multihead: compiling the native kernels failed; the torch paths run instead" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


def test_the_machines_build_is_compiled_once_into_the_cache_dir_and_reused(tmp_path, stand_in_cxx) -> None:
    code = "from multihead import native; assert native.build(), native.status(); print(native.status())"
    first = _python(code, MULTIHEAD_CACHE_DIR=str(tmp_path / "cache"), MULTIHEAD_NATIVE_ISA="machine",
                    CXX=stand_in_cxx.cxx)
    assert first.returncode == 0, first.stderr
    built = sorted((tmp_path / "cache").iterdir())  # the kernel and its build record (size, SHA-256)
    assert [p.suffix for p in built] == [".json", ".so"] and str(built[1]) in first.stdout
    mtime = built[1].stat().st_mtime_ns
    assert "compiled in" in first.stderr and stand_in_cxx.builds() == 1  # announced
    again = _python(code, MULTIHEAD_CACHE_DIR=str(tmp_path / "cache"), MULTIHEAD_NATIVE_ISA="machine",
                    CXX=stand_in_cxx.cxx)
    assert again.returncode == 0 and sorted((tmp_path / "cache").iterdir()) == built
    assert built[1].stat().st_mtime_ns == mtime and stand_in_cxx.builds() == 1
    assert "compiling" not in again.stderr  # found, verified, loaded: nothing to announce


def test_disabled_by_environment_variable() -> None:
    done = _python("from multihead import native; print(native.available(), native.status())", MULTIHEAD_NATIVE="0")
    assert done.stdout.strip() == "False disabled by MULTIHEAD_NATIVE=0"


def test_importing_multihead_builds_nothing(tmp_path) -> None:
    done = _python("import multihead, torch; multihead.attention(*(torch.randn(1, 1, 2, 4),) * 3)",
                   MULTIHEAD_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == []  # tiny problems stay on SDPA: no build was needed



# -- the fused decoding step -------------------------------------------------------------
def _spy_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real, real_run = native.step.decode_step, native.StepPlan.run
    # traced steps call it through the operator multihead::decode_step, whose body calls step.decode_step
    monkeypatch.setattr(native.step, "decode_step",
                        lambda x, *a, **kw: calls.append(x.shape[0]) or real(x, *a, **kw))
    # eager steps call the kernel through their marshalled arguments (decode._eager_step)
    monkeypatch.setattr(native.StepPlan, "run",
                        lambda plan, x, starts=None: calls.append(x.shape[0]) or real_run(plan, x, starts))
    return calls


ROPES = {"none": None, "half": lambda: mh.RoPE(32), "interleaved-partial": lambda: mh.RoPE(32, interleaved=True,
                                                                                           rotary_dim=16)}


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("heads, kv_heads, bias", [(4, 4, True), (8, 2, False), (6, 1, True)])
def test_fused_step_equals_the_float64_reference_with_rows_of_different_lengths(
        rope: str, heads: int, kv_heads: int, bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Right-padded prompts of 3 rows (lengths 600, 37, 1), then 4 fused steps: every
    output row equals the float64 reference layer run on the row's real tokens."""

    steps = _spy_steps(monkeypatch)
    torch.random.default_generator.manual_seed(heads * 10 + kv_heads)
    layer = mh.MultiHeadAttention(32 * heads, heads, num_kv_heads=kv_heads, causal=True, bias=bias,
                                  rope=ROPES[rope]() if ROPES[rope] else None).eval()
    e, lengths, new = layer.embed_dim, [600, 37, 1], 4
    x = torch.randn(3, 600 + new, e)
    key_mask = torch.arange(600)[None, :] < torch.tensor(lengths)[:, None]
    cache = layer.new_cache(3, 700)
    with torch.no_grad():
        layer(x[:, :600], key_mask=key_mask, cache=cache)
        outs = []
        for i in range(new):  # row b's i-th new token is x[b, lengths[b] + i]
            token = torch.stack([x[b, lengths[b] + i] for b in range(3)])[:, None]  # (3, 1, E)
            outs.append(layer(token, cache=cache))
    assert steps == [3] * new
    assert cache.host_lengths() == [n + new for n in lengths] and cache.lengths.tolist() == cache.host_lengths()
    assert (cache.slot_pos >= 0).sum(1).tolist() == cache.host_lengths()
    for b in range(3):
        want = reference_layer(layer, x[b:b + 1, :lengths[b] + new].double())[0][0, -new:]  # (new, E)
        got = torch.cat([o[b] for o in outs]).double().numpy()
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("case", ["ring", "key_mask", "positions", "hook", "rows", "backend", "float64",
                                  "two tokens", "rope table"])  # (a window on a linear cache is fused)
def test_fused_step_is_skipped_where_it_does_not_apply_and_results_agree(case: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each condition outside the fused step takes the step-by-step path, which gives
    the same result as the fused one on the nearest call it does take."""
    steps = _spy_steps(monkeypatch)
    torch.random.default_generator.manual_seed(0)
    b = native.MAX_STEP_ROWS + 1 if case == "rows" else 2
    dtype = torch.float64 if case == "float64" else torch.float32
    layer = mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, window=8 if case == "ring" else None,
                                  rope=mh.RoPE(16, max_positions=20 if case == "rope table" else 4096),
                                  backend="sdpa" if case == "backend" else None, dtype=dtype).eval()
    if case == "hook":
        layer.v_proj.register_forward_hook(lambda m, i, o: o)
    cache = layer.new_cache(b, 64, ring=case == "ring")
    x = torch.randn(b, 30, 64, dtype=dtype)
    kw: dict = {}
    if case == "key_mask":
        kw["key_mask"] = torch.ones(b, 1, dtype=torch.bool)
    if case == "positions":
        kw["positions"] = torch.tensor([29])
    with torch.no_grad():
        layer(x[:, :29], cache=cache)
        step = x[:, 29:] if case != "two tokens" else x[:, 28:]
        if case == "two tokens":
            cache.crop(28)
        got = layer(step, cache=cache, **kw)
        want = layer(x[:, :30], **({} if case != "key_mask" else {}))[:, -step.shape[1]:]
    assert steps == []
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_step_writes_nothing_when_the_call_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = _spy_steps(monkeypatch)
    layer = mh.MultiHeadAttention(64, 4, causal=True, rope=mh.RoPE(16)).eval()
    cache = layer.new_cache(1, 5)
    with torch.no_grad():
        layer(torch.randn(1, 5, 64), cache=cache)
        before = (cache.k.clone(), cache.v.clone(), cache.lengths.clone(), cache.slot_pos.clone())
        with pytest.raises(ValueError, match="cache overflow"):
            layer(torch.randn(1, 1, 64), cache=cache)
    assert steps == [] and cache.host_lengths() == [5]
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.k, cache.v, cache.lengths, cache.slot_pos)))


def _f(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize("call, error, match", [
    (lambda: native.attention_f32(_f(1, 2, 3, 4, dtype=torch.float64), _f(1, 2, 3, 4), _f(1, 2, 3, 4), scale=1.0),
     TypeError, "q must be a float32, bfloat16 or float16 CPU tensor"),
    (lambda: native.attention_f32(_f(1, 2, 3, 4), _f(1, 2, 3, 4).bfloat16(), _f(1, 2, 3, 4), scale=1.0),
     TypeError, "k must be a CPU tensor of q's dtype torch.float32"),
    (lambda: native.decode_f32(_f(1, 2, 3), _f(1, 2, 3, 4), _f(1, 2, 3, 4), scale=1.0), ValueError, "q must have 4"),
    (lambda: native.attention_f32(_f(1, 3, 3, 4), _f(1, 2, 3, 4), _f(1, 2, 3, 4), scale=1.0), ValueError,
     "positive multiple"),
    (lambda: native.attention_f32(_f(1, 2, 3, 4), _f(1, 2, 5, 4), _f(1, 2, 3, 4), scale=1.0), ValueError,
     "k and v must be"),
    (lambda: native.attention_f32(_f(1, 2, 3, 4), _f(1, 2, 3, 5), _f(1, 2, 3, 4), scale=1.0), ValueError,
     "head dim 4"),
    (lambda: native.attention_f32(_f(1, 2, 3, 4), _f(1, 2, 3, 4), _f(1, 2, 3, 4), scale=1.0, mask=_f(3, 3)),
     TypeError, "mask must be a bool"),
    (lambda: native.attention_f32(_f(1, 2, 3, 4), _f(1, 2, 3, 4), _f(1, 2, 3, 4), scale=1.0,
                                  mask=torch.ones(2, 3, dtype=torch.bool)), ValueError, "mask must broadcast"),
    (lambda: native.attention_f32(_f(1, 2, 3, 4), _f(1, 2, 3, 4), _f(1, 2, 3, 4), scale=1.0, window=0),
     ValueError, "window must be in"),
    (lambda: native.linear_few_rows(_f(9, 4), [(_f(3, 4), None)]), ValueError, "1 to 8 rows"),
    (lambda: native.linear_few_rows(_f(1, 4), [(_f(4, 3).t(), None)]), TypeError, "not contiguous"),
    (lambda: native.linear_few_rows(_f(1, 4), [(_f(3, 5), None)]), ValueError, r"weight must be \(N, 4\)"),
    (lambda: native.linear_few_rows(_f(1, 4), [(_f(3, 4), _f(4))]), ValueError, r"bias must be \(3,\)"),
])
def test_the_public_kernel_functions_check_what_they_are_given(call, error, match) -> None:
    """They read raw memory: a wrong tensor must be refused, never read out of bounds."""
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("problem", ["others may write", "cannot be created"])
def test_builds_only_into_a_private_folder(tmp_path, stand_in_cxx, problem: str) -> None:
    """A shared library is loaded from the build folder: one that others may write to
    (or that cannot be made) is passed over for a private one in the temporary folder."""
    if problem == "others may write":
        cache = tmp_path / "shared"
        cache.mkdir()
        cache.chmod(0o777)
    else:
        (tmp_path / "file").write_text("")
        cache = tmp_path / "file" / "cache"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    code = "from multihead import native; assert native.build(), native.status(); print(native.status())"
    done = _python(code, MULTIHEAD_CACHE_DIR=str(cache), TMPDIR=str(tmpdir), MULTIHEAD_NATIVE_ISA="machine",
                   CXX=stand_in_cxx.cxx)
    assert done.returncode == 0 and stand_in_cxx.builds() == 1, done.stderr
    private = tmpdir / f"multihead-{os.getuid()}"
    assert str(private) in done.stdout and (private.stat().st_mode & 0o777) == 0o700
    assert not cache.exists() or list(cache.iterdir()) == []


# on an AVX-512 machine the AVX2 build too (asked at collection: builds the kernels once)
@pytest.mark.parametrize("arch", ["native"] + (["haswell"] if native.vector_bits() == 512 else []))
def test_kernels_stay_inside_their_tensors_under_address_sanitizer(tmp_path, arch: str) -> None:
    """tests/native_memcheck.cpp drives every kernel entry point on random shapes with
    tensors allocated at their exact size, built with AddressSanitizer and UBSan: any
    read or write outside a tensor, or undefined behaviour, aborts the run. (An
    off-by-one in the decoding loop's key count is caught: checked by hand.) On an AVX-512
    machine the AVX2 kernels (-march=haswell) are checked too, on 32 random problems against the
    machine's own 64 (the same sources with the other width's tiles; the run takes about 25 s
    per 100 problems under the sanitizers, the backward's among them): a machine otherwise only
    runs its own width's code. (A query pack read past its end with block masks is caught by the
    first 64: checked by hand.)
    The sanitized objects are compiled once per source (:func:`_sanitizer_objects`)."""
    compiler = shlex.split(os.environ.get("CXX") or "g++")
    csrc = Path(native.__file__).parent / "csrc"
    exe = tmp_path / "memcheck"
    flags = ["-std=c++17", "-O1", "-g", f"-march={arch}", "-fopenmp", "-fsanitize=address,undefined",
             "-fno-sanitize-recover=undefined"]
    units = [Path(__file__).parent / "native_memcheck.cpp", csrc / "attention.cpp", csrc / "attention_amx.cpp",
             csrc / "decode.cpp", csrc / "backward.cpp"]
    # The harness itself (its float64 reference loops) is optimised and checked by UBSan only: the
    # sanitizer's runtime still puts redzones around every tensor it allocates, and the kernels'
    # units, built with AddressSanitizer, trap any access outside them (run: 56 s -> 46 s).
    harness = ["-std=c++17", "-O2", "-g", f"-march={arch}", "-fopenmp", "-fsanitize=undefined",
               "-fno-sanitize-recover=undefined"]
    commands = [[*compiler, *(harness if i == 0 else flags), f"-I{csrc}", "-c", str(unit)]
                for i, unit in enumerate(units)]
    objects = _sanitizer_objects(commands, units, csrc, tmp_path)
    build = subprocess.run([*compiler, *flags, *map(str, objects), "-o", str(exe)], capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    cases = int((64 if arch == "native" else 32) * SCALE)  # the other width: the same code, other tiles
    done = subprocess.run([str(exe), str(cases)], capture_output=True, text=True, timeout=600,
                          env={**env, "ASAN_OPTIONS": "detect_leaks=1", "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0 and done.stdout.startswith("ok"), (done.stdout + done.stderr)[-3000:]


def _sanitizer_objects(commands: list[list[str]], units: list[Path], csrc: Path, tmp_path: Path) -> list[Path]:
    """The object file of each unit compiled by its command (``-o`` added), one compiler per unit at
    once (decode.cpp alone takes most of the time). Kept between runs in the user's cache, named by
    a hash of the commands, the compiler's version and every source and header they read, so a
    machine compiles a given source once (as ccache would); any change compiles afresh."""
    import hashlib

    version = subprocess.run([commands[0][0], "--version"], capture_output=True, text=True).stdout
    places = {f"-I{csrc}": "-I<csrc>", **{str(unit): unit.name for unit in units}}  # a clone elsewhere: the same key
    digest = hashlib.sha256(version.encode() + repr([[places.get(a, a) for a in cmd] for cmd in commands]).encode())
    for path in sorted([*csrc.glob("*.h"), *csrc.glob("*.cpp"), *units]):
        digest.update(path.name.encode() + path.read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multihead-tests" / \
        f"memcheck-{digest.hexdigest()[:24]}"
    objects = [cache / f"{unit.stem}.o" for unit in units]
    if all(o.is_file() for o in objects):
        return objects
    built = [tmp_path / f"{unit.stem}.o" for unit in units]
    jobs = [subprocess.Popen([*cmd, "-o", str(obj)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for cmd, obj in zip(commands, built)]
    for job in jobs:
        log, _ = job.communicate(timeout=300)
        assert job.returncode == 0, log[-3000:]
    try:  # kept for the next run; a cache that cannot be written costs only the next compile
        staging = cache.with_name(cache.name + f".{os.getpid()}")
        staging.mkdir(parents=True, exist_ok=True)
        for obj in built:
            (staging / obj.name).write_bytes(obj.read_bytes())
        os.replace(staging, cache)
    except OSError:
        pass
    return built


def test_flush_to_zero_stays_inside_the_kernels() -> None:
    """The kernels flush subnormal results to zero while they run (a subnormal o takes microcode
    assists on every later multiply-add), and restore each thread's floating-point state: after
    a call, torch in this thread still makes subnormal numbers; and ALiBi's distant keys (whose
    probabilities reach 2^-126) give the float64 reference's output."""
    if not native.available():
        pytest.skip(native.status())
    tiny = torch.tensor([2.0 ** -126])
    q, k, v = (torch.randn(1, 4, 300, 64) for _ in range(3))
    slopes = torch.tensor([0.5, 1.0, 2.0, 4.0])
    out = mh.attention(q, k, v, causal=True, backend="native", alibi_slopes=slopes)
    mh.attention(q[:, :, :1], k, v, causal=True, backend="native")  # the decoding loop too
    assert (tiny / 4).item() == 2.0 ** -128  # subnormal, not flushed: this thread's state is back
    want = mh.attention(q.double(), k.double(), v.double(), causal=True, backend="explicit",
                        alibi_slopes=slopes.double())
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-5)
