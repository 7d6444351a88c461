"""Today's checkpoints' config.json files: per-layer attention, RoPE scaling, features, KV bytes by hand.

Notation: L layers, Hkv key/value heads, D head_dim; bf16 = 2 bytes. KV bytes per token of
a GQA/MHA model: Σ over layers of 2 (K and V) · Hkv · D · 2 bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import multihead as mh

CONFIGS = Path(__file__).parent.parent / "data" / "configs"


def _read(name: str) -> mh.AttentionConfig:
    return mh.AttentionConfig.from_hf(CONFIGS / name)


def _kv(name: str) -> int:
    return mh.cost(_read(name), 16, dtype="bfloat16").kv_cache_bytes_per_token


# (file, KV bytes per token in bf16 computed by hand from the published architecture)
KV_BY_HAND = [
    ("llama-3.1-8b.json", 32 * 2 * 8 * 128 * 2),      # 32 layers, 8 KV heads of 128 = 131072
    ("llama-3.2-1b.json", 16 * 2 * 8 * 64 * 2),       # 16 layers, 8 KV heads of 64 = 32768
    ("qwen2.5-7b.json", 28 * 2 * 4 * 128 * 2),        # 28 layers, 4 KV heads of 128 = 57344
    ("gemma-2-9b.json", 42 * 2 * 8 * 256 * 2),        # 42 layers (21 sliding, 21 full), 8 KV heads of 256
    ("gemma-3-4b.json", 34 * 2 * 4 * 256 * 2),        # 34 layers (29 local, 5 global), 4 KV heads of 256
    ("phi-3-mini-128k.json", 32 * 2 * 32 * 96 * 2),   # 32 layers, MHA 32 heads of 96 = 393216
    ("olmo-2-7b.json", 32 * 2 * 32 * 128 * 2),        # 32 layers, MHA 32 heads of 128 = 524288
    ("bloom-560m.json", 24 * 2 * 16 * 64 * 2),        # 24 layers, MHA 16 heads of 64 = 98304
    ("deepseek-v3.json", 61 * (512 + 64) * 2),        # 61 layers, latent 512 + rotary key 64 = 70272
    ("openelm-270m.json", 2 * (6 * 3 + 6 * 4 + 4 * 5) * 64 * 2),  # Σ Hkv = 62 heads of 64 = 15872
]


@pytest.mark.parametrize(("name", "expected"), KV_BY_HAND, ids=[k[0] for k in KV_BY_HAND])
def test_kv_cache_bytes_per_token_equal_hand_arithmetic(name: str, expected: int) -> None:
    assert _kv(name) == expected


def test_llama_3_1_reads_llama3_scaling() -> None:
    c = _read("llama-3.1-8b.json")
    s = c.rope_scaling
    assert (s.rope_type, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_positions) == (
        "llama3", 8.0, 1.0, 4.0, 8192)
    assert c.rope_base == 500000.0 and c.kind == "GQA" and c.layers is None


def test_llama_3_2_reads_factor_32_and_head_dim_64() -> None:
    c = _read("llama-3.2-1b.json")
    assert (c.rope_scaling.factor, c.head_dim, c.num_layers) == (32.0, 64, 16)


def test_qwen2_5_without_sliding_window_is_all_full_attention() -> None:
    c = _read("qwen2.5-7b.json")
    assert c.window is None and c.layers is None and c.num_kv_heads == 4


def test_gemma_2_alternates_sliding_and_full_with_softcap_and_query_scale() -> None:
    c = _read("gemma-2-9b.json")
    kinds = [c.layer(i).kind for i in range(c.num_layers)]
    assert kinds == ["sliding_attention", "full_attention"] * 21
    assert [c.layer(i).window for i in range(2)] == [4096, None]
    assert c.softcap == 50.0 and c.scale == 256 ** -0.5


def test_gemma_2_attention_flops_sum_the_windowed_layers_exactly() -> None:
    c, s = _read("gemma-2-9b.json"), 8192
    # per layer 4·H·D·P, P = S·K − K²/2 (causal): sliding K = 4096, full K = S
    sliding = 4 * 16 * 256 * (s * 4096 - 4096 * 4096 // 2)
    full = 4 * 16 * 256 * (s * s - s * s // 2)
    assert mh.cost(c, s).flops_attention == 21 * sliding + 21 * full


def test_gemma_3_local_layers_use_base_10000_and_global_layers_1e6_with_linear_scaling() -> None:
    c = _read("gemma-3-4b.json")
    full = [i for i in range(34) if c.layer(i).kind == "full_attention"]
    assert full == [5, 11, 17, 23, 29]
    local, glob = c.layer(0), c.layer(5)
    assert (local.window, local.rope_base, local.rope_scaling) == (1024, 10000.0, None)
    assert (glob.window, glob.rope_base, glob.rope_scaling.rope_type, glob.rope_scaling.factor) == (
        None, 1_000_000.0, "linear", 8.0)
    assert c.qk_norm == "head" and c.scale == 256 ** -0.5


def test_phi_3_reads_longrope_with_the_top_level_original_length() -> None:
    s = _read("phi-3-mini-128k.json").rope_scaling
    assert (s.rope_type, s.original_max_positions, s.max_positions, len(s.long_factor)) == (
        "longrope", 4096, 131072, 48)


def test_olmo_2_normalises_the_whole_projection() -> None:
    assert _read("olmo-2-7b.json").qk_norm == "proj"


def test_bloom_has_alibi_and_no_rope() -> None:
    c = _read("bloom-560m.json")
    assert c.alibi and c.rope_base is None and (c.num_heads, c.head_dim, c.num_layers) == (16, 64, 24)


def test_deepseek_v3_reads_latent_attention_and_its_cache_saving() -> None:
    c = _read("deepseek-v3.json")
    assert (c.kv_lora_rank, c.q_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        512, 1536, 128, 64, 128)
    assert c.head_dim == 192 and c.rope_scaling.rope_type == "yarn" and c.rope_scaling.factor == 40
    cost = mh.cost(c, 16, dtype="bfloat16")
    # decompressed: 128 heads × (192 key + 128 value) numbers vs 576 latent numbers
    assert cost.mha_kv_cache_bytes_per_token == 61 * 128 * (192 + 128) * 2
    assert cost.gqa_saving == pytest.approx(128 * 320 / 576)


def test_openelm_reads_per_layer_query_and_kv_heads() -> None:
    c = _read("openelm-270m.json")
    heads = [c.heads_in_layer(i) for i in range(16)]
    assert heads == [(12, 3)] * 6 + [(16, 4)] * 6 + [(20, 5)] * 4
    assert c.qk_norm == "head" and c.head_dim == 64


def test_openelm_parameters_sum_each_layers_heads() -> None:
    c = _read("openelm-270m.json")
    # per layer E·H·D (q) + 2·E·Hkv·D (k, v) + H·D·E (o), no biases; E = 1280, D = 64
    by_hand = sum(1280 * 64 * (2 * h + 2 * kv) for h, kv in [(12, 3)] * 6 + [(16, 4)] * 6 + [(20, 5)] * 4)
    assert mh.cost(c, 16).params_total == by_hand


def test_swin_reads_heads_and_widths_per_stage_and_cost_refuses_it() -> None:
    c = _read("swin-tiny-patch4-window7-224.json")
    assert [c.layer(i).num_heads for i in range(12)] == [3, 3, 6, 6] + [12] * 6 + [24, 24]
    assert {c.layer(i).head_dim for i in range(12)} == {32}
    assert [c.layer(i).embed_dim for i in (0, 2, 4, 10)] == [96, 192, 384, 768]
    with pytest.raises(ValueError, match="other widths"):
        mh.cost(c, 49)


def test_cost_per_layer_table_lists_each_layer() -> None:
    text = mh.cost(_read("gemma-2-9b.json"), 64).format(per_layer=True)
    assert text.count("sliding_attention") == 21 and text.count("full_attention") == 21


def test_explain_shows_each_distinct_layer_kind() -> None:
    from multihead.tools.explain import explain_config

    kinds = explain_config(CONFIGS / "gemma-3-4b.json", 8)["layer_kinds"]
    assert [(k["kind"], len(k["layers"]), k["rope_base"]) for k in kinds] == [
        ("sliding_attention", 29, 10000.0), ("full_attention", 5, 1_000_000.0)]


def test_from_config_builds_each_layer_kind() -> None:
    c = _read("gemma-3-4b.json")
    local = mh.MultiHeadAttention.from_config(c, layer=0, device="meta")
    glob = mh.MultiHeadAttention.from_config(c, layer=5, device="meta")
    assert (local.window, local.rope.base, local.rope.scaling) == (1024, 10000.0, None)
    assert (glob.window, glob.rope.base, glob.rope.scaling.factor) == (None, 1_000_000.0, 8.0)
    assert local.qk_norm == "head" and glob.scale == 256 ** -0.5


def test_config_with_layers_round_trips_through_to_dict() -> None:
    c = _read("gemma-3-4b.json")
    assert mh.AttentionConfig(**json.loads(json.dumps(c.to_dict()))) == c


def _edited(name: str, **changes: object) -> dict:
    cfg = json.loads((CONFIGS / name).read_text())
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize(("name", "changes", "match"), [
    ("gemma-2-9b.json", {"layer_types": ["sliding_attention"] * 3}, "layer_types must be a list of 42"),
    ("gemma-2-9b.json", {"layer_types": ["local"] * 42}, r"layer_types\[0\]"),
    ("gemma-2-9b.json", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ("llama-3.1-8b.json", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.*low_freq_factor"),
    ("llama-3.1-8b.json", {"rope_scaling": {"rope_type": "wild", "factor": 8.0}}, "rope_scaling.*rope_type"),
    ("llama-3.1-8b.json", {"rope_scaling": [8.0]}, "rope_scaling must be an object"),
    ("phi-3-mini-128k.json", {"rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": "x"}},
     "short_factor"),
    ("openelm-270m.json", {"num_kv_heads": [3] * 15}, "num_kv_heads must be a list of 16"),
    ("openelm-270m.json", {"num_kv_heads": [5] * 16}, r"layer 0.*num_query_heads\[0\], num_kv_heads\[0\]"),
    ("swin-tiny-patch4-window7-224.json", {"depths": [2, 2]}, "depths and num_heads"),
    ("swin-tiny-patch4-window7-224.json", {"num_heads": [3, 6, 12, 25]}, r"num_heads\[3\]=25"),
    ("deepseek-v3.json", {"kv_lora_rank": "512"}, "kv_lora_rank must be an int"),
    ("deepseek-v3.json", {"q_lora_rank": 0}, "q_lora_rank must be >= 1"),
    ("gemma-3-4b.json", {"text_config": {**json.loads((CONFIGS / "gemma-3-4b.json").read_text())["text_config"],
                                         "sliding_window_pattern": "6"}}, "sliding_window_pattern must be an int"),
])
def test_malformed_new_fields_are_refused_naming_the_key(name: str, changes: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        mh.AttentionConfig.from_hf(_edited(name, **changes))
