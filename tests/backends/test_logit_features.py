"""Soft-capping, ALiBi, sinks and packed sequences: every backend that claims one, against a float64 oracle.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim.

The oracle below is written from the definitions (multihead.logits' docstring), in
numpy, per head; the naive float32 implementation is the same formula in torch with K/V
repeated. Accuracy criterion: float32 error at most 2× the naive float32 error (3× for
gradients) plus a few ulps.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import multihead as mh
from multihead.backends import available_backends, get_spec

F64 = torch.float64
FEATURES = {"softcap": "softcap", "alibi": "alibi_slopes", "sinks": "sinks"}


def _claiming(feature: str) -> list[str]:
    return [n for n in available_backends() if getattr(get_spec(n), feature) and get_spec(n).ready() is None]


def _lacking(feature: str) -> list[str]:
    return [n for n in available_backends() if not getattr(get_spec(n), feature)]


def oracle(q, k, v, *, causal=False, mask=None, softcap=None, slopes=None, sinks=None, scale=None) -> np.ndarray:
    """Float64, head by head, row by row, from the definitions."""
    q, k, v = (np.asarray(t.detach().double()) for t in (q, k, v))
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b, h, sq, v.shape[-1]))
    allowed = np.ones((b, h, sq, sk), bool) if mask is None else np.broadcast_to(np.asarray(mask), (b, h, sq, sk))
    for bi in range(b):
        for hi in range(h):
            kh, vh = k[bi, hi // (h // hkv)], v[bi, hi // (h // hkv)]
            for i in range(sq):
                s = scale * kh @ q[bi, hi, i]  # (Sk,)
                if softcap is not None:
                    s = softcap * np.tanh(s / softcap)
                pos = i + sk - sq
                if slopes is not None:
                    s = s - float(slopes[hi]) * np.abs(pos - np.arange(sk))
                ok = allowed[bi, hi, i] & ((np.arange(sk) <= pos) if causal else True)
                logits = np.concatenate([s[ok], [float(sinks[hi])] if sinks is not None else []])
                if ok.sum() == 0:
                    continue
                e = np.exp(logits - logits.max())
                p = e / e.sum()
                out[bi, hi, i] = p[: ok.sum()] @ vh[ok]
    return out


def naive(q, k, v, *, causal=False, mask=None, softcap=None, slopes=None, sinks=None) -> torch.Tensor:
    """The same formula in the inputs' dtype, plainly (K/V repeated)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    sq, sk = s.shape[-2:]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    rel = (torch.arange(sq)[:, None] + sk - sq - torch.arange(sk)[None]).to(s.dtype)
    if slopes is not None:
        s = s - slopes.to(s.dtype)[:, None, None] * rel.abs()
    allowed = torch.ones(sq, sk, dtype=torch.bool) if mask is None else mask
    if causal:
        allowed = allowed & (rel >= 0)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:-1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :sk]
    return p @ v


CASES = {
    "softcap": dict(softcap=2.5),
    "alibi": dict(slopes=True),
    "sinks": dict(sinks=True),
    "all": dict(softcap=5.0, slopes=True, sinks=True),
}
SHAPES = [dict(b=2, h=4, hkv=2, sq=24, sk=24, causal=True), dict(b=1, h=6, hkv=6, sq=8, sk=20, causal=True),
          dict(b=1, h=3, hkv=1, sq=12, sk=12, causal=False)]


def _problem(shape: dict, case: dict, dtype=F64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, h, hkv, sq, sk = (shape[n] for n in ("b", "h", "hkv", "sq", "sk"))
    q = 2 * torch.randn(b, h, sq, 16, generator=g, dtype=F64)
    k, v = torch.randn(b, hkv, sk, 16, generator=g, dtype=F64), torch.randn(b, hkv, sk, 16, generator=g, dtype=F64)
    kw = {"softcap": case.get("softcap")}
    kw["slopes"] = mh.logits.alibi_slopes(h).double() * 4 if case.get("slopes") else None
    kw["sinks"] = torch.randn(h, generator=g, dtype=F64) if case.get("sinks") else None
    return (q.to(dtype), k.to(dtype), v.to(dtype)), kw


def _ours(q, k, v, kw, backend, causal):
    return mh.attention(q, k, v, causal=causal, backend=backend, softcap=kw["softcap"],
                        alibi_slopes=None if kw["slopes"] is None else kw["slopes"].to(q.dtype),
                        sinks=None if kw["sinks"] is None else kw["sinks"].to(q.dtype))


def _backward_applies(backend: str, case: dict) -> bool:
    """The backend differentiates through this case's features (its backward applies them)."""
    spec = get_spec(backend)
    keys = [key for key, name in (("softcap", "softcap"), ("alibi_slopes", "slopes"), ("sinks", "sinks"))
            if case.get(name)]
    return spec.grad and (spec.grad_features is None or all(key in spec.grad_features for key in keys))


def _backends_for(case: dict) -> list[str]:
    needed = [f for f, key in (("softcap", "softcap"), ("alibi", "slopes"), ("sinks", "sinks")) if case.get(key)]
    return [n for n in available_backends() if all(getattr(get_spec(n), f) for f in needed)
            and get_spec(n).ready() is None]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_every_claiming_backend_equals_the_float64_oracle(case: str, shape: int) -> None:
    (q, k, v), kw = _problem(SHAPES[shape], CASES[case])
    causal = SHAPES[shape]["causal"]
    truth = oracle(q, k, v, causal=causal, **kw)
    for backend in _backends_for(CASES[case]):
        if get_spec(backend).dtypes is not None and F64 not in get_spec(backend).dtypes:
            continue
        np.testing.assert_allclose(_ours(q, k, v, kw, backend, causal).numpy(), truth, atol=1e-10, rtol=0,
                                   err_msg=backend)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_float32_error_at_most_twice_naive_and_gradients_three_times(case: str, shape: int) -> None:
    (q64, k64, v64), kw = _problem(SHAPES[shape], CASES[case], seed=shape + 1)
    causal = SHAPES[shape]["causal"]
    grad_out = torch.randn(q64.shape[:3] + (16,), dtype=F64)
    ref_q = q64.clone().requires_grad_()
    (naive(ref_q, k64, v64, causal=causal, **kw) * grad_out).sum().backward()
    truth, truth_grad = oracle(q64, k64, v64, causal=causal, **kw), ref_q.grad.numpy()
    q32 = q64.float().requires_grad_()
    (naive(q32, k64.float(), v64.float(), causal=causal, **kw) * grad_out.float()).sum().backward()
    naive_err = np.abs(naive(q64.float(), k64.float(), v64.float(), causal=causal, **kw).numpy() - truth).max()
    naive_grad_err = np.abs(q32.grad.double().numpy() - truth_grad).max()
    ulps = 8 * 2.0**-23
    for backend in _backends_for(CASES[case]):
        grads = _backward_applies(backend, CASES[case])
        q = q64.float().requires_grad_(grads)
        out = _ours(q, k64.float(), v64.float(), kw, backend, causal)
        err = np.abs(out.detach().double().numpy() - truth).max()
        assert err <= 2 * naive_err + ulps, (backend, err, naive_err)
        if grads:
            (out * grad_out.float()).sum().backward()
            grad_err = np.abs(q.grad.double().numpy() - truth_grad).max()
            assert grad_err <= 3 * naive_grad_err + ulps, (backend, grad_err, naive_grad_err)


@pytest.mark.parametrize("backend", [n for n in _claiming("sinks") if _backward_applies(n, CASES["all"])])
def test_gradients_of_sinks_and_alibi_slopes_equal_autograd_of_the_definition(backend: str) -> None:
    (q, k, v), kw = _problem(SHAPES[0], CASES["all" if get_spec(backend).softcap else "alibi"])
    sinks = torch.randn(q.shape[1], dtype=F64, requires_grad=True)
    slopes = kw["slopes"].clone().requires_grad_()
    softcap = kw["softcap"]
    out = mh.attention(q, k, v, causal=True, backend=backend, softcap=softcap, alibi_slopes=slopes, sinks=sinks)
    ours = torch.autograd.grad(out.square().sum(), (sinks, slopes))
    s2, sl2 = sinks.detach().clone().requires_grad_(), kw["slopes"].clone().requires_grad_()
    ref = torch.autograd.grad(naive(q, k, v, causal=True, softcap=softcap, slopes=sl2, sinks=s2).square().sum(),
                              (s2, sl2))
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_a_backend_without_the_feature_refuses_it_by_name(feature: str) -> None:
    q = torch.randn(1, 2, 4, 8)
    value = 3.0 if feature == "softcap" else torch.ones(2)
    for backend in _lacking(feature):
        with pytest.raises(ValueError, match=f"{backend}.*cannot do .*{FEATURES[feature]}"):
            mh.attention(q, q, q, backend=backend, **{FEATURES[feature]: value})


@pytest.mark.parametrize(("kw", "path"), [
    (dict(softcap=3.0), "explicit (softcap)"),
    (dict(alibi_slopes=torch.ones(2)), "sdpa (bias)"),
    (dict(sinks=torch.ones(2)), "sdpa (bias)"),
    (dict(alibi_slopes=torch.ones(2), return_lse=True), "explicit (bias, lse)"),
])
def test_auto_routes_around_backends_without_the_feature(kw: dict, path: str) -> None:
    """With gradients (the native backward applies no feature: tests/backends/test_native_logits.py
    has the native rule)."""
    q = torch.randn(1, 2, 1024, 64, requires_grad=True)
    assert mh.backends.auto.auto_path(q, q, q, **kw) == path
    mh.attention(q[:, :, :16], q[:, :, :16], q[:, :, :16], **kw)  # and runs


def test_a_row_with_no_key_gives_zeros_even_with_a_sink() -> None:
    q = torch.randn(1, 2, 3, 8, dtype=F64)
    mask = torch.tensor([[True, True, True], [False, False, False], [True, False, True]])
    for backend in _claiming("sinks"):
        dtypes = get_spec(backend).dtypes
        x = q if dtypes is None or F64 in dtypes else q.float()
        out = mh.attention(x, x, x, mask=mask, sinks=torch.tensor([5.0, -1.0], dtype=x.dtype), backend=backend)
        assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1])), backend


def test_sinks_with_the_log_sum_exp_are_refused() -> None:
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="return_lse=True is not supported with sinks"):
        mh.attention(q, q, q, sinks=torch.zeros(2), return_lse=True)


@pytest.mark.parametrize(("kw", "match"), [
    (dict(softcap=0.0), "softcap"), (dict(softcap=float("nan")), "softcap"),
    (dict(alibi_slopes=torch.ones(3)), r"alibi_slopes must have shape \[H\] = \[2\]"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.long)), "alibi_slopes must be a floating"),
    (dict(sinks=torch.ones(1, 2)), "sinks"),
    (dict(cu_seqlens=torch.tensor([0, 2])), "cu_seqlens must rise from 0 to S=4"),
    (dict(cu_seqlens=torch.tensor([0, 3, 2, 4])), "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0.0, 4.0])), "cu_seqlens must be an integer"),
])
def test_malformed_feature_arguments_are_refused_naming_them(kw: dict, match: str) -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        mh.attention(q, q, q, **kw)


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 8, 12, 16, 24])
def test_alibi_slopes_equal_bloom_including_non_power_of_two_head_counts(heads: int) -> None:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    mask = torch.ones(1, 3)
    bloom = build_alibi_tensor(mask, heads, torch.float32)  # (H, 1, 3) = slope · position
    assert torch.equal(bloom[:, 0, 1], mh.logits.alibi_slopes(heads))


# -- packed sequences -------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 3])
def test_a_packed_batch_equals_its_sequences_run_one_by_one_on_every_backend(causal: bool, window: int | None
                                                                            ) -> None:
    lengths = [5, 1, 9, 3]
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()])
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, sum(lengths), 16, generator=g)
    k, v = torch.randn(1, 2, sum(lengths), 16, generator=g), torch.randn(1, 2, sum(lengths), 16, generator=g)
    for backend in available_backends():
        if get_spec(backend).ready() is not None:
            continue
        packed = mh.attention(q, k, v, causal=causal, window=window, cu_seqlens=cu, backend=backend)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = mh.attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=causal, window=window,
                                 backend=backend)
            torch.testing.assert_close(packed[:, :, a:b], alone, rtol=0, atol=2e-6, msg=backend)


def test_segments_from_restarting_positions_equal_cu_seqlens() -> None:
    positions = torch.tensor([0, 1, 2, 0, 0, 1, 2, 3])
    assert torch.equal(mh.masks.segments_from_positions(positions),
                       mh.masks.segment_mask(torch.tensor([0, 3, 4, 8]), 8))
