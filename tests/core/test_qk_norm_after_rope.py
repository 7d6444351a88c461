"""QK-norm after RoPE (``qk_norm="head_after_rope"``, HunYuan dense): the order, the steps, decoding.

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads, D head_dim.

The oracle is the written-out float64 pipeline: split, rotate, then RMSNorm over D with the
layer's weights, then softmax attention; HF's HunYuan module is compared in
tests/core/test_module_features.py and through the zoo (tests/interop/test_zoo.py).
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh

F64 = torch.float64
E, H, HKV, D, S = 32, 4, 2, 8, 7


def _layer(rope: bool = True, **kw: object) -> mh.MultiHeadAttention:
    torch.random.default_generator.manual_seed(0)
    layer = mh.MultiHeadAttention(E, H, num_kv_heads=HKV, causal=True, rope=mh.RoPE(D) if rope else None,
                                  qk_norm="head_after_rope", norm_eps=1e-6, dtype=F64, **kw).eval()
    with torch.no_grad():  # weights far from ones: a norm of ones commutes with the rotation
        layer.q_norm.weight.uniform_(0.2, 2.0)
        layer.k_norm.weight.uniform_(0.2, 2.0)
    return layer


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _written_out(layer: mh.MultiHeadAttention, x: torch.Tensor, *, norm_first: bool = False) -> torch.Tensor:
    """x (B, S, E) -> (B, S, E): project, split, RoPE then RMSNorm (or the reverse), causal softmax."""
    b, s, _ = x.shape
    q = (x @ layer.q_proj.weight.T + layer.q_proj.bias).view(b, s, H, D).transpose(1, 2)  # (B, H, S, D)
    k = (x @ layer.k_proj.weight.T + layer.k_proj.bias).view(b, s, HKV, D).transpose(1, 2)  # (B, Hkv, S, D)
    v = (x @ layer.v_proj.weight.T + layer.v_proj.bias).view(b, s, HKV, D).transpose(1, 2)
    if norm_first:
        q, k = _rms(q, layer.q_norm.weight), _rms(k, layer.k_norm.weight)
    if layer.rope is not None:
        half = D // 2
        angle = torch.arange(s, dtype=F64)[:, None] * 10000.0 ** (-torch.arange(half, dtype=F64) / half)  # (S, D/2)
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)  # (S, D)

        def rot(t: torch.Tensor) -> torch.Tensor:
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

        q, k = rot(q), rot(k)
    if not norm_first:
        q, k = _rms(q, layer.q_norm.weight), _rms(k, layer.k_norm.weight)
    k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)  # (B, H, S, D)
    logits = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, S, S)
    logits = logits.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    heads = logits.softmax(-1) @ v  # (B, H, S, D)
    concat = heads.transpose(1, 2).reshape(b, s, H * D)  # (B, S, H·D)
    return concat @ layer.o_proj.weight.T + layer.o_proj.bias


@pytest.mark.parametrize("rope", [True, False])
def test_norm_after_rope_equals_the_written_out_float64_pipeline(rope: bool) -> None:
    layer = _layer(rope)
    x = torch.randn(2, S, E, dtype=F64)
    with torch.no_grad():
        for backend in ("explicit", "sdpa"):
            layer.backend = backend
            torch.testing.assert_close(layer(x), _written_out(layer, x), rtol=0, atol=1e-10)


def test_norm_after_rope_differs_from_norm_before_rope() -> None:
    """The oracle can tell the two orders apart (the feature is not a no-op on these weights)."""
    layer = _layer()
    x = torch.randn(2, S, E, dtype=F64)
    with torch.no_grad():
        assert (layer(x) - _written_out(layer, x, norm_first=True)).abs().max() > 1e-3


def test_decoding_with_a_cache_equals_the_full_pass() -> None:
    layer = _layer()
    x = torch.randn(2, S, E, dtype=F64)
    with torch.no_grad():
        full = layer(x)
        cache = layer.new_cache(2, 16, dtype=F64)
        steps = [layer(x[:, :3], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(3, S)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)


@pytest.mark.skipif(mh.backends.native.vector_bits() < 256, reason="no AVX-512 or AVX2 native kernel here")
def test_the_fused_decoding_step_takes_the_norm_after_rope() -> None:
    """HunYuan's order in the one-call step: the decoded token equals the full pass's."""
    torch.random.default_generator.manual_seed(0)
    layer = mh.MultiHeadAttention(E, H, causal=True, rope=mh.RoPE(D), qk_norm="head_after_rope").eval()
    with torch.no_grad():
        layer.k_norm.weight.copy_(torch.rand(D) * 3 - 1)
        x = torch.randn(1, S, E)
        cache = layer.new_cache(1, 8)
        layer(x[:, :-1], cache=cache)
        assert mh.decode.why_not_fused(layer, x[:, -1:], cache) is None
        step = layer(x[:, -1:], cache=cache)
        torch.testing.assert_close(step, layer(x)[:, -1:], atol=1e-5, rtol=1e-5)


def test_trace_records_the_norm_after_the_rotation() -> None:
    layer = _layer()
    names = [row.tensor for row in mh.trace(layer, torch.randn(1, S, E, dtype=F64)).rows]
    assert names.index("norm(RoPE(Q_k))") == names.index("RoPE(Q_k)") + 2  # Q_rot, K_rot, then the norms
    assert "norm(Q_k)" not in names


def test_capture_records_the_queries_attention_read() -> None:
    layer = _layer()
    x = torch.randn(1, S, E, dtype=F64)
    seen: dict[str, torch.Tensor] = {}
    with torch.no_grad(), layer.watched(seen.__setitem__):
        layer(x)
    with torch.no_grad(), mh.heads.capture(layer, what=("q",)) as cap:
        layer(x)
    torch.testing.assert_close(cap.get("", "q") if hasattr(cap, "get") else cap.q[""], seen["Q_rot_norm"])


def test_extra_repr_and_config_name_it() -> None:
    layer = mh.MultiHeadAttention(E, H, qk_norm="head_after_rope")
    assert "qk_norm='head_after_rope'" in repr(layer)
    assert tuple(layer.q_norm.weight.shape) == (D,) and tuple(layer.k_norm.weight.shape) == (D,)
    config = mh.AttentionConfig(embed_dim=E, num_heads=H, num_kv_heads=H, head_dim=D, qk_norm="head_after_rope",
                                rope_base=1e4)
    assert mh.MultiHeadAttention.from_config(config).qk_norm == "head_after_rope"
    with pytest.raises(ValueError, match="qk_norm must be one of .*'head_after_rope'"):
        mh.AttentionConfig(embed_dim=E, num_heads=H, num_kv_heads=H, head_dim=D, qk_norm="after_rope")
