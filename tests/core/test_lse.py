"""``return_lse``: the per-row log-sum-exp, equal to the float64 reference's, on every backend that claims it."""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from multihead.backends.registry import get_spec
from multihead.masks import full_mask

LSE_BACKENDS = [n for n in mh.backends.available_backends() if get_spec(n).lse]

CASES = {
    "mha": dict(b=2, h=4, hkv=4, sq=7, sk=7, causal=False, window=None),
    "gqa-causal": dict(b=1, h=6, hkv=2, sq=9, sk=13, causal=True, window=None),
    "mqa-window": dict(b=2, h=4, hkv=1, sq=5, sk=11, causal=True, window=3),
    "cross-sq>sk": dict(b=1, h=2, hkv=2, sq=9, sk=4, causal=True, window=None),
    "long-chunked": dict(b=1, h=2, hkv=1, sq=70, sk=4200, causal=True, window=None),
}


def _reference_lse(q, k, v, mask, causal, window, scale):
    """torch.logsumexp of the float64 scaled, masked scores (GQA by repeating K in float64)."""
    g = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(g, dim=1).transpose(-1, -2) * scale  # (B, H, Sq, Sk)
    m = full_mask(mask, causal, window, q.shape[2], k.shape[2], None)
    if m is not None:
        s = s.masked_fill(~m, -math.inf)
    return torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("backend", LSE_BACKENDS)
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_lse_equals_the_float64_reference(backend: str, case: str) -> None:
    c = CASES[case]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(c["b"], c["h"], c["sq"], 64, generator=g)
    k = torch.randn(c["b"], c["hkv"], c["sk"], 64, generator=g)
    v = torch.randn(c["b"], c["hkv"], c["sk"], 64, generator=g)
    mask = torch.rand(c["b"], 1, c["sq"], c["sk"], generator=g) > 0.3
    mask[:, :, 0] = False  # a fully masked row: lse -inf, output zeros
    if backend == "native" and not mh.native.available():
        pytest.skip(f"native kernel not available: {mh.native.status()}")
    out, lse = mh.attention(q, k, v, mask=mask, causal=c["causal"], window=c["window"], return_lse=True,
                            backend=backend)
    ref = _reference_lse(q, k, v, mask, c["causal"], c["window"], 64 ** -0.5)
    assert lse.dtype == torch.float32 and lse.shape == (c["b"], c["h"], c["sq"])
    dead = torch.isinf(ref)
    assert torch.equal(torch.isneginf(lse), dead)
    torch.testing.assert_close(lse[~dead].double(), ref[~dead], atol=2e-5, rtol=2e-6)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))


@pytest.mark.parametrize("backend", LSE_BACKENDS)
def test_two_halves_of_the_keys_merge_by_their_lse_to_attention_over_all_keys(backend: str) -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 8, 6, 32, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 20, 32, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 20, 32, generator=g, dtype=torch.float64)
    if backend == "native":
        q, k, v = q.float(), k.float(), v.float()
        if not mh.native.available():
            pytest.skip(mh.native.status())
    full = mh.attention(q.double(), k.double(), v.double(), backend="explicit")
    o1, l1 = mh.attention(q, k[:, :, :11], v[:, :, :11], return_lse=True, backend=backend)
    o2, l2 = mh.attention(q, k[:, :, 11:], v[:, :, 11:], return_lse=True, backend=backend)
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top), torch.exp(l2 - top)
    merged = (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]
    tol = 1e-12 if q.dtype == torch.float64 else 2e-6  # float64 inputs: a float64 lse
    torch.testing.assert_close(merged, full.to(merged.dtype), atol=tol, rtol=tol)


def test_lse_and_weights_together_come_back_in_order() -> None:
    q = torch.randn(1, 2, 3, 8)
    out, weights, lse = mh.attention(q, q, q, return_weights=True, return_lse=True)
    assert weights.shape == (1, 2, 3, 3) and lse.shape == (1, 2, 3)
    torch.testing.assert_close(lse, torch.logsumexp(q @ q.transpose(-1, -2) / 8 ** 0.5, -1))


def test_lse_with_gradients_is_differentiable_through_auto() -> None:
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    out, lse = mh.attention(q, q, q, causal=True, return_lse=True)
    (out.sum() + lse.sum()).backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_lse_is_float64_for_float64_inputs_and_float32_otherwise() -> None:
    pairs = ((torch.float64, torch.float64), (torch.float32, torch.float32), (torch.bfloat16, torch.float32))
    for dtype, want in pairs:
        q = torch.randn(1, 2, 4, 8).to(dtype)
        for backend in ("explicit", "blocked", "auto"):
            assert mh.attention(q, q, q, return_lse=True, backend=backend)[1].dtype == want, (dtype, backend)
