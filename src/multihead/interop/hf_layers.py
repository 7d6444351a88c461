"""A Hugging Face config dict to an :class:`~multihead.AttentionConfig`: :func:`read`.

Notation: E embed_dim, H query heads, Hkv key/value heads, D head_dim, L layers, W window.

:func:`parse` reads what every layer shares (sizes, causality, bias, RoPE, window, scale);
:func:`extend` adds RoPE scaling (``rope_scaling`` / ``rope_parameters``), QK-norm,
soft-capping, ALiBi, sinks, and ``layers`` where layers differ — from ``layer_types``,
``sliding_window_pattern`` (Gemma 3: every P-th layer is full), Gemma 2's alternation (even
layers sliding), Qwen2's ``max_window_layers``. :data:`SPECIAL` reads the families whose
files use their own keys: OpenELM (per-layer ``num_query_heads``/``num_kv_heads``), Swin
(``num_heads`` per stage with ``depths``), DeepSeek-V2/V3 (latent attention sizes).

The facts (which model types, which keys) and the readers of one value are
:mod:`multihead.interop.hf_config`'s; every error names the file and the key.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..config import AttentionConfig, LayerAttention
from ..rope_scaling import RopeScaling
from .hf_config import (DECODERS, DEFAULT_ROPE_BASE, ENCODERS, INTERLEAVED_ROPE, KEYS_ALL_BIAS, KEYS_HEAD_DIM,
                        KEYS_HEADS, KEYS_KV_HEADS, KEYS_LAYERS, KEYS_POSITIONS, KEYS_QKV_BIAS, KEYS_WIDTH,
                        MAX_TEXT_CONFIG_DEPTH, as_int, optional_bool, optional_int, optional_number, pick, read_json,
                        required, rope_base, rope_parameters, rope_scaling, rotary_factor)

__all__ = ["read", "parse", "extend", "SPECIAL"]

#: QK-norm shape by model type.
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "olmo2": "proj"}
LAYER_TYPES = ("full_attention", "sliding_attention")


def read(source: Mapping[str, Any] | str | os.PathLike[str]) -> AttentionConfig:
    """A Hugging Face config (a dict, a config.json path, or a folder holding one) as an AttentionConfig.

    What :meth:`multihead.AttentionConfig.from_hf` returns (its docstring lists the rules).

    Raises:
        ValueError: unreadable or non-JSON file, missing or contradictory fields, unknown
            model types; the message names the file and the field.
        TypeError: ``source`` of the wrong type, or a field of the wrong type.
    """
    if isinstance(source, Mapping):
        return parse(source, "config")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return parse(read_json(path / "config.json" if path.is_dir() else path), str(path))
    raise TypeError(f"source must be a dict, a path to config.json or a folder, got {type(source).__name__}")


def parse(cfg: Mapping[str, Any], src: str) -> AttentionConfig:
    """Map one HF config dict to an AttentionConfig; every error names ``src`` and the key."""
    text = cfg.get("text_config")
    if pick(cfg, KEYS_WIDTH, src) is None and isinstance(text, Mapping):
        if src.count("text_config") >= MAX_TEXT_CONFIG_DEPTH:
            raise ValueError(f"{src}: text_config nested more than {MAX_TEXT_CONFIG_DEPTH} levels deep")
        return parse(text, f"{src} text_config")
    model_type = cfg.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise TypeError(f"{src}: model_type must be a str, got {type(model_type).__name__} {model_type!r}")
    # per-layer head lists, latent attention: keys of their own
    if model_type is not None and model_type in SPECIAL:
        return SPECIAL[model_type](cfg, src)

    width_key, width = required(cfg, KEYS_WIDTH, src)
    width = as_int(width, width_key, src)
    heads_key, heads = required(cfg, KEYS_HEADS, src)
    layer_heads = None
    if isinstance(heads, list):  # per-layer head counts
        layer_heads = tuple(as_int(h, f"{heads_key}[{i}]", src) for i, h in enumerate(heads))
        if not layer_heads:
            raise ValueError(f"{src}: {heads_key} must not be an empty list")
        heads = max(layer_heads)
    else:
        heads = as_int(heads, heads_key, src)
    layers_key, layers = required(cfg, KEYS_LAYERS, src)
    layers = as_int(layers, layers_key, src)
    if layer_heads is not None and len(layer_heads) != layers:
        raise ValueError(f"{src}: {heads_key} has {len(layer_heads)} entries, expected one per layer ({layers})")

    head_dim = optional_int(cfg, KEYS_HEAD_DIM, src)
    if head_dim is None:
        if layer_heads is not None and len(set(layer_heads)) > 1:
            raise ValueError(f"{src}: {heads_key} varies by layer, so head_dim must be given explicitly")
        if width % heads:
            raise ValueError(f"{src}: {width_key}={width} must be divisible by {heads_key}={heads} "
                             "when head_dim is not given")
        head_dim = width // heads

    kv_key, kv_heads = pick(cfg, KEYS_KV_HEADS, src) or (None, None)
    if model_type == "falcon":
        kv_key, kv_heads = _falcon_kv_heads(cfg, heads, kv_key, kv_heads, src)
    if model_type == "albert" and cfg.get("num_hidden_groups", 1) != layers:
        raise ValueError(f"{src}: ALBERT shares its layers (num_hidden_groups={cfg.get('num_hidden_groups', 1)}, "
                         f"num_hidden_layers={layers}): one config per distinct layer is not supported")
    if optional_bool(cfg, "alibi", src):
        raise ValueError(f"{src}: alibi=true (ALiBi position biases) is not supported")
    if kv_heads is None:
        kv_heads = 1 if optional_bool(cfg, "multi_query", src) else heads
    elif heads % as_int(kv_heads, kv_key or KEYS_KV_HEADS[0], src) or any(h % kv_heads for h in layer_heads or ()):
        raise ValueError(f"{src}: {heads_key}={list(layer_heads) if layer_heads else heads} must be "
                         f"divisible by {kv_key}={kv_heads}")

    causal = _causal(cfg, model_type, src)
    bias, o_bias = _bias(cfg, model_type, src)
    theta, rotary_dim = _rope(cfg, model_type, head_dim, src)
    try:
        config = AttentionConfig(
            embed_dim=width, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            num_layers=layers, causal=causal, bias=bias, o_bias=o_bias, rope_base=theta,
            rope_interleaved=theta is not None and model_type in INTERLEAVED_ROPE,
            rotary_dim=rotary_dim, max_positions=optional_int(cfg, KEYS_POSITIONS, src),
            window=_window(cfg, model_type, src), scale=_scale(cfg, src), model_type=model_type,
            layer_num_heads=layer_heads,
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"{src}: {e}") from e
    return extend(config, cfg, model_type, src)  # RoPE scaling, QK-norm, ..., per-layer attention


def _falcon_kv_heads(cfg: Mapping[str, Any], heads: int, key: str | None, value: Any,
                     src: str) -> tuple[str | None, Any]:
    """FalconConfig's rule: ``num_kv_heads`` counts only with ``new_decoder_architecture`` or
    ``multi_query=false``; ``multi_query`` defaults to true (Falcon-7B: 1 KV head, though its
    saved config says num_kv_heads=71)."""
    if optional_bool(cfg, "new_decoder_architecture", src):
        # transformers caches K/V expanded to all H heads there, unlike the weights' Hkv.
        raise ValueError(f"{src}: Falcon's new_decoder_architecture is not supported (its KV cache holds "
                         f"every query head, not num_kv_heads)")
    if optional_bool(cfg, "multi_query", src) is not False:
        return "multi_query", 1
    return key, heads if value is None else value


def _causal(cfg: Mapping[str, Any], model_type: str | None, src: str) -> bool:
    if model_type in ENCODERS:
        return False
    if model_type in DECODERS:
        return True
    # The legacy is_decoder / is_encoder_decoder flags do not decide: every v4 config wrote
    # is_decoder=false (GPT-NeoX-Japanese, MusicGen's decoder are causal nonetheless) and
    # decoder configs carry is_encoder_decoder=true (Canary's, Dia's decoder).
    known = ", ".join(sorted(ENCODERS | set(DECODERS)))
    raise ValueError(f"{src}: model_type={model_type!r} is not known (its causality, heads and KV cache are "
                     f"not read by guesswork); known model types: {known}")


def _bias(cfg: Mapping[str, Any], model_type: str | None, src: str) -> tuple[bool, bool | None]:
    qkv, out, _ = DECODERS.get(model_type or "", (True, True, False))  # encoders and unknown: nn.Linear default
    for key in KEYS_ALL_BIAS:
        value = optional_bool(cfg, key, src)
        if value is not None:
            qkv = out = value
    for key in KEYS_QKV_BIAS:
        value = optional_bool(cfg, key, src)
        if value is not None:
            qkv = value
    return qkv, (None if out == qkv else out)


def _rope(cfg: Mapping[str, Any], model_type: str | None, head_dim: int, src: str) -> tuple[float | None, int | None]:
    """(θ, rotary_dim) of the typical layer: RoPE where the family has it (or, for a family
    :data:`DECODERS` does not list, where θ is given), and never with ALiBi."""
    params = rope_parameters(cfg, "full_attention", src)  # mixed layer types (Gemma 3): the full-attention layers
    base = rope_base(cfg, params, src)
    has_rope = DECODERS[model_type][2] if model_type is not None and model_type in DECODERS else base is not None
    if not has_rope or optional_bool(cfg, "alibi", src):
        return None, None
    base = DEFAULT_ROPE_BASE if base is None else base
    explicit = optional_int(cfg, ("rotary_dim",), src)
    factor = rotary_factor(cfg, params, src)
    rotary = explicit if explicit is not None else (None if factor in (None, 1.0) else int(head_dim * factor))
    return base, rotary


def _window(cfg: Mapping[str, Any], model_type: str | None, src: str) -> int | None:
    window = optional_int(cfg, ("sliding_window",), src)
    if window is None or optional_bool(cfg, "use_sliding_window", src) is False:
        return None
    layer_types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern")
    mixed = (model_type == "gemma2" or (isinstance(pattern, int) and pattern > 1)
             or (isinstance(layer_types, list) and len(set(map(str, layer_types))) > 1))
    return None if mixed else window


def _scale(cfg: Mapping[str, Any], src: str) -> float | None:
    if optional_bool(cfg, "scale_attn_weights", src) is False:
        return 1.0  # GPT-2 option: raw dot products
    scalar = optional_number(cfg, "query_pre_attn_scalar", src)  # Gemma 2/3
    return None if scalar is None else 1.0 / math.sqrt(scalar)


def extend(base: AttentionConfig, cfg: Mapping[str, Any], model_type: str | None, src: str) -> AttentionConfig:
    """``base`` with the features and per-layer attention of ``cfg``."""
    features: dict[str, Any] = {}
    if base.rope_base is not None:
        features["rope_scaling"] = rope_scaling(cfg, rope_parameters(cfg, "full_attention", src), src)
    features["qk_norm"] = QK_NORM.get(model_type) if model_type is not None else None
    softcap = optional_number(cfg, "attn_logit_softcapping", src)
    features["softcap"] = softcap
    features["alibi"] = model_type == "bloom" or bool(optional_bool(cfg, "alibi", src))
    features["sinks"] = model_type == "gpt_oss"
    kinds = _layer_types(cfg, model_type, base.num_layers, src)
    if kinds is not None and len(set(kinds)) > 1:
        features["layers"] = _mixed_layers(base, cfg, kinds, features.get("rope_scaling"), src)
    return dataclasses.replace(base, **features)


def _layer_types(cfg: Mapping[str, Any], model_type: str | None, layers: int, src: str) -> list[str] | None:
    """Each layer's type, or None when all layers are alike."""
    given = cfg.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or len(given) != layers:
            raise ValueError(f"{src}: layer_types must be a list of {layers} entries (one per layer), got "
                             f"{type(given).__name__} of {len(given) if isinstance(given, list) else '?'}")
        for i, kind in enumerate(given):
            if kind not in LAYER_TYPES:
                raise ValueError(f"{src}: layer_types[{i}] must be one of {list(LAYER_TYPES)}, got {kind!r}")
        return list(given)
    if cfg.get("sliding_window") is None or optional_bool(cfg, "use_sliding_window", src) is False:
        return None
    pattern = cfg.get("sliding_window_pattern")
    if pattern is not None:
        pattern = as_int(pattern, "sliding_window_pattern", src)
        return [LAYER_TYPES[(i + 1) % pattern != 0] for i in range(layers)]  # every P-th layer is full
    if model_type == "gemma2":
        return [LAYER_TYPES[(i + 1) % 2] for i in range(layers)]  # even layers slide
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and cfg.get("max_window_layers") is not None:
        first = as_int(cfg["max_window_layers"], "max_window_layers", src)
        return [LAYER_TYPES[i >= first] for i in range(layers)]
    return None


def _mixed_layers(base: AttentionConfig, cfg: Mapping[str, Any], kinds: list[str], scaling: RopeScaling | None,
                  src: str) -> tuple[LayerAttention, ...]:
    window = optional_int(cfg, ("sliding_window",), src)
    if window is None:
        raise ValueError(f"{src}: layer_types has sliding_attention layers but sliding_window is missing")
    local_base, local_scaling = base.rope_base, scaling
    if base.rope_base is not None:
        params = cfg.get("rope_parameters")
        if isinstance(params, Mapping) and isinstance(params.get("sliding_attention"), Mapping):
            local = params["sliding_attention"]
            local_base = optional_number(local, "rope_theta", f"{src} rope_parameters.sliding_attention")
            local_scaling = rope_scaling({}, local, src)
        elif cfg.get("rope_local_base_freq") is not None:  # Gemma 3 before transformers v5: local layers unscaled
            local_base, local_scaling = optional_number(cfg, "rope_local_base_freq", src), None
    full = LayerAttention(num_heads=base.num_heads, num_kv_heads=base.num_kv_heads, head_dim=base.head_dim,
                          rope_base=base.rope_base, rope_scaling=scaling, kind="full_attention")
    sliding = dataclasses.replace(full, window=window, rope_base=local_base, rope_scaling=local_scaling,
                                  kind="sliding_attention")
    return tuple(full if kind == "full_attention" else sliding for kind in kinds)


def _openelm(cfg: Mapping[str, Any], src: str) -> AttentionConfig:
    """OpenELM: per-layer ``num_query_heads`` and ``num_kv_heads`` lists, one ``head_dim``."""
    width = as_int(cfg.get("model_dim"), "model_dim", src)
    layers = as_int(cfg.get("num_transformer_layers"), "num_transformer_layers", src)
    head_dim = as_int(cfg.get("head_dim"), "head_dim", src)
    lists = {}
    for key in ("num_query_heads", "num_kv_heads"):
        value = cfg.get(key)
        if not isinstance(value, list) or len(value) != layers:
            raise ValueError(f"{src}: {key} must be a list of {layers} ints (one per layer), got {value!r:.60}")
        lists[key] = [as_int(n, f"{key}[{i}]", src) for i, n in enumerate(value)]
    base = optional_number(cfg, "rope_freq_constant", src) or DEFAULT_ROPE_BASE
    per_layer = []
    for i, (q, kv) in enumerate(zip(lists["num_query_heads"], lists["num_kv_heads"])):
        try:
            per_layer.append(LayerAttention(num_heads=q, num_kv_heads=kv, head_dim=head_dim, rope_base=base))
        except ValueError as e:
            raise ValueError(f"{src}: layer {i}: {e} (num_query_heads[{i}], num_kv_heads[{i}])") from e
    first = per_layer[0]
    return AttentionConfig(embed_dim=width, num_heads=first.num_heads, num_kv_heads=first.num_kv_heads,
                           head_dim=head_dim, num_layers=layers, causal=True, bias=False, rope_base=base,
                           max_positions=optional_int(cfg, ("max_context_length",), src), model_type="openelm",
                           qk_norm="head" if optional_bool(cfg, "normalize_qk_projections", src) else None,
                           layers=tuple(per_layer))


def _stage_list(cfg: Mapping[str, Any], key: str, src: str) -> list[Any]:
    """``cfg[key]``, checked to be a non-empty list (one entry per stage)."""
    value = cfg.get(key)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{src}: {key} must be a non-empty list (one entry per stage), got {value!r:.60}")
    return value


def _swin(cfg: Mapping[str, Any], src: str) -> AttentionConfig:
    """Swin: ``num_heads`` per stage, ``depths`` layers per stage, the width doubling by stage."""
    width = as_int(cfg.get("embed_dim"), "embed_dim", src)
    depths, heads = _stage_list(cfg, "depths", src), _stage_list(cfg, "num_heads", src)
    if len(depths) != len(heads):
        raise ValueError(f"{src}: depths and num_heads must have one entry per stage, got {len(depths)} and "
                         f"{len(heads)}")
    window = as_int(cfg.get("window_size", 7), "window_size", src)
    per_layer = []
    for stage, (depth, n) in enumerate(zip(depths, heads)):
        depth, n = as_int(depth, f"depths[{stage}]", src), as_int(n, f"num_heads[{stage}]", src)
        stage_width = width * 2 ** stage
        if stage_width % n:
            raise ValueError(f"{src}: stage {stage} width {stage_width} is not divisible by num_heads[{stage}]={n}")
        per_layer += [LayerAttention(num_heads=n, num_kv_heads=n, head_dim=stage_width // n, embed_dim=stage_width,
                                     kind=f"window {window}x{window}, stage {stage}")] * depth
    first = per_layer[0]
    return AttentionConfig(embed_dim=width, num_heads=first.num_heads, num_kv_heads=first.num_heads,
                           head_dim=first.head_dim, num_layers=len(per_layer), causal=False,
                           bias=bool(optional_bool(cfg, "qkv_bias", src) is not False), model_type="swin",
                           layers=tuple(per_layer))


def _deepseek(cfg: Mapping[str, Any], src: str) -> AttentionConfig:
    """DeepSeek-V2/V3: multi-head latent attention sizes under their own names.

    RoPE pairing: V2 always interleaved (complex pairs (2p, 2p+1)); V3 interleaved when
    ``rope_interleave`` is true (its default when absent), rotate-half when false or null,
    as transformers' ``if self.config.rope_interleave``.
    """
    sizes = {key: as_int(cfg.get(key), key, src)
             for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "kv_lora_rank",
                         "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    q_rank = cfg.get("q_lora_rank")
    q_rank = None if q_rank is None else as_int(q_rank, "q_lora_rank", src)
    heads = sizes["num_attention_heads"]
    params = rope_parameters(cfg, None, src)  # transformers v5 nests rope_theta and the scaling here
    base = (optional_number(params, "rope_theta", f"{src} rope_parameters")
            or optional_number(cfg, "rope_theta", src) or DEFAULT_ROPE_BASE)
    try:
        return AttentionConfig(
            embed_dim=sizes["hidden_size"], num_heads=heads, num_kv_heads=heads,
            head_dim=sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"], num_layers=sizes["num_hidden_layers"],
            causal=True, bias=bool(optional_bool(cfg, "attention_bias", src)), o_bias=False, rope_base=base,
            rotary_dim=sizes["qk_rope_head_dim"], max_positions=optional_int(cfg, KEYS_POSITIONS, src),
            rope_interleaved=cfg.get("model_type") == "deepseek_v2" or bool(cfg.get("rope_interleave", True)),
            model_type=cfg.get("model_type"), rope_scaling=rope_scaling(cfg, params, src),
            kv_lora_rank=sizes["kv_lora_rank"], q_lora_rank=q_rank, qk_nope_head_dim=sizes["qk_nope_head_dim"],
            qk_rope_head_dim=sizes["qk_rope_head_dim"], v_head_dim=sizes["v_head_dim"])
    except (TypeError, ValueError) as e:
        raise type(e)(f"{src}: {e}") from e


#: Families read by their own function (their files use keys of their own).
SPECIAL: Mapping[str, Callable[[Mapping[str, Any], str], AttentionConfig]] = {
    "openelm": _openelm, "swin": _swin, "deepseek_v3": _deepseek,
    "deepseek_v2": _deepseek,  # V3's keys and computation, RoPE always interleaved (tests/interop/test_deepseek.py)
    # DeepseekV3Attention's copies (hf_copies.COPIES), with V3's config keys
    "glm4_moe_lite": _deepseek, "youtu": _deepseek, "sarvam_mla": _deepseek,
}
