"""Fuzzing the config and weight readers (hypothesis, bounded, fixed seed).

Whatever bytes or JSON they are given, the readers either return a valid result or
raise ``ValueError``/``TypeError`` (``FileNotFoundError`` for a missing file) — never
another exception, never a crash or a hang. ``MULTIHEAD_PROPERTY_EXAMPLES`` scales the
number of examples as in test_properties.py.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import multihead as mh
from multihead.config import AttentionConfig
from multihead.interop import load_safetensors, load_state

SCALE = float(os.environ.get("MULTIHEAD_PROPERTY_EXAMPLES", "1"))
FUZZ = settings(max_examples=max(1, int(300 * SCALE)), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

KEYS = ["model_type", "hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head", "num_key_value_heads",
        "head_dim", "num_hidden_layers", "n_layer", "rope_theta", "rope_parameters", "partial_rotary_factor",
        "rotary_pct", "attention_bias", "qkv_bias", "max_position_embeddings", "n_positions", "sliding_window",
        "use_sliding_window", "is_decoder", "multi_query", "text_config", "query_pre_attn_scalar",
        # issue #15's fields: RoPE scaling, per-layer attention, features, latent attention
        "rope_scaling", "layer_types", "sliding_window_pattern", "attn_logit_softcapping", "max_window_layers",
        "original_max_position_embeddings", "rope_local_base_freq", "num_query_heads", "num_kv_heads", "model_dim",
        "num_transformer_layers", "depths", "num_heads", "embed_dim", "window_size", "kv_lora_rank", "q_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_type", "factor", "type"]
VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True, allow_infinity=True),
              st.sampled_from(["llama", "bert", "gpt2", "qwen2", "mistral", "vit", "gemma", "t5", "", "gemma2",
                               "gemma3_text", "openelm", "swin", "deepseek_v3", "bloom", "llama3", "yarn",
                               "longrope", "sliding_attention", "full_attention"]),
              st.text(max_size=8)),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.sampled_from(KEYS), children, max_size=4)),
    max_leaves=8,
)
BASE = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "rope_theta": 10000.0}


MODERN = [json.loads((Path(__file__).parent.parent / "data" / "configs" / name).read_text()) for name in (
    "gemma-2-9b.json", "llama-3.1-8b.json", "openelm-270m.json", "swin-tiny-patch4-window7-224.json",
    "deepseek-v3.json", "phi-3-mini-128k.json")]


def check_config_or_refusal(source: object) -> None:
    try:
        config = AttentionConfig.from_hf(source)
    except (ValueError, TypeError):
        return
    assert config.num_heads % config.num_kv_heads == 0
    assert config.head_dim >= 1 and config.embed_dim >= 1
    try:  # per-layer sums: exact, or refused (Swin's stages)
        assert mh.cost(config, 8).params_total > 0
    except ValueError as e:
        assert "other widths" in str(e)


@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=10))
@FUZZ
def test_random_config_dicts_are_read_or_refused(cfg: dict) -> None:
    check_config_or_refusal(cfg)


@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=3))
@FUZZ
def test_valid_configs_with_random_fields_replaced_are_read_or_refused(changes: dict) -> None:
    check_config_or_refusal({**BASE, **changes})


@given(st.sampled_from(range(len(MODERN))), st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=3))
@FUZZ
def test_todays_configs_with_random_fields_replaced_are_read_or_refused(which: int, changes: dict) -> None:
    check_config_or_refusal({**MODERN[which], **changes})


@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
@FUZZ
def test_random_config_files_are_read_or_refused(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_bytes(data)
        check_config_or_refusal(path)
        check_config_or_refusal(Path(tmp))


@given(st.integers(0, 10**6), st.integers(0, 255), st.integers(1, 400))
@FUZZ
def test_corrupted_config_files_are_read_or_refused(position: int, byte: int, cut: int) -> None:
    text = bytearray(json.dumps(BASE).encode())
    text[position % len(text)] = byte
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_bytes(bytes(text[: max(1, len(text) - cut % len(text))]))
        check_config_or_refusal(path)


def _valid_weights() -> bytes:
    torch.random.default_generator.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file(mh.MultiHeadAttention(8, 2).state_dict(), str(path))
        return path.read_bytes()


VALID = _valid_weights()


def check_weights_or_refusal(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        path.write_bytes(data)
        target = mh.MultiHeadAttention(8, 2)
        try:
            tensors = load_safetensors(path)
            load_state(target, tensors)
        except ValueError:
            return
        # Loaded: every parameter holds exactly the file's bits (NaN included).
        for name, value in target.state_dict().items():
            assert torch.equal(value.view(torch.int32), tensors[name].to(value.dtype).view(torch.int32)), name


@given(st.binary(max_size=400))
@FUZZ
def test_random_bytes_as_weights_are_refused(data: bytes) -> None:
    check_weights_or_refusal(data)


@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, len(VALID)))
@FUZZ
def test_corrupted_weight_files_are_loaded_or_refused(flips: list[tuple[int, int]], keep: int) -> None:
    data = bytearray(VALID)
    header = struct.unpack("<Q", bytes(data[:8]))[0]
    for pos, byte in flips:
        # Aim half of the flips at the JSON header, where the structure lives.
        data[pos % (header + 8) if byte % 2 else pos] = byte
    check_weights_or_refusal(bytes(data[: max(keep, 1)]))
