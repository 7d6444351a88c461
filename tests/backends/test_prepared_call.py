"""The prepared plain call: ``mh.attention`` without mask, logit feature, gradient, weights, lse
or dropout reaches the native loop through a call made once per signature
(:func:`multihead.backends.native.ops.prepare`). It must give exactly what the general runner
gives, for any strides, and step aside wherever the operator must be seen.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import functional
from multihead.backends import native
from multihead.backends.native import ops
from conftest import record_ops

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native kernels")

F64 = torch.float64


def _qkv(h: int, hkv: int, sq: int, sk: int, d: int = 32, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, h, sq, d, generator=g).to(dtype)  # (B, H, Sq, D)
    k = torch.randn(2, hkv, sk, d, generator=g).to(dtype)  # (B, Hkv, Sk, D)
    v = torch.randn(2, hkv, sk, d, generator=g).to(dtype)
    return q, k, v


def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto", **flags: object):
    tensors = (q.shape, k.shape, v.shape, q.dtype, q.device)
    return functional._plan_for(backend, tensors, q, k, v, float(flags.get("dropout_p", 0.0)),
                                bool(flags.get("return_weights", False)), bool(flags.get("return_lse", False)))


def _general(q, k, v, causal: bool, window: int | None) -> torch.Tensor:
    """The native runner's general path (its per-call choices), as ``plan.run`` calls it."""
    return ops.run(q, k, v, scale=q.shape[-1] ** -0.5, causal=causal, window=window, mask=None)[0]


CASES = [  # (H, Hkv, Sq, Sk, D): decoding loop (few rows per K/V head) and FlashAttention loop
    (4, 4, 1, 40, 32), (8, 2, 3, 70, 64), (4, 4, 16, 16, 32), (6, 2, 40, 96, 64), (2, 1, 130, 130, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", CASES, ids=[str(c) for c in CASES])
def test_prepared_call_equals_the_general_runner_bitwise(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    h, hkv, sq, sk, d = shape
    q, k, v = _qkv(h, hkv, sq, sk, d, dtype)
    with torch.no_grad():
        for backend in ("auto", "native"):
            plan = _plan(q, k, v, backend)
            native_path = backend == "native" or plan.decision.rule.path.startswith("native")
            assert (plan.fast is not None) is native_path, (backend, plan)  # bfloat16 on AMX: SDPA
            for causal, window in ((False, None), (True, None), (True, 5), (False, 7)):
                for _ in range(2):  # the first call makes the plan, the second runs it
                    got = mh.attention(q, k, v, causal=causal, window=window, backend=backend)
                assert got.dtype == dtype and got.shape == (2, h, sq, d)
                if native_path:
                    assert torch.equal(got, _general(q, k, v, causal, window)), (backend, causal, window)
                ref = mh.attention(q.to(F64), k.to(F64), v.to(F64), causal=causal, window=window,
                                   backend="explicit")
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(got.to(F64), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("layout", ["transposed", "columns", "expanded", "sliced"])
def test_other_strides_of_the_same_signature_are_read_as_given(layout: str) -> None:
    """One signature, calls with other strides in turn: each call's own strides reach the kernel
    (a last dimension with a stride other than 1 takes the general path, which copies it)."""
    q, k, v = _qkv(8, 2, 24, 40)
    with torch.no_grad():
        want = mh.attention(q, k, v, causal=True)
        if layout == "transposed":  # (B, S, H, D) memory, as projections give them
            views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
        elif layout == "columns":  # the last dimension strided
            views = [t.transpose(2, 3).contiguous().transpose(2, 3) for t in (q, k, v)]
        elif layout == "expanded":  # batch of one broadcast to two (stride 0)
            views = [q] + [t[:1].expand_as(t) for t in (k, v)]
            want = mh.attention(q, *(t[:1].expand_as(t).contiguous() for t in (k, v)), causal=True)
        else:  # every other query row of a longer tensor
            views = [torch.cat([q, q], 2)[:, :, ::2]] + [k, v]
            want = mh.attention(views[0].contiguous(), k, v, causal=True)
        for _ in range(3):
            assert torch.equal(mh.attention(*views, causal=True), want)
            assert torch.equal(mh.attention(q, k, v, causal=True),
                               mh.attention(q.contiguous(), k, v, causal=True))


@pytest.mark.parametrize("flag", ["grad", "lse", "weights", "dropout"])
def test_calls_that_ask_for_more_make_no_prepared_call(flag: str) -> None:
    q, k, v = _qkv(4, 4, 40, 40)
    if flag == "grad":
        plan = _plan(q.clone().requires_grad_(), k, v)
    else:
        kw = {"lse": {"return_lse": True}, "weights": {"return_weights": True}, "dropout": {"dropout_p": 0.1}}
        with torch.no_grad():
            plan = _plan(q, k, v, "native" if flag == "lse" else "auto", **kw[flag])
    assert plan.fast is None


def test_a_mask_or_check_finite_takes_the_general_path() -> None:
    q, k, v = _qkv(4, 4, 40, 40)
    keys = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    keys[1, ..., 30:] = False
    with torch.no_grad():
        mh.attention(q, k, v)  # the plan, prepared
        masked = mh.attention(q, k, v, mask=keys)
        torch.testing.assert_close(masked[1:], mh.attention(q[1:], k[1:, :, :30], v[1:, :, :30]))
        bad = q.clone()
        bad[0, 0, 0, 0] = float("nan")
        with pytest.raises(ValueError, match="q"):
            mh.attention(bad, k, v, check_finite=True)


def test_a_dispatch_mode_sees_the_operator() -> None:
    """Where the operator must be seen (a tracer, a fake-tensor mode, the profiler), the prepared
    call steps aside and the call runs ``multihead::attention``."""
    q, k, v = _qkv(4, 4, 40, 40)
    with torch.no_grad():
        mh.attention(q, k, v)
        assert _plan(q, k, v).fast is not None
        with record_ops() as seen:
            out = mh.attention(q, k, v)
    assert any("multihead.attention" in op for op in seen.ops), seen.ops
    with torch.no_grad():
        assert torch.equal(out, mh.attention(q, k, v))


def test_gradients_after_a_prepared_call_still_flow() -> None:
    q, k, v = _qkv(4, 4, 40, 40)
    with torch.no_grad():
        mh.attention(q, k, v, causal=True)
    leaf = q.clone().requires_grad_()
    out = mh.attention(leaf, k, v, causal=True)
    assert out.grad_fn is not None
    out.sum().backward()
    ref = q.to(F64).requires_grad_()
    mh.attention(ref, k.to(F64), v.to(F64), causal=True, backend="explicit").sum().backward()
    torch.testing.assert_close(leaf.grad.to(F64), ref.grad, rtol=0, atol=1e-4)


def test_bad_input_of_a_remembered_signature_is_refused_before_the_kernel() -> None:
    q, k, v = _qkv(4, 4, 40, 40)
    with torch.no_grad():
        mh.attention(q, k, v)
        with pytest.raises(ValueError, match="k"):
            mh.attention(q, k[:, :, :, :16], v)
        with pytest.raises(TypeError, match="dtype|same"):
            mh.attention(q, k.double(), v)
        with pytest.raises(ValueError, match="window"):
            mh.attention(q, k, v, window=0)
