"""Numerical robustness and determinism on every backend."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch
from conftest import reference_core

import multihead as mh

BACKENDS = mh.backends.available_backends()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_inputs_scaled_by_1e4_give_finite_correct_outputs(backend: str, causal: bool) -> None:
    q, k, v = (torch.randn(2, 4, 9, 16) * 1e4 for _ in range(3))
    got = mh.attention(q, k, v, causal=causal, backend=backend)
    truth, _ = reference_core(q.double(), k.double(), v.double(), causal=causal)
    assert torch.isfinite(got).all()
    # Logits of ~1e9 make the softmax one-hot: the output is a row of v, up to float32 rounding.
    torch.testing.assert_close(got.double(), torch.from_numpy(truth), atol=1e4 * 1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scaled_layer_stays_finite(backend: str) -> None:
    layer = mh.MultiHeadAttention(32, 4, causal=True, rope=mh.RoPE(8), backend=backend)
    with torch.no_grad():  # "blocked" and "native" are inference backends
        y = layer(torch.randn(1, 20, 32) * 1e4)
    assert torch.isfinite(y).all()


def test_all_equal_logits_give_uniform_weights() -> None:
    q = torch.zeros(1, 3, 4, 8)
    k, v = torch.randn(1, 3, 6, 8), torch.randn(1, 3, 6, 8)
    out, weights = mh.attention(q, k, v, return_weights=True)
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 6))
    torch.testing.assert_close(out, v.mean(dim=2, keepdim=True).expand_as(out))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_do_not_overflow(backend: str, dtype: torch.dtype) -> None:
    # q·k ≈ 300 · 300 · 64 ≈ 6e6: far beyond float16's 65504; the logits live in float32.
    q, k, v = torch.randn(1, 2, 7, 64) * 300, torch.randn(1, 2, 7, 64) * 300, torch.randn(1, 2, 7, 64)
    got = mh.attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, backend=backend)
    truth, _ = reference_core(q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double(), causal=True)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), torch.from_numpy(truth), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_exactly_zero(backend: str) -> None:
    q, k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask = torch.rand(2, 2, 5, 6) < 0.5
    mask[:, :, 2] = False
    out = mh.attention(q, k, v, mask=mask, backend=backend)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_same_inputs_give_bitwise_identical_outputs(backend: str, causal: bool) -> None:
    q, k, v = torch.randn(2, 8, 67, 32), torch.randn(2, 2, 67, 32), torch.randn(2, 2, 67, 32)
    first = mh.attention(q, k, v, causal=causal, backend=backend)
    for _ in range(3):
        assert torch.equal(mh.attention(q, k, v, causal=causal, backend=backend), first)


def test_layer_and_cache_outputs_are_bitwise_identical_across_processes() -> None:
    """Two fresh interpreters compute the same bytes (CPU kernels are deterministic)."""
    script = (
        "import hashlib, torch, multihead as mh\n"
        "torch.random.default_generator.manual_seed(0)\n"
        "layer = mh.MultiHeadAttention(64, 8, num_kv_heads=2, causal=True, rope=mh.RoPE(8)).eval()\n"
        "x = torch.randn(2, 33, 64)\n"
        "h = hashlib.sha256()\n"
        "with torch.no_grad():\n"
        "    h.update(layer(x).numpy().tobytes())\n"
        "    cache = layer.new_cache(2, 40)\n"
        "    h.update(layer(x[:, :30], cache=cache).numpy().tobytes())\n"
        "    h.update(layer(x[:, 30:31], cache=cache).numpy().tobytes())\n"
        "    for b in mh.backends.available_backends():\n"
        "        layer.backend = b\n"
        "        h.update(layer(x).numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    runs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           timeout=120).stdout.strip() for _ in range(2)}
    assert len(runs) == 1 and len(runs.pop()) == 64


def test_gradients_are_deterministic() -> None:
    layer = mh.MultiHeadAttention(32, 4, causal=True)
    x = torch.randn(2, 17, 32)

    def digest() -> str:
        layer.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        layer(xs).square().sum().backward()
        h = hashlib.sha256(xs.grad.numpy().tobytes())
        for p in layer.parameters():
            h.update(p.grad.numpy().tobytes())
        return h.hexdigest()

    assert digest() == digest()
