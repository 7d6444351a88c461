"""RoPE scaling: inverse frequencies and attention factors equal to transformers' own init functions.

Notation: D head dim, R rotary dims, L the length a call covers, M max_position_embeddings.
"""

from __future__ import annotations

import re

import pytest
import torch

import multihead as mh

LONG_FACTORS = [1.0 + 0.37 * i for i in range(8)]
SHORT_FACTORS = [1.0 + 0.01 * i for i in range(8)]

# rope_parameters of each type, as checkpoints spell them (Llama 3.1, Phi-3, DeepSeek-V3, ...).
CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.7},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},
    "yarn-default": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-no-truncate": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "truncate": False},
    "longrope": {"rope_type": "longrope", "long_factor": LONG_FACTORS, "short_factor": SHORT_FACTORS,
                 "original_max_position_embeddings": 64},
}
M = 256


def _hf(params: dict, *, head_dim: int = 16, partial: float = 1.0, theta: float = 500000.0):
    from transformers import LlamaConfig

    rp = dict(params, rope_theta=theta)
    if partial != 1.0:
        rp["partial_rotary_factor"] = partial
    return LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=M, rope_parameters=rp)


def _ours(params: dict, *, head_dim: int = 16, partial: float = 1.0, theta: float = 500000.0) -> mh.RoPE:
    scaling = mh.RopeScaling.from_hf(params, max_positions=M)
    return mh.RoPE(head_dim, theta, rotary_dim=int(head_dim * partial), scaling=scaling, max_positions=M)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_init_frequencies_and_attention_factor_equal_transformers_bitwise(name: str, partial: float) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = CASES[name]
    if name == "longrope" and partial != 1.0:
        params = dict(params, long_factor=LONG_FACTORS[:4], short_factor=SHORT_FACTORS[:4])
    hf_freq, hf_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](_hf(params, partial=partial), None)
    rope = _ours(params, partial=partial)
    assert torch.equal(rope.inv_freq, hf_freq)
    assert rope.attention_factor == hf_factor


@pytest.mark.parametrize("length", [M + 1, 300, 1000, 4097])
def test_dynamic_frequencies_equal_transformers_forward_at_each_length(length: int) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf(CASES["dynamic"])
    # transformers' forward passes L = max(position_ids) + 1, a tensor.
    hf_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=torch.tensor(length))
    assert torch.equal(_ours(CASES["dynamic"]).inv_freq_for(length), hf_freq)


@pytest.mark.parametrize("length", [1, 64, 65, 1000])
def test_longrope_switches_short_to_long_factors_past_the_original_length(length: int) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = CASES["longrope"]
    hf_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](_hf(params), None, seq_len=length)
    assert torch.equal(_ours(params).inv_freq_for(length), hf_freq)


@pytest.mark.parametrize("name", ["dynamic", "longrope", "yarn", "llama3"])
@pytest.mark.parametrize("length", [40, 200, 700])
def test_rotation_equals_transformers_rotary_embedding_and_apply(name: str, length: int) -> None:
    """The whole path (HF's stateful forward on a fresh module vs our stateless tables)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = _hf(CASES[name])
    positions = torch.arange(length)[None]
    q, k = torch.randn(1, 4, length, 16), torch.randn(1, 2, length, 16)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    our_q, our_k = _ours(CASES[name]).rotate((q, k), positions[0])
    torch.testing.assert_close(our_q, hf_q, rtol=0, atol=2e-6)
    torch.testing.assert_close(our_k, hf_k, rtol=0, atol=2e-6)


def test_table_and_on_the_fly_paths_agree_for_a_length_dependent_type() -> None:
    rope = _ours(CASES["longrope"])
    x = torch.randn(1, 2, 60, 16)
    inside = rope(x, torch.arange(60))  # L = 60 <= 64: the table
    assert torch.equal(inside, rope(x, torch.arange(60) + 0))
    outside = rope(x, torch.arange(40, 100))  # L = 100 > 64: long factors on the fly
    expected = mh.RoPE(16, 500000.0, max_positions=M,
                       scaling=mh.RopeScaling(rope_type="longrope", short_factor=LONG_FACTORS,
                                              long_factor=LONG_FACTORS, original_max_positions=64,
                                              max_positions=M))(x, torch.arange(40, 100))
    torch.testing.assert_close(outside, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("params", "key"), [
    ({"rope_type": "ntk-by-parts"}, "rope_type"),
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "linear", "factor": -2.0}, "factor"),
    ({"rope_type": "linear", "factor": "2"}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, "original_max"),
    ({"rope_type": "longrope", "long_factor": [1.0], "original_max_position_embeddings": 4}, "short_factor"),
    ({"rope_type": "longrope", "long_factor": [1.0, "x"], "short_factor": [1.0],
      "original_max_position_embeddings": 4}, "long_factor[1]"),
    ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4, "truncate": 1}, "truncate"),
])
def test_malformed_scaling_is_refused_naming_the_key(params: dict, key: str) -> None:
    with pytest.raises((ValueError, TypeError), match=re.escape(key)):
        mh.RopeScaling.from_hf(params, max_positions=M)


def test_longrope_factor_count_must_match_the_rotary_dims() -> None:
    scaling = mh.RopeScaling.from_hf(CASES["longrope"], max_positions=M)
    with pytest.raises(ValueError, match="short_factor must have rotary_dim/2 = 16"):
        mh.RoPE(32, scaling=scaling)
