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


# ---- hostile values: refused by name, expected vs got ------------------------------------

CONFIGS = __import__("pathlib").Path(__file__).parents[1] / "data" / "configs"
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

# (rope_parameters, the field named, the value shown as "got")
HOSTILE = [
    ({"rope_type": "linear", "factor": 1e-300}, "factor", "1e-300"),
    ({"rope_type": "linear", "factor": 1e300}, "factor", "1e+300"),
    ({"rope_type": "linear", "factor": float("inf")}, "factor", "inf"),
    ({"rope_type": "linear", "factor": float("nan")}, "factor", "nan"),
    ({"rope_type": "linear", "factor": 0.0}, "factor", "0.0"),
    ({"rope_type": "dynamic", "factor": -2.0}, "factor", "-2.0"),
    ({**LLAMA3, "original_max_position_embeddings": 10**30}, "original_max_positions", str(10**30)),
    ({**LLAMA3, "original_max_position_embeddings": 0}, "original_max_positions", "0"),
    ({**LLAMA3, "low_freq_factor": 1e-300}, "low_freq_factor", "1e-300"),
    ({**LLAMA3, "high_freq_factor": float("inf")}, "high_freq_factor", "inf"),
    ({**YARN, "beta_fast": 1e300}, "beta_fast", "1e+300"),
    ({**YARN, "beta_slow": float("nan")}, "beta_slow", "nan"),
    ({**YARN, "mscale": -1.0}, "mscale", "-1.0"),
    ({**YARN, "mscale_all_dim": 1e300}, "mscale_all_dim", "1e+300"),
    ({**YARN, "attention_factor": 1e-300}, "attention_factor", "1e-300"),
    ({**YARN, "factor": 1e-300}, "factor", "1e-300"),
    ({**CASES["longrope"], "long_factor": [1.0] * 7 + [1e-300]}, "long_factor[7]", "1e-300"),
    ({**CASES["longrope"], "short_factor": [float("nan")] + [1.0] * 7}, "short_factor[0]", "nan"),
    ({**CASES["longrope"], "long_factor": [1e300] * 8}, "long_factor[0]", "1e+300"),
]


def _hostile_id(case: tuple) -> str:
    params, name, got = case
    return f"{params['rope_type']}-{name}={got}"


@pytest.mark.parametrize(("params", "name", "got"), HOSTILE, ids=[_hostile_id(c) for c in HOSTILE])
def test_hostile_scaling_values_are_refused_naming_the_field_expected_and_got(params: dict, name: str,
                                                                                got: str) -> None:
    with pytest.raises(ValueError, match=re.escape(name) + r" must be .*in \[.*\].*got " + re.escape(got)):
        mh.RopeScaling.from_hf(params, max_positions=M)


@pytest.mark.parametrize(("params", "name", "got"), HOSTILE, ids=[_hostile_id(c) for c in HOSTILE])
def test_hostile_scaling_values_are_refused_when_a_config_is_read(params: dict, name: str, got: str) -> None:
    raw = _config("meta-llama-3-8b")
    with pytest.raises(ValueError, match=r"rope_scaling: " + re.escape(name) + r" must be .*got " + re.escape(got)):
        mh.AttentionConfig.from_hf({**raw, "rope_scaling": params})


def test_an_absurd_max_position_embeddings_is_refused_for_a_scaling_that_reads_it() -> None:
    with pytest.raises(ValueError, match=r"max_positions must be .*got " + str(10**30)):
        mh.RopeScaling.from_hf({"rope_type": "dynamic", "factor": 2.0}, max_positions=10**30)


@pytest.mark.parametrize("factor", [1e-3, 1e6])
@pytest.mark.parametrize("rope_type", ["linear", "dynamic"])
def test_the_extreme_accepted_factors_give_finite_tables(rope_type: str, factor: float) -> None:
    rope = mh.RoPE(16, 10000.0, max_positions=64,
                   scaling=mh.RopeScaling(rope_type=rope_type, factor=factor, max_positions=32))
    x = torch.randn(1, 2, 64, 16)
    assert torch.isfinite(rope(x, torch.arange(64))).all()
    assert torch.isfinite(rope(x, torch.arange(64) + 4000)).all()  # past the table: on the fly


# ---- facts that need the rotary dims: checked when the config is read ---------------------

def _config(name: str) -> dict:
    import json

    return {k: v for k, v in json.loads((CONFIGS / f"{name}.json").read_text()).items() if not k.startswith("_")}


def _phi3_short_long_factor() -> tuple[dict, int]:
    raw = _config("phi-3-mini-128k")
    scaling = dict(raw["rope_scaling"])
    half = len(scaling["long_factor"])
    scaling["long_factor"] = scaling["long_factor"][:-1]
    return {**raw, "rope_scaling": scaling}, half


def test_longrope_long_factor_of_the_wrong_length_is_refused_by_from_hf() -> None:
    raw, half = _phi3_short_long_factor()
    with pytest.raises(ValueError, match=rf"long_factor must have rotary_dim/2 = {half} entries, got {half - 1}"):
        mh.AttentionConfig.from_hf(raw)


def test_longrope_long_factor_of_the_wrong_length_is_refused_by_cost() -> None:
    raw, half = _phi3_short_long_factor()
    with pytest.raises(ValueError, match=rf"long_factor must have rotary_dim/2 = {half} entries, got {half - 1}"):
        mh.cost(raw, 64)


def test_longrope_long_factor_of_the_wrong_length_is_refused_by_the_cost_command(tmp_path, capsys) -> None:
    import json

    from multihead.tools import cli

    raw, half = _phi3_short_long_factor()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["cost", str(path), "--seq", "64"])
    assert exit_info.value.code != 0
    assert f"long_factor must have rotary_dim/2 = {half} entries, got {half - 1}" in capsys.readouterr().err


def test_longrope_factors_of_the_wrong_length_are_refused_by_the_rope_itself() -> None:
    scaling = mh.RopeScaling.from_hf({**CASES["longrope"], "long_factor": LONG_FACTORS[:7]}, max_positions=M)
    with pytest.raises(ValueError, match="long_factor must have rotary_dim/2 = 8 entries, got 7"):
        mh.RoPE(16, scaling=scaling)  # before any position past the original length is asked for


def test_longrope_factors_of_the_wrong_length_are_refused_by_attention_config() -> None:
    scaling = mh.RopeScaling.from_hf({**CASES["longrope"], "long_factor": LONG_FACTORS[:7]}, max_positions=M)
    with pytest.raises(ValueError, match="long_factor must have rotary_dim/2 = 8 entries, got 7"):
        mh.AttentionConfig(embed_dim=64, num_heads=4, num_kv_heads=4, head_dim=16, rope_base=10000.0,
                           rope_scaling=scaling)


def test_dynamic_scaling_over_two_rotary_dims_is_refused_by_from_hf() -> None:
    raw = {**_config("meta-llama-3-8b"), "partial_rotary_factor": 2 / 128,
           "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(ValueError, match=r"rotary_dim must be >= 4 for rope_type='dynamic'.*got 2"):
        mh.AttentionConfig.from_hf(raw)


def test_dynamic_scaling_over_two_rotary_dims_is_refused_by_the_rope() -> None:
    scaling = mh.RopeScaling(rope_type="dynamic", factor=2.0, max_positions=8)
    with pytest.raises(ValueError, match=r"rotary_dim must be >= 4 for rope_type='dynamic'.*got 2"):
        mh.RoPE(8, rotary_dim=2, scaling=scaling)


def test_llama3_with_an_absurd_original_length_is_refused_by_from_hf_not_overflowing() -> None:
    raw = {**_config("llama-3.1-8b"), "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 10**30}}
    with pytest.raises(ValueError, match="original_max_positions"):
        mh.AttentionConfig.from_hf(raw)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.stem)
def test_every_real_config_is_still_read_and_its_rope_built(path) -> None:
    config = mh.AttentionConfig.from_hf(path)
    for kind in config.layer_kinds():
        if kind.rope_base is not None and not config.latent:
            rope = mh.RoPE(kind.head_dim, kind.rope_base, rotary_dim=config.rotary_dim, max_positions=16,
                           scaling=kind.rope_scaling)
            assert torch.isfinite(rope.cos).all()
