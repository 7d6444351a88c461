"""AttentionConfig: validation, and reading real Hugging Face config.json files.

The files in tests/data/configs are the published config.json of each model (see the
``_comment`` key of the two that are reconstructed). transformers' own config classes
are the oracle for the fields both sides read.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import torch

import multihead as mh
from multihead.config import AttentionConfig

CONFIGS = Path(__file__).parents[1] / "data" / "configs"


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


# name: (E, H, Hkv, D, L, causal, rope_base, rotary_dim, bias, o_bias, window)
REAL = {
    "gpt2": (768, 12, 12, 64, 12, True, None, None, True, True, None),
    "bert-base-uncased": (768, 12, 12, 64, 12, False, None, None, True, True, None),
    "all-MiniLM-L6-v2": (384, 12, 12, 32, 6, False, None, None, True, True, None),
    "vit-base-patch16-224": (768, 12, 12, 64, 12, False, None, None, True, True, None),
    "llama-2-7b": (4096, 32, 32, 128, 32, True, 10000.0, None, False, False, None),
    "meta-llama-3-8b": (4096, 32, 8, 128, 32, True, 500000.0, None, False, False, None),
    "mistral-7b-v0.1": (4096, 32, 8, 128, 32, True, 10000.0, None, False, False, 4096),
    "qwen2-7b": (3584, 28, 4, 128, 28, True, 1000000.0, None, True, False, None),
    "qwen3-8b": (4096, 32, 8, 128, 36, True, 1000000.0, None, False, False, None),
    "qwen3-4b": (2560, 32, 8, 128, 36, True, 1000000.0, None, False, False, None),
    "gemma-7b": (3072, 16, 16, 256, 28, True, 10000.0, None, False, False, None),
    "pythia-1b": (2048, 8, 8, 256, 16, True, 10000.0, 64, True, True, None),
    "phi-2": (2560, 32, 32, 80, 32, True, 10000.0, 32, True, True, None),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_config_gives_published_attention_shape(name):
    e, h, hkv, d, layers, causal, base, rotary, bias, o_bias, window = REAL[name]
    c = AttentionConfig.from_hf(CONFIGS / f"{name}.json")
    got = (c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers, c.causal, c.rope_base,
           c.rotary_dim, c.bias, c.effective_o_bias, c.window)
    assert got == (e, h, hkv, d, layers, causal, base, rotary, bias, o_bias, window)
    assert c.model_type == load(name)["model_type"]
    assert c.rope_interleaved is False  # every HF checkpoint here rotates halves


@pytest.mark.parametrize("name", ["llama-2-7b", "meta-llama-3-8b", "mistral-7b-v0.1", "qwen2-7b",
                                  "qwen3-4b", "gemma-7b", "phi-2", "pythia-1b"])
def test_real_config_agrees_with_transformers_reading(name):
    transformers = pytest.importorskip("transformers")
    raw = {k: v for k, v in load(name).items() if not k.startswith("_")}
    hf = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    c = AttentionConfig.from_hf(CONFIGS / f"{name}.json")
    heads = hf.num_attention_heads
    assert c.num_kv_heads == (getattr(hf, "num_key_value_heads", None) or heads)
    assert c.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    rope = hf.rope_parameters
    assert c.rope_base == rope["rope_theta"]
    assert c.effective_rotary_dim == int(c.head_dim * rope.get("partial_rotary_factor", 1.0))


def test_explicit_head_dim_wins_when_heads_times_head_dim_differs_from_width():
    c = AttentionConfig.from_hf(CONFIGS / "gemma-7b.json")
    assert c.num_heads * c.head_dim == 4096 != c.embed_dim == 3072


def test_qwen2_has_qkv_bias_but_no_output_bias():
    c = AttentionConfig.from_hf(CONFIGS / "qwen2-7b.json")
    assert (c.bias, c.o_bias, c.effective_o_bias) == (True, False, False)


def test_qwen2_use_sliding_window_false_means_no_window():
    assert load("qwen2-7b")["sliding_window"] == 131072
    assert AttentionConfig.from_hf(CONFIGS / "qwen2-7b.json").window is None


def test_from_hf_reads_a_dict_a_path_string_and_a_model_folder(tmp_path):
    shutil.copy(CONFIGS / "gpt2.json", tmp_path / "config.json")
    expected = AttentionConfig.from_hf(load("gpt2"))
    assert AttentionConfig.from_hf(str(CONFIGS / "gpt2.json")) == expected
    assert AttentionConfig.from_hf(tmp_path) == expected


def test_transformers_v5_rope_parameters_give_the_rope_base():
    raw = load("meta-llama-3-8b")
    del raw["rope_theta"]
    raw["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    assert AttentionConfig.from_hf(raw).rope_base == 500000.0


def test_rope_family_without_theta_uses_the_default_base():
    raw = load("llama-2-7b")
    assert "rope_theta" not in raw
    assert AttentionConfig.from_hf(raw).rope_base == 10000.0


def test_absolute_position_models_have_no_rope():
    for name in ("gpt2", "bert-base-uncased", "vit-base-patch16-224"):
        c = AttentionConfig.from_hf(CONFIGS / f"{name}.json")
        assert c.rope_base is None and c.effective_rotary_dim is None


def test_gptj_uses_interleaved_partial_rope():
    gptj = {"model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_layer": 28, "n_positions": 2048,
            "rotary_dim": 64}  # published EleutherAI/gpt-j-6b sizes
    c = AttentionConfig.from_hf(gptj)
    assert (c.head_dim, c.rotary_dim, c.rope_interleaved, c.bias, c.causal) == (256, 64, True, False, True)


def test_falcon_multi_query_means_one_kv_head():
    falcon = {"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71,
              "num_hidden_layers": 32, "multi_query": True, "alibi": False, "bias": False}
    c = AttentionConfig.from_hf(falcon)
    assert (c.num_kv_heads, c.kind, c.bias, c.rope_base) == (1, "MQA", False, 10000.0)


def test_alternating_sliding_and_full_layers_describe_the_full_layers():
    raw = {"model_type": "gemma2", "hidden_size": 3584, "num_attention_heads": 16, "num_key_value_heads": 8,
           "head_dim": 256, "num_hidden_layers": 42, "sliding_window": 4096, "query_pre_attn_scalar": 256}
    c = AttentionConfig.from_hf(raw)
    assert c.window is None and c.effective_scale == 1 / 16


@pytest.mark.parametrize("hint", [{"is_decoder": True}, {"is_decoder": False}, {"is_encoder_decoder": True}])
def test_unknown_model_type_is_refused_whatever_the_legacy_hints_say(hint):
    # gpt_neox_japanese says is_decoder=false and is causal; dia_decoder says is_encoder_decoder=true
    raw = {"model_type": "my_lm", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match="model_type='my_lm' is not known"):
        AttentionConfig.from_hf({**raw, **hint})


def test_falcon_7b_as_saved_by_transformers_has_one_kv_head():
    # FalconConfig.save_pretrained writes num_kv_heads=71; transformers uses it only without multi_query
    falcon = {"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71, "num_kv_heads": 71,
              "num_hidden_layers": 32, "multi_query": True, "new_decoder_architecture": False, "alibi": False}
    c = AttentionConfig.from_hf(falcon)
    assert c.num_kv_heads == 1
    assert mh.cost(c, 1, dtype=torch.float16).kv_cache_bytes_per_token == 32 * 2 * 64 * 2  # 8 KiB
    no_key = {k: v for k, v in falcon.items() if k != "multi_query"}  # FalconConfig's default is multi_query
    assert AttentionConfig.from_hf(no_key).num_kv_heads == 1
    assert AttentionConfig.from_hf({**falcon, "multi_query": False}).num_kv_heads == 71


@pytest.mark.parametrize("changes, message", [({"new_decoder_architecture": True}, "new_decoder_architecture"),
                                              ({"alibi": True}, "alibi")])
def test_falcon_variants_the_config_cannot_describe_are_refused(changes, message):
    falcon = {"model_type": "falcon", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match=message):
        AttentionConfig.from_hf({**falcon, **changes})


def test_albert_shared_layers_are_refused():
    albert = {"model_type": "albert", "hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12,
              "num_hidden_groups": 1}
    with pytest.raises(ValueError, match="num_hidden_groups"):
        AttentionConfig.from_hf(albert)


def test_per_layer_head_lists_become_layer_num_heads():
    raw = {"model_type": "vit", "hidden_size": 768, "num_attention_heads": [12, 6, 12], "head_dim": 64,
           "num_hidden_layers": 3}
    c = AttentionConfig.from_hf(raw)
    assert c.layer_num_heads == (12, 6, 12) and c.num_heads == 12
    assert c.heads_in_layer(1) == (6, 6)


def test_multimodal_config_is_read_from_text_config():
    outer = {"model_type": "llava", "text_config": load("llama-2-7b"), "vision_config": {}}
    assert AttentionConfig.from_hf(outer) == AttentionConfig.from_hf(load("llama-2-7b"))


def test_to_dict_round_trips():
    c = AttentionConfig(embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2,
                        layer_num_heads=[4, 2])
    d = c.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert AttentionConfig(**d) == c


def test_derived_properties():
    c = AttentionConfig(embed_dim=4096, num_heads=32, num_kv_heads=8, head_dim=128, rope_base=1e4)
    assert (c.kv_group_size, c.kind, c.effective_rotary_dim, c.effective_o_bias) == (4, "GQA", 128, True)
    assert c.effective_scale == pytest.approx(128 ** -0.5)


# ---- validation of the dataclass itself -------------------------------------------------

GOOD = dict(embed_dim=64, num_heads=4, num_kv_heads=4, head_dim=16)
BAD_FIELDS = [
    ({"num_kv_heads": 3}, ValueError, "num_kv_heads"),
    ({"embed_dim": 0}, ValueError, "embed_dim"),
    ({"embed_dim": 1 << 21}, ValueError, "embed_dim"),
    ({"num_heads": 4096, "num_kv_heads": 1, "head_dim": 512}, ValueError, "num_heads \\* head_dim"),
    ({"num_layers": 10_001}, ValueError, "num_layers"),
    ({"head_dim": True}, TypeError, "head_dim"),
    ({"num_heads": 4.0}, TypeError, "num_heads"),
    ({"rope_base": 0.0}, ValueError, "rope_base"),
    ({"rope_base": 1e4, "rotary_dim": 7}, ValueError, "rotary_dim"),
    ({"rope_base": 1e4, "rotary_dim": 32}, ValueError, "rotary_dim"),
    ({"rotary_dim": 8}, ValueError, "rope_base"),
    ({"causal": 1}, TypeError, "causal"),
    ({"scale": float("nan")}, ValueError, "scale"),
    ({"window": 0}, ValueError, "window"),
    ({"layer_num_heads": (4, 4)}, ValueError, "layer_num_heads"),
    ({"layer_num_heads": (2,), "num_kv_heads": 4}, ValueError, "num_heads"),
]


@pytest.mark.parametrize(("changes", "error", "field"), BAD_FIELDS)
def test_bad_fields_are_refused_and_named(changes, error, field):
    with pytest.raises(error, match=field):
        AttentionConfig(**{**GOOD, **changes})


# ---- bad config.json files and dicts ----------------------------------------------------

def _gpt2_cut_in_half() -> str:
    text = (CONFIGS / "gpt2.json").read_text()
    return text[: len(text) // 2]


BAD_FILES = [
    ("malformed.json", '{"hidden_size": 768,, }', "not valid JSON"),
    ("truncated.json", _gpt2_cut_in_half(), "not valid JSON"),
    ("empty.json", "", "not valid JSON"),
    ("list.json", "[1, 2, 3]", "top level must be a JSON object"),
    ("nan.json", '{"hidden_size": NaN}', "NaN"),
    ("latin1.json", b'{"model_type": "\xe9"}', "cannot be read"),
]


@pytest.mark.parametrize(("filename", "content", "message"), BAD_FILES)
def test_unreadable_files_raise_value_error_naming_the_path(tmp_path, filename, content, message):
    path = tmp_path / filename
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=message) as info:
        AttentionConfig.from_hf(path)
    assert str(path) in str(info.value)


def test_missing_file_and_folder_without_config_raise_value_error(tmp_path):
    for path in (tmp_path / "nope.json", tmp_path):
        with pytest.raises(ValueError, match=re.escape(str(path))):
            AttentionConfig.from_hf(path)


def test_source_of_the_wrong_type_raises_type_error():
    with pytest.raises(TypeError, match="source"):
        AttentionConfig.from_hf(42)


LLAMA = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "num_hidden_layers": 32}
BAD_CONFIGS = [
    ({"hidden_size": None}, ValueError, "hidden_size, n_embd, d_model"),
    ({"num_attention_heads": None}, ValueError, "num_attention_heads"),
    ({"num_hidden_layers": None}, ValueError, "num_hidden_layers"),
    ({"n_embd": 2048}, ValueError, "hidden_size=4096 and n_embd=2048"),
    ({"num_attention_heads": 30, "num_key_value_heads": 6}, ValueError,
     "hidden_size=4096 must be divisible by num_attention_heads=30"),
    ({"num_key_value_heads": 5}, ValueError, "num_key_value_heads=5"),
    ({"hidden_size": "4096"}, TypeError, "hidden_size must be an int, got str"),
    ({"num_attention_heads": True}, TypeError, "num_attention_heads must be an int, got bool"),
    ({"num_hidden_layers": 32.0}, TypeError, "num_hidden_layers must be an int, got float"),
    ({"hidden_size": 0}, ValueError, "hidden_size must be >= 1"),
    ({"hidden_size": 1 << 21, "head_dim": 128}, ValueError, "embed_dim"),
    ({"num_hidden_layers": 100_000}, ValueError, "num_layers"),
    ({"model_type": "mystery"}, ValueError, "model_type='mystery' is not known.*llama"),
    ({"model_type": 7}, TypeError, "model_type must be a str"),
    ({"rope_theta": -1.0}, ValueError, "rope_theta must be a finite number > 0"),
    ({"rope_theta": "10000"}, TypeError, "rope_theta must be a float"),
    ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5}}, ValueError, "contradict"),
    ({"partial_rotary_factor": 1.5}, ValueError, "partial rotary factor"),
    ({"head_dim": 100, "partial_rotary_factor": 0.25}, ValueError, "rotary_dim must be even"),
    ({"attention_bias": "no"}, TypeError, "attention_bias must be true or false"),
    ({"sliding_window": "4096"}, TypeError, "sliding_window must be an int"),
    ({"num_attention_heads": [32, 16], "num_hidden_layers": 3}, ValueError, "one per layer"),
    ({"num_attention_heads": [32, 16], "num_hidden_layers": 2, "hidden_size": 4096}, ValueError, "head_dim"),
]


@pytest.mark.parametrize(("changes", "error", "message"), BAD_CONFIGS)
def test_bad_configs_raise_errors_naming_the_field(tmp_path, changes, error, message):
    raw = {k: v for k, v in {**LLAMA, **changes}.items() if v is not None}
    with pytest.raises(error, match=message):
        AttentionConfig.from_hf(raw)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(error, match=re.escape(str(path))):
        AttentionConfig.from_hf(path)


def test_check_overrides_lets_the_settings_replace_the_defaults():
    from multihead.config import OVERRIDABLE, check_overrides

    defaults = {"causal": True, "scale": None, "window": 8}
    got = check_overrides(defaults, {"window": None, "backend": "sdpa"})
    assert got == {"causal": True, "scale": None, "window": None, "backend": "sdpa"}
    assert defaults == {"causal": True, "scale": None, "window": 8}  # a new dict: the defaults are kept
    assert OVERRIDABLE == {"causal", "dropout", "scale", "window", "backend", "rope"}


def test_check_overrides_refuses_sizes_listing_what_may_be_set():
    from multihead.config import check_overrides

    with pytest.raises(ValueError, match=r"may only set \['backend', 'causal'.*got \['head_dim', 'num_heads'\]"):
        check_overrides({"causal": True}, {"num_heads": 4, "head_dim": 8, "causal": False})
