"""RoPE: tables, pairings, the permutation between them, and the rotation's properties.

Notation: B batch, H heads, S tokens, D head dim, R rotary dims.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import multihead as mh
from conftest import ATOL64, copy_weights, np64, reference_layer

F64 = torch.float64
PAIRINGS = [False, True]
PAIRING_IDS = ["half", "interleaved"]


# -- tables: Hugging Face's numbers ----------------------------------------------------


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_tables_equal_hf_llama_rotary_embedding_bitwise(theta: float) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=theta, max_position_embeddings=256)
    hf = LlamaRotaryEmbedding(config)
    ours = mh.RoPE(16, base=theta, max_positions=256)
    cos, sin = hf(torch.zeros(1), torch.arange(256)[None])  # (1, P, D): each half repeated
    assert torch.equal(hf.inv_freq, ours.inv_freq)
    assert torch.equal(cos[0], torch.cat([ours.cos, ours.cos], dim=-1))
    assert torch.equal(sin[0], torch.cat([ours.sin, ours.sin], dim=-1))


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_half_pairing_equals_hf_apply_rotary_pos_emb(theta: float) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=theta)
    q, k = torch.randn(2, 4, 9, 16), torch.randn(2, 4, 9, 16)
    positions = torch.arange(20, 29)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None].expand(2, 9))
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    rope = mh.RoPE(16, base=theta)
    torch.testing.assert_close(rope(q, positions), hf_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(rope(k, positions), hf_k, rtol=0, atol=1e-6)


def test_tables_are_float32_non_persistent_buffers() -> None:
    rope = mh.RoPE(8, max_positions=32)
    assert rope.cos.dtype == rope.sin.dtype == torch.float32
    assert rope.cos.shape == (32, 4)
    assert rope.state_dict() == {}


# -- against the float64 reference -----------------------------------------------------


@pytest.mark.parametrize("rotary_dim", [None, 4], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_rotation_equals_reference_rope(interleaved: bool, rotary_dim: int | None) -> None:
    x = torch.randn(1, 1, 7, 8, dtype=F64)  # one head: (B, H, S, D)
    positions = torch.arange(3, 10)
    rope = mh.RoPE(8, base=500.0, interleaved=interleaved, rotary_dim=rotary_dim)
    want = mh.reference.rope(np64(x[0, 0]).T, np64(positions), 500.0, interleaved=interleaved,
                             rotary_dim=rotary_dim)
    np.testing.assert_allclose(np64(rope(x, positions)[0, 0]).T, want, rtol=0, atol=ATOL64)


def test_float32_rotation_matches_reference_to_float32_rounding() -> None:
    x = torch.randn(1, 2, 64, 16)
    got = mh.RoPE(16)(x)
    want = [mh.reference.rope(np64(x[0, i]).T, np.arange(64), 10000.0) for i in range(2)]
    np.testing.assert_allclose(np64(got[0]).transpose(0, 2, 1), np.stack(want), rtol=0, atol=1e-4)


# -- properties of the rotation ----------------------------------------------------------


def _pairs(x: torch.Tensor, interleaved: bool, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    if interleaved:
        return x[..., 0:r:2], x[..., 1:r:2]
    return x[..., : r // 2], x[..., r // 2 : r]


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_rotation_preserves_the_norm_of_each_pair(interleaved: bool) -> None:
    x = torch.randn(2, 3, 11, 8, dtype=F64)
    y = mh.RoPE(8, interleaved=interleaved)(x)
    a, b = _pairs(x, interleaved, 8)
    c, d = _pairs(y, interleaved, 8)
    torch.testing.assert_close(a**2 + b**2, c**2 + d**2, rtol=0, atol=ATOL64)
    assert (x - y).abs().max() > 1e-3  # it does rotate


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_position_zero_is_the_identity(interleaved: bool) -> None:
    x = torch.randn(1, 2, 1, 8, dtype=F64)
    torch.testing.assert_close(mh.RoPE(8, interleaved=interleaved)(x), x, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", PAIRINGS, ids=PAIRING_IDS)
def test_scores_depend_only_on_the_position_difference(interleaved: bool) -> None:
    rope = mh.RoPE(8, interleaved=interleaved)
    q, k = torch.randn(1, 1, 1, 8, dtype=F64), torch.randn(1, 1, 1, 8, dtype=F64)

    def score(m: int, n: int) -> torch.Tensor:
        return (rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum()

    for shift in (1, 17, 1000, 5000):  # 5000 lies beyond the precomputed table
        torch.testing.assert_close(score(7, 3), score(7 + shift, 3 + shift), rtol=0, atol=ATOL64)
    assert (score(7, 3) - score(7, 4)).abs() > 1e-6


def test_partial_rotary_leaves_the_last_dims_unchanged() -> None:
    x = torch.randn(2, 2, 6, 8)
    y = mh.RoPE(8, rotary_dim=4)(x)
    torch.testing.assert_close(y[..., 4:], x[..., 4:], rtol=0, atol=0)
    assert (y[..., :4] - x[..., :4]).abs().max() > 1e-3


def test_default_positions_are_zero_to_s_minus_one() -> None:
    rope = mh.RoPE(8)
    x = torch.randn(2, 3, 5, 8)
    torch.testing.assert_close(rope(x), rope(x, torch.arange(5)), rtol=0, atol=0)


def test_batched_positions_rotate_each_sequence_by_its_own_positions() -> None:
    rope = mh.RoPE(8)
    x = torch.randn(2, 3, 5, 8)
    positions = torch.stack([torch.arange(5), torch.arange(10, 15)])  # (B, S)
    y = rope(x, positions)
    torch.testing.assert_close(y[:1], rope(x[:1], positions[0]), rtol=0, atol=0)
    torch.testing.assert_close(y[1:], rope(x[1:], positions[1]), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_positions_beyond_the_table_use_the_same_formula(dtype: torch.dtype) -> None:
    x = torch.randn(1, 2, 6, 8, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 5, 6, 7])
    small, large = mh.RoPE(8, max_positions=4), mh.RoPE(8, max_positions=64)
    torch.testing.assert_close(small(x, positions), large(x, positions), rtol=0, atol=1e-6)


def test_rotation_keeps_the_input_dtype() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32, F64):
        assert mh.RoPE(8)(torch.randn(1, 1, 3, 8).to(dtype)).dtype == dtype


# -- the permutation between the pairings ------------------------------------------------


@pytest.mark.parametrize("rotary_dim", [None, 4], ids=["full", "partial"])
@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_interleaved_layer_equals_half_layer_with_permuted_q_k_weights(num_kv_heads: int,
                                                                         rotary_dim: int | None) -> None:
    e, h, d = 32, 4, 8
    interleaved = mh.MultiHeadAttention(e, h, num_kv_heads=num_kv_heads, causal=True, dtype=F64,
                                        rope=mh.RoPE(d, interleaved=True, rotary_dim=rotary_dim))
    half = mh.MultiHeadAttention(e, h, num_kv_heads=num_kv_heads, causal=True, dtype=F64,
                                 rope=mh.RoPE(d, rotary_dim=rotary_dim))
    copy_weights(half, interleaved)
    with torch.no_grad():
        for proj, heads in ((half.q_proj, h), (half.k_proj, num_kv_heads)):
            proj.weight.copy_(mh.interleaved_to_half(proj.weight, heads, rotary_dim))
            proj.bias.copy_(mh.interleaved_to_half(proj.bias, heads, rotary_dim))
    x = torch.randn(2, 6, e, dtype=F64)
    torch.testing.assert_close(half(x), interleaved(x), rtol=0, atol=ATOL64)
    # Without the permutation the two layers differ: the test can fail.
    copy_weights(half, interleaved)
    assert (half(x) - interleaved(x)).abs().max() > 1e-3


@pytest.mark.parametrize("rotary_dim", [None, 4], ids=["full", "partial"])
@pytest.mark.parametrize("shape", [(32, 24), (32,)], ids=["weight", "bias"])
def test_half_to_interleaved_inverts_interleaved_to_half(shape: tuple[int, ...], rotary_dim: int | None) -> None:
    w = torch.randn(*shape)
    permuted = mh.interleaved_to_half(w, 4, rotary_dim)
    assert not torch.equal(permuted, w)
    assert torch.equal(mh.half_to_interleaved(permuted, 4, rotary_dim), w)
    assert torch.equal(mh.interleaved_to_half(mh.half_to_interleaved(w, 4, rotary_dim), 4, rotary_dim), w)


def test_interleaved_to_half_moves_pair_p_to_rows_p_and_p_plus_half() -> None:
    rows = torch.arange(8.0)  # one head, D = 8: pairs (0,1) (2,3) (4,5) (6,7)
    assert mh.interleaved_to_half(rows, 1).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_interleaved_layer_equals_reference_with_interleaved_rope() -> None:
    layer = mh.MultiHeadAttention(16, 2, causal=True, rope=mh.RoPE(8, interleaved=True), dtype=F64)
    x = torch.randn(1, 5, 16, dtype=F64)
    want, _ = reference_layer(layer, x)
    np.testing.assert_allclose(np64(layer(x)), want, rtol=0, atol=ATOL64)


def test_tables_stay_float32_when_the_layer_changes_dtype() -> None:
    """layer.half()/.to(bfloat16) converts buffers; RoPE's tables must keep float32 precision."""
    layer = mh.MultiHeadAttention(32, 4, rope=mh.RoPE(8)).to(torch.bfloat16)
    assert layer.rope.cos.dtype == torch.float32 and layer.rope.inv_freq.dtype == torch.float32
    torch.testing.assert_close(layer.rope.cos, mh.RoPE(8).cos, atol=0, rtol=0)
    assert layer(torch.randn(1, 5, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize(("max_positions", "rows"), [(None, mh.rope.ROPE_TABLE_POSITIONS), (100, 100),
                                                     (mh.rope.ROPE_TABLE_POSITIONS, mh.rope.ROPE_TABLE_POSITIONS),
                                                     (131_072, mh.rope.ROPE_TABLE_POSITIONS)],
                         ids=["unknown", "short", "at the cap", "past the cap"])
def test_from_facts_sizes_the_table_by_the_context_length_capped(max_positions: int | None, rows: int) -> None:
    """min(max_positions or ROPE_TABLE_POSITIONS, ROPE_TABLE_POSITIONS) rows: the one rule."""
    scaling = mh.RopeScaling(rope_type="linear", factor=2.0)
    rope = mh.RoPE.from_facts(16, 500.0, interleaved=True, rotary_dim=8, max_positions=max_positions, scaling=scaling)
    want = mh.RoPE(16, 500.0, interleaved=True, rotary_dim=8, max_positions=rows, scaling=scaling)
    assert (rope.max_positions, rope.cos.shape) == (rows, (rows, 4))
    assert (rope.interleaved, rope.rotary_dim, rope.base, rope.scaling) == (True, 8, 500.0, scaling)
    assert torch.equal(rope.cos, want.cos) and torch.equal(rope.sin, want.sin)


@pytest.mark.parametrize(("max_positions", "error"), [(0, ValueError), (-5, ValueError), (True, TypeError),
                                                      (8.0, TypeError)])
def test_from_facts_refuses_a_context_length_that_is_not_a_positive_int(max_positions: object,
                                                                        error: type[Exception]) -> None:
    with pytest.raises(error, match="max_positions"):
        mh.RoPE.from_facts(16, 10_000.0, max_positions=max_positions)  # type: ignore[arg-type]
