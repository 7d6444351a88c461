"""The torch-only kernels (:mod:`multihead.backends.blocked`) agree with the float64 reference.

Block boundaries are where blocked kernels go wrong, so block sizes are shrunk (patched)
to a few rows and keys and the shapes are drawn around them: Sq and Sk of 1, primes,
block size ± 1, causal (also Sq ≠ Sk, bottom-right), windows, GQA/MQA, boolean masks
with fully masked rows, key ranges split into chunks merged by log-sum-exp.

Accuracy criterion (as in test_properties): versus the float64 ground truth, float32
errors are at most 2× those of the naive ``"explicit"`` backend in float32, plus a few
ulps of the output's scale; float64 runs agree to ``ATOL64``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import ATOL64, MASK_KINDS, core_mask, reference_core
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.backends import blocked, gemm
from multihead.linear import linear, linears

SCALE = float(os.environ.get("MULTIHEAD_PROPERTY_EXAMPLES", "1"))
PROFILE = settings(max_examples=max(1, int(120 * SCALE)), deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33]


@contextlib.contextmanager
def blocks(rows: int, key_chunk: int, key_align: int = 1) -> Iterator[None]:
    """Shrink the kernel's blocks so that small shapes cross many block boundaries."""
    with mock.patch.object(blocked, "_MIN_ROWS", rows), mock.patch.object(blocked, "_MAX_ROWS", rows), \
            mock.patch.object(blocked, "_KEY_CHUNK", key_chunk), mock.patch.object(blocked, "_KEY_ALIGN", key_align):
        yield


@st.composite
def problems(draw: st.DrawFn) -> dict:
    """q, k, v and masking for one call, with a mask that can empty whole rows."""
    b = draw(st.sampled_from([1, 2]))
    hkv = draw(st.sampled_from([1, 2, 3]))
    g = draw(st.sampled_from([1, 2, 4]))  # g = H: MQA when hkv = 1
    sq = draw(st.sampled_from(SIZES))
    sk = draw(st.sampled_from([sq, sq] + SIZES))
    d = draw(st.sampled_from([4, 8]))
    dv = draw(st.sampled_from([d, 3]))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([None, None, 1, 2, 5]))
    mask_kind = draw(st.sampled_from(MASK_KINDS))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    h = hkv * g

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    # q as the module makes it: a (B, S, H, D) buffer seen as (B, H, S, D).
    q = randn(b, sq, h, d).transpose(1, 2) if draw(st.booleans()) else randn(b, h, sq, d)
    k, v = randn(b, hkv, sk, d), randn(b, hkv, sk, dv)
    mask = core_mask(mask_kind, b, h, sq, sk, gen)
    return {"q": q, "k": k, "v": v, "causal": causal, "window": window, "mask": mask,
            "scale": draw(st.sampled_from([None, 0.3]))}


def _ref(p: dict) -> np.ndarray:
    return reference_core(p["q"], p["k"], p["v"], causal=p["causal"], mask=p["mask"], window=p["window"],
                          scale=p["scale"])[0]


def _scale(p: dict) -> float:
    return p["scale"] or p["q"].shape[-1] ** -0.5


@PROFILE
@given(problems(), st.sampled_from([1, 3, 4, 5, 8]), st.sampled_from([2, 3, 7, 8192]), st.sampled_from([1, 2, 4, 128]))
def test_blocked_matches_reference_float64_across_block_boundaries(p: dict, rows: int, key_chunk: int,
                                                                   key_align: int) -> None:
    with blocks(rows, key_chunk, key_align):
        out = blocked.blocked_attention(p["q"], p["k"], p["v"], scale=_scale(p), causal=p["causal"],
                                        window=p["window"], mask=p["mask"])
    assert out.shape == p["q"].shape[:3] + p["v"].shape[-1:]
    np.testing.assert_allclose(out.numpy(), _ref(p), atol=ATOL64, rtol=0)


@PROFILE
@given(problems())
def test_decode_path_matches_reference_float64(p: dict) -> None:
    out = blocked.decode_attention(p["q"], p["k"], p["v"], scale=_scale(p), causal=p["causal"],
                                   window=p["window"], mask=p["mask"])
    np.testing.assert_allclose(out.numpy(), _ref(p), atol=ATOL64, rtol=0)


def _float32_criterion(ours: torch.Tensor, naive: torch.Tensor, ref: np.ndarray) -> None:
    """Our float32 error ≤ 2 × the naive float32 error + 8 ulps of the output's scale."""
    err = np.abs(ours.double().numpy() - ref).max(initial=0.0)
    naive_err = np.abs(naive.double().numpy() - ref).max(initial=0.0)
    floor = 8 * 2.0**-23 * max(1.0, np.abs(ref).max(initial=0.0))
    assert err <= 2 * naive_err + floor, (err, naive_err)


@PROFILE
@given(problems(), st.sampled_from([3, 8, 64]), st.sampled_from([5, 8192]), st.sampled_from([2, 128]))
def test_blocked_float32_on_onednn_within_accuracy_criterion(p: dict, rows: int, key_chunk: int,
                                                            key_align: int) -> None:
    q, k, v = (p[n].float() for n in "qkv")
    kw = dict(causal=p["causal"], window=p["window"], mask=p["mask"])
    with blocks(rows, key_chunk, key_align):
        ours = blocked.blocked_attention(q, k, v, scale=_scale(p), **kw)
    naive = mh.attention(q, k, v, scale=p["scale"], backend="explicit", **kw)
    _float32_criterion(ours, naive, _ref(p))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_computed_in_float32(dtype: torch.dtype) -> None:
    q, k, v = (torch.randn(1, 4, 37, 16) for _ in range(3))
    out = blocked.blocked_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=0.25, causal=True)
    assert out.dtype == dtype
    ref = mh.attention(q.double(), k.double(), v.double(), causal=True, backend="explicit")
    torch.testing.assert_close(out.double(), ref, atol=4 * torch.finfo(dtype).eps, rtol=0)


def test_mm_nt_is_x_times_w_transposed() -> None:
    x, w = torch.randn(33, 16), torch.randn(65, 16)
    torch.testing.assert_close(gemm.mm_nt(x, w), x @ w.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gemm.mm_nt(x.double(), w.double()), x.double() @ w.double().T)


@pytest.mark.parametrize("backend", ["blocked", "auto"])
@pytest.mark.parametrize("sq", [1, 70])
def test_fully_masked_rows_give_zeros_not_nan(backend: str, sq: int) -> None:
    q, k, v = torch.randn(1, 2, sq, 8), torch.randn(1, 2, 50, 8), torch.randn(1, 2, 50, 8)
    mask = torch.ones(1, 1, sq, 50, dtype=torch.bool)
    mask[..., 0, :] = False  # the first query may see nothing
    out = mh.attention(q, k, v, mask=mask, backend=backend)
    assert torch.isfinite(out).all()
    assert (out[:, :, 0] == 0).all()


def test_causal_with_more_queries_than_keys_zeroes_the_early_queries() -> None:
    # Bottom-right alignment: with Sq=6, Sk=4 queries 0 and 1 sit before every key.
    q, k, v = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    with blocks(4, 8192):
        out = blocked.blocked_attention(q, k, v, scale=0.3, causal=True)
    assert (out[0, 0, :2] == 0).all()
    ref = mh.attention(q.double(), k.double(), v.double(), causal=True, scale=0.3, backend="explicit")
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)


def test_default_backend_is_auto() -> None:
    assert mh.functional.DEFAULT_BACKEND == "auto"
    assert {"auto", "blocked"} <= set(mh.backends.available_backends())


def test_auto_returns_weights_through_explicit() -> None:
    q = torch.randn(1, 2, 5, 4)
    out, w = mh.attention(q, q, q, return_weights=True, backend="auto")
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 5))


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 3)])
def test_blocked_refuses_gradients_by_name(causal: bool, window: int | None) -> None:
    q = torch.randn(1, 4, 6, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match=r"backend 'blocked' cannot do gradients"):
        mh.attention(q, q, q, causal=causal, window=window, backend="blocked")


@pytest.mark.parametrize("backend", ["auto", "explicit", "sdpa"])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 3)])
def test_gradients_flow_through_the_differentiable_backends(backend: str, causal: bool, window: int | None) -> None:
    q = torch.randn(1, 4, 6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return mh.attention(q, k, v, causal=causal, window=window, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_float32_gradients_of_the_default_path_match_the_naive_ones() -> None:
    # q strided along D (as RoPE's output can be): the flash backward needs unit stride there.
    q = torch.randn(1, 150, 16, 4).permute(0, 3, 1, 2).requires_grad_()
    k, v = (torch.randn(1, 2, 150, 16, requires_grad=True) for _ in range(2))
    gy = torch.randn(1, 4, 150, 16)
    ours = torch.autograd.grad(mh.attention(q, k, v, causal=True), (q, k, v), gy)
    naive = torch.autograd.grad(mh.attention(q, k, v, causal=True, backend="explicit"), (q, k, v), gy)
    for a, b in zip(ours, naive):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_no_grad_inputs_that_require_grad_use_the_fast_path() -> None:
    q = torch.randn(1, 2, 40, 8, requires_grad=True)
    with torch.no_grad():
        out = mh.attention(q, q, q, causal=True, backend="blocked")
    assert not out.requires_grad
    assert out.stride(1) == 8  # the kernel's (B, Sq, H, Dv) buffer, not SDPA's output


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's peak-RSS reset")
def test_default_path_never_materialises_a_sequence_by_sequence_matrix() -> None:
    s = 8192  # S×S float32 would be 256 MiB; q, k, v and out together are 2 MiB
    q, k, v = (torch.randn(1, 1, s, 16) for _ in range(3))
    mh.attention(q[:, :, :64], k[:, :, :64], v[:, :, :64])  # load the kernels first
    base = _status_bytes("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current RSS
    mh.attention(q, k, v)
    mh.attention(q, k, v, causal=True)
    assert _status_bytes("VmHWM:") - base < 64 * 2**20


@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_f_linear_in_value_and_gradients(bias: bool) -> None:
    x = torch.randn(2, 5, 12, requires_grad=True)
    w = torch.randn(7, 12, requires_grad=True)
    b = torch.randn(7, requires_grad=True) if bias else None
    gy = torch.randn(2, 5, 7)
    ours = linear(x, w, b)
    grads = torch.autograd.grad(ours, [t for t in (x, w, b) if t is not None], gy)
    ref = torch.nn.functional.linear(x, w, b)
    ref_grads = torch.autograd.grad(ref, [t for t in (x, w, b) if t is not None], gy)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w, b), ref, atol=1e-5, rtol=1e-5)


def test_linears_of_one_input_match_f_linear_and_transpose_it_once() -> None:
    """Several layers of one x (q, k, v) are one autograd node: the same values and gradients as
    F.linear per layer (x's summed over the layers; a frozen weight and a missing bias get
    none), with x transposed for the weight gradients once, not once per layer."""
    x = torch.randn(3, 7, 16, requires_grad=True)  # N = 21 rows
    layers = [(torch.randn(n, 16, requires_grad=True), torch.randn(n, requires_grad=True) if n != 12 else None)
              for n in (24, 12, 20)]
    layers[2][0].requires_grad_(False)  # frozen
    leaves = [t for t in (x, *(t for layer in layers for t in layer)) if t is not None and t.requires_grad]
    gys = [torch.randn(3, 7, w.shape[0]) for w, _ in layers]
    ours = linears(x, layers)
    refs = [torch.nn.functional.linear(x, w, b) for w, b in layers]
    for got, want in zip(torch.autograd.grad(ours, leaves, gys), torch.autograd.grad(refs, leaves, gys)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if gemm.onednn_available():  # the oneDNN path transposes its operands into contiguous copies
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            torch.autograd.backward(linears(x, layers), gys)
        copies = [e.input_shapes[0] for e in prof.events() if e.name == "aten::copy_"]
        assert copies.count([16, 21]) == 1, copies  # xᵀ (in, N): once for both trained weights


@pytest.mark.parametrize("sq, sk", [(511, 511), (513, 513), (1025, 1025), (200, 1100)])
@pytest.mark.parametrize("causal", [False, True])
def test_blocked_at_real_block_sizes_meets_the_accuracy_criterion(sq: int, sk: int, causal: bool) -> None:
    """Default block sizes, key padding to 128 and chunk merges at realistic lengths."""
    torch.random.default_generator.manual_seed(0)
    q, k, v = torch.randn(1, 4, sq, 64), torch.randn(1, 2, sk, 64), torch.randn(1, 2, sk, 64)
    truth = mh.attention(q.double(), k.double(), v.double(), causal=causal, backend="explicit")
    got = mh.attention(q, k, v, causal=causal, backend="blocked")
    naive = mh.attention(q, k, v, causal=causal, backend="explicit")  # plain float32 softmax(QKᵀ)V
    err, naive_err = (got.double() - truth).abs().max().item(), (naive.double() - truth).abs().max().item()
    assert err <= 2 * naive_err + 1e-6, (err, naive_err)


def _gemm_ops(fn: Callable[[], object]) -> set[str]:
    """The GEMM operators ``fn`` runs (profiled)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name in ("aten::addmm", "aten::mm", "mkldnn::_linear_pointwise")}


@pytest.mark.parametrize("rows, width", [(24, 384), (256, 256), (113, 384), (114, 384), (64, 768)])
def test_small_gemms_without_autograd_run_on_f_linear(rows: int, width: int) -> None:
    """Without autograd a GEMM of at most SMALL_GEMM multiply-adds (2^24: 113 rows at 384 wide) takes
    F.linear (oneDNN's op costs a fixed ~25 µs a call more); larger ones oneDNN's, when it is there;
    the values are F.linear's."""
    torch.random.default_generator.manual_seed(0)
    x, w, b = torch.randn(rows, width), torch.randn(width, width), torch.randn(width)
    small = rows * width * width <= mh.linear.SMALL_GEMM
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b),
                                   atol=1e-4, rtol=1e-5)
        used = _gemm_ops(lambda: linear(x, w, b))
    if small or not gemm.onednn_available():
        assert used == {"aten::addmm"}, used
    else:
        assert used == {"mkldnn::_linear_pointwise"}, used
