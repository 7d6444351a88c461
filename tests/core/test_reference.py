"""The float64 reference: the seed's pipeline step by step, in [features, tokens].

Symbols are the seed's: d model width, h heads, d_head = d / h, S tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import multihead as mh
from conftest import ATOL64, np64, reference_weights

F64 = torch.float64


def _seed_layer(d: int = 24, h: int = 3, rope: bool = True) -> mh.MultiHeadAttention:
    return mh.MultiHeadAttention(d, h, causal=True, rope=mh.RoPE(d // h) if rope else None, dtype=F64)


def test_features_tokens_reference_equals_tokens_features_module_transposed() -> None:
    layer = _seed_layer()
    x = torch.randn(1, 7, 24, dtype=F64)  # (B, S, d): [tokens, features]
    X = np64(x[0]).T  # [d, S]: [features, tokens]
    O = mh.reference.multi_head_attention(X, num_heads=3, causal=True, rope_base=10000.0, **reference_weights(layer))
    assert O.shape == (24, 7)
    np.testing.assert_allclose(O.T, np64(layer(x)[0]), rtol=0, atol=ATOL64)


def test_projection_is_W_times_X_in_the_seed_convention() -> None:
    W, X, b = np.random.randn(4, 3), np.random.randn(3, 5), np.random.randn(4)
    np.testing.assert_allclose(mh.reference.project(W, X, b), (X.T @ W.T + b).T, rtol=0, atol=ATOL64)
    np.testing.assert_allclose(mh.reference.project(W, X), W @ X, rtol=0, atol=0)


def test_return_steps_gives_every_step_of_the_seed_table_with_its_shapes() -> None:
    d, h, s = 24, 3, 7
    d_head = d // h
    layer = _seed_layer(d, h)
    X = np.random.randn(d, s)
    O, steps = mh.reference.multi_head_attention(X, num_heads=h, causal=True, rope_base=10000.0,
                                                 return_steps=True, **reference_weights(layer))
    # Every tensor named in the seed's table is in steps.
    for _, names, _ in mh.reference.SEED_TABLE:
        for name in names.split(", "):
            assert name in steps, name
    whole = {"X": (d, s), "Q": (d, s), "K": (d, s), "V": (d, s), "concat": (d, s), "O": (d, s), "residual": (d, s)}
    for name, shape in whole.items():
        assert steps[name].shape == shape, name
    for name in ("Q_k", "K_k", "V_k", "Q_rot", "K_rot", "head_k"):
        assert len(steps[name]) == h and all(m.shape == (d_head, s) for m in steps[name]), name
    assert len(steps["A"]) == h and all(a.shape == (s, s) for a in steps["A"])
    np.testing.assert_array_equal(steps["O"], O)
    np.testing.assert_allclose(steps["residual"], X + O, rtol=0, atol=0)


def test_steps_chain_as_the_seed_describes() -> None:
    d, h, s = 24, 3, 6
    layer = _seed_layer(d, h, rope=False)
    X = np.random.randn(d, s)
    w = reference_weights(layer)
    _, st = mh.reference.multi_head_attention(X, num_heads=h, return_steps=True, **w)
    np.testing.assert_allclose(st["Q"], w["W_q"] @ X + w["b_q"][:, None], rtol=0, atol=ATOL64)
    np.testing.assert_array_equal(np.concatenate(st["Q_k"]), st["Q"])  # split is a cut of rows
    for q_k, q_rot in zip(st["Q_k"], st["Q_rot"]):
        np.testing.assert_array_equal(q_k, q_rot)  # no RoPE: the rotation step is the identity
    for i in range(h):  # head_k = V_k · A_kᵀ, A_k = softmax(Q_kᵀ K_k / √d_head)
        np.testing.assert_allclose(st["head_k"][i], st["V_k"][i] @ st["A"][i].T, rtol=0, atol=ATOL64)
    np.testing.assert_array_equal(st["concat"], np.concatenate(st["head_k"]))
    np.testing.assert_allclose(st["O"], w["W_o"] @ st["concat"] + w["b_o"][:, None], rtol=0, atol=ATOL64)


def test_attention_head_is_softmax_over_keys_scaled_by_the_given_scale() -> None:
    Q, K, V = np.random.randn(4, 3), np.random.randn(4, 5), np.random.randn(4, 5)
    head, A = mh.reference.attention_head(Q, K, V, scale=0.5)
    logits = Q.T @ K * 0.5
    want_a = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(A, want_a, rtol=0, atol=ATOL64)
    np.testing.assert_allclose(head, V @ want_a.T, rtol=0, atol=ATOL64)
    assert head.shape == (4, 3)


def test_split_heads_cuts_feature_rows_and_concat_restores_them() -> None:
    M = np.arange(24.0).reshape(6, 4)
    blocks = mh.reference.split_heads(M, 3)
    assert [b.shape for b in blocks] == [(2, 4)] * 3
    np.testing.assert_array_equal(blocks[1], M[2:4])
    np.testing.assert_array_equal(mh.reference.concat(blocks), M)


def test_gqa_query_head_uses_kv_head_floordiv_group() -> None:
    layer = mh.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=F64)
    w = reference_weights(layer)
    X = np.random.randn(16, 5)
    _, st = mh.reference.multi_head_attention(X, num_heads=4, num_kv_heads=2, return_steps=True, **w)
    assert len(st["K_k"]) == 2
    for i in range(4):
        _, A = mh.reference.attention_head(st["Q_k"][i], st["K_k"][i // 2], st["V_k"][i // 2], scale=0.5)
        np.testing.assert_allclose(st["A"][i], A, rtol=0, atol=ATOL64)


@pytest.mark.parametrize("sq, sk", [(2, 5), (4, 4), (5, 2)])
def test_reference_causal_is_bottom_right_like_masks_causal_mask(sq: int, sk: int) -> None:
    layer = mh.MultiHeadAttention(8, 2, dtype=F64)
    _, st = mh.reference.multi_head_attention(np.random.randn(8, sq), num_heads=2, causal=True,
                                              context=np.random.randn(8, sk), return_steps=True,
                                              **reference_weights(layer))
    allowed = mh.masks.causal_mask(sq, sk).numpy()
    for A in st["A"]:
        np.testing.assert_array_equal(A > 0, allowed)


def test_reference_accepts_torch_tensors_as_float64() -> None:
    layer = mh.MultiHeadAttention(8, 2)  # float32 parameters, given as tensors
    x = torch.randn(8, 3)
    O = mh.reference.multi_head_attention(x, layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight,
                                          layer.o_proj.weight, 2)
    assert O.dtype == np.float64 and O.shape == (8, 3)
