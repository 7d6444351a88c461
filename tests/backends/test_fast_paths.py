"""The module's fast paths compute what its plain path computes, and step aside when they must."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multihead as mh


def layer_and_input(**kw) -> tuple[mh.MultiHeadAttention, torch.Tensor]:
    torch.random.default_generator.manual_seed(0)
    return mh.MultiHeadAttention(64, 8, num_kv_heads=2, **kw).eval(), torch.randn(2, 40, 64)


def test_inference_path_equals_the_training_path() -> None:
    layer, x = layer_and_input(causal=True, rope=mh.RoPE(8))
    with torch.no_grad():
        fast = layer(x)
    slow = layer(x)  # with gradients: three separate projections, SDPA
    torch.testing.assert_close(fast, slow.detach(), atol=1e-5, rtol=1e-5)


def test_inference_path_follows_in_place_weight_updates() -> None:
    layer, x = layer_and_input()
    with torch.no_grad():
        before = layer(x)
        layer.k_proj.weight.mul_(2.0)  # e.g. an optimizer step
        after = layer(x)
    expected = layer(x).detach()
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)


def test_inference_path_follows_replaced_weights() -> None:
    layer, x = layer_and_input(bias=True)
    with torch.no_grad():
        layer(x)
        layer.v_proj.bias = nn.Parameter(torch.randn(16))
        after = layer(x)
    torch.testing.assert_close(after, layer(x).detach(), atol=1e-5, rtol=1e-5)


def test_no_extra_state_is_kept() -> None:
    layer, x = layer_and_input()
    with torch.no_grad():
        layer(x)
    assert set(layer.state_dict()) == {f"{p}_proj.{t}" for p in "qkvo" for t in ("weight", "bias")}
    assert not [k for k, v in vars(layer).items() if isinstance(v, torch.Tensor)]


def test_inference_path_follows_data_edits() -> None:
    """``p.data.mul_()`` bumps no version counter: nothing may be cached from the weights."""
    layer, x = layer_and_input()
    with torch.no_grad():
        before = layer(x)
        layer.q_proj.weight.data.mul_(2.0)
        after = layer(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, layer(x).detach(), atol=1e-5, rtol=1e-5)


def test_frozen_weights_get_no_gradient_but_inputs_do() -> None:
    layer, x = layer_and_input()
    for p in layer.parameters():
        p.requires_grad_(False)
    layer.o_proj.weight.requires_grad_(True)
    xs = x.clone().requires_grad_()
    layer(xs).sum().backward()
    assert layer.q_proj.weight.grad is None and layer.o_proj.weight.grad is not None
    assert xs.grad is not None and torch.isfinite(xs.grad).all()


def test_hooks_on_a_projection_are_honoured() -> None:
    layer, x = layer_and_input()
    calls: list[str] = []
    layer.q_proj.register_forward_hook(lambda m, i, o: calls.append("q") or o * 0)
    with torch.no_grad():
        y = layer(x)
    assert calls == ["q"]
    # q = 0 makes every logit 0: each query averages the values, the same for every position.
    torch.testing.assert_close(y[:, :1].expand_as(y), y, atol=1e-5, rtol=1e-5)


def test_a_replaced_projection_module_is_called() -> None:
    """A subclass (e.g. a LoRA or quantized linear) keeps its own forward."""

    class Doubling(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    layer, x = layer_and_input()
    with torch.no_grad():
        plain = layer(x)
        doubled = Doubling(64, 64)
        doubled.load_state_dict(layer.o_proj.state_dict())
        layer.o_proj = doubled
        torch.testing.assert_close(layer(x), 2 * plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [0, 128], ids=["no kernel", "no AVX2"])
def test_auto_without_the_native_kernel_uses_its_torch_paths(monkeypatch, bits: int) -> None:
    """Without the kernel, or built for 128-bit vectors (its tiles are measured with AVX-512
    and AVX2 only), "auto" and the module's projections keep to torch's paths."""
    monkeypatch.setattr(mh.native, "vector_bits", lambda: bits)
    monkeypatch.setattr(mh.native, "linear_few_rows", lambda *a: pytest.fail("native linear used"))
    monkeypatch.setattr(mh.native.step, "decode_step", lambda *a, **k: pytest.fail("native step used"))
    monkeypatch.setattr(mh.native.StepPlan, "run", lambda *a, **k: pytest.fail("native step used"))
    layer = mh.MultiHeadAttention(64, 4, causal=True).eval()
    cache = layer.new_cache(1, 8)
    with torch.no_grad():
        layer(torch.randn(1, 1, 64), cache=cache)
    long = torch.randn(1, 2, 512, 64)
    q1, kv = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 300, 64)
    assert mh.backends.auto.auto_path(q1, kv, kv) == "decode"
    long_path = "blocked" if mh.backends.gemm.onednn_available() else "sdpa"
    assert mh.backends.auto.auto_path(long, long, long) == long_path


