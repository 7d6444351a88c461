"""Reading what differs between layers, and the newer attention features, from a HF config.

Notation: E embed_dim, H query heads, Hkv key/value heads, D head_dim, L layers, W window.

:func:`extend` adds to the :class:`~multihead.AttentionConfig` that
:func:`multihead.interop.hf_config.parse` read: RoPE scaling (``rope_scaling`` /
``rope_parameters``), QK-norm, soft-capping, ALiBi, sinks, and ``layers`` where layers
differ — from ``layer_types``, ``sliding_window_pattern`` (Gemma 3: every P-th layer is
full), Gemma 2's alternation (even layers sliding), Qwen2's ``max_window_layers``.
:data:`SPECIAL` reads the families whose files use their own keys: OpenELM (per-layer
``num_query_heads``/``num_kv_heads``), Swin (``num_heads`` per stage with ``depths``),
DeepSeek-V2/V3 (latent attention sizes). Every error names the file and the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..config import AttentionConfig, LayerAttention
from ..rope_scaling import RopeScaling

__all__ = ["extend", "SPECIAL"]

#: QK-norm shape by model type.
QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "olmo2": "proj"}
LAYER_TYPES = ("full_attention", "sliding_attention")


def _hf():  # the helpers of hf_config (imported late: it imports this module)
    from . import hf_config
    return hf_config


def rope_scaling(cfg: Mapping[str, Any], params: Mapping[str, Any], src: str) -> RopeScaling | None:
    """The RoPE scaling of ``params`` (one layer type's ``rope_parameters``) or of ``rope_scaling``."""
    h = _hf()
    scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else None
    legacy = cfg.get("rope_scaling")
    if scaling is None and legacy is not None:
        if not isinstance(legacy, Mapping):
            raise TypeError(f"{src}: rope_scaling must be an object or null, got {type(legacy).__name__}")
        scaling = legacy
    if scaling is None:
        return None
    scaling = dict(scaling)
    if scaling.get("type") == "su":  # Phi-3's first name for longrope
        scaling["type"] = "longrope"
    scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    try:
        return RopeScaling.from_hf(scaling, max_positions=h._optional_int(cfg, h._KEYS_POSITIONS, src))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{src}: rope_scaling: {e}") from e


def extend(base: AttentionConfig, cfg: Mapping[str, Any], model_type: str | None, src: str) -> AttentionConfig:
    """``base`` with the features and per-layer attention of ``cfg``."""
    h = _hf()
    features: dict[str, Any] = {}
    if base.rope_base is not None:
        features["rope_scaling"] = rope_scaling(cfg, h.rope_parameters(cfg, "full_attention", src), src)
    features["qk_norm"] = QK_NORM.get(model_type) if model_type is not None else None
    softcap = h._optional_number(cfg, "attn_logit_softcapping", src)
    features["softcap"] = softcap
    features["alibi"] = model_type == "bloom" or bool(h._optional_bool(cfg, "alibi", src))
    features["sinks"] = model_type == "gpt_oss"
    kinds = _layer_types(cfg, model_type, base.num_layers, src)
    if kinds is not None and len(set(kinds)) > 1:
        features["layers"] = _mixed_layers(base, cfg, kinds, features.get("rope_scaling"), src)
    return dataclasses.replace(base, **features)


def _layer_types(cfg: Mapping[str, Any], model_type: str | None, layers: int, src: str) -> list[str] | None:
    """Each layer's type, or None when all layers are alike."""
    h = _hf()
    given = cfg.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or len(given) != layers:
            raise ValueError(f"{src}: layer_types must be a list of {layers} entries (one per layer), got "
                             f"{type(given).__name__} of {len(given) if isinstance(given, list) else '?'}")
        for i, kind in enumerate(given):
            if kind not in LAYER_TYPES:
                raise ValueError(f"{src}: layer_types[{i}] must be one of {list(LAYER_TYPES)}, got {kind!r}")
        return list(given)
    if cfg.get("sliding_window") is None or h._optional_bool(cfg, "use_sliding_window", src) is False:
        return None
    pattern = cfg.get("sliding_window_pattern")
    if pattern is not None:
        pattern = h._as_int(pattern, "sliding_window_pattern", src)
        return [LAYER_TYPES[(i + 1) % pattern != 0] for i in range(layers)]  # every P-th layer is full
    if model_type == "gemma2":
        return [LAYER_TYPES[(i + 1) % 2] for i in range(layers)]  # even layers slide
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and cfg.get("max_window_layers") is not None:
        first = h._as_int(cfg["max_window_layers"], "max_window_layers", src)
        return [LAYER_TYPES[i >= first] for i in range(layers)]
    return None


def _mixed_layers(base: AttentionConfig, cfg: Mapping[str, Any], kinds: list[str], scaling: RopeScaling | None,
                  src: str) -> tuple[LayerAttention, ...]:
    h = _hf()
    window = h._optional_int(cfg, ("sliding_window",), src)
    if window is None:
        raise ValueError(f"{src}: layer_types has sliding_attention layers but sliding_window is missing")
    local_base, local_scaling = base.rope_base, scaling
    if base.rope_base is not None:
        params = cfg.get("rope_parameters")
        if isinstance(params, Mapping) and isinstance(params.get("sliding_attention"), Mapping):
            local = params["sliding_attention"]
            local_base = h._optional_number(local, "rope_theta", f"{src} rope_parameters.sliding_attention")
            local_scaling = rope_scaling({}, local, src)
        elif cfg.get("rope_local_base_freq") is not None:  # Gemma 3 before transformers v5: local layers unscaled
            local_base, local_scaling = h._optional_number(cfg, "rope_local_base_freq", src), None
    full = LayerAttention(num_heads=base.num_heads, num_kv_heads=base.num_kv_heads, head_dim=base.head_dim,
                          rope_base=base.rope_base, rope_scaling=scaling, kind="full_attention")
    sliding = dataclasses.replace(full, window=window, rope_base=local_base, rope_scaling=local_scaling,
                                  kind="sliding_attention")
    return tuple(full if kind == "full_attention" else sliding for kind in kinds)


def _openelm(cfg: Mapping[str, Any], src: str) -> AttentionConfig:
    """OpenELM: per-layer ``num_query_heads`` and ``num_kv_heads`` lists, one ``head_dim``."""
    h = _hf()
    width = h._as_int(cfg.get("model_dim"), "model_dim", src)
    layers = h._as_int(cfg.get("num_transformer_layers"), "num_transformer_layers", src)
    head_dim = h._as_int(cfg.get("head_dim"), "head_dim", src)
    lists = {}
    for key in ("num_query_heads", "num_kv_heads"):
        value = cfg.get(key)
        if not isinstance(value, list) or len(value) != layers:
            raise ValueError(f"{src}: {key} must be a list of {layers} ints (one per layer), got {value!r:.60}")
        lists[key] = [h._as_int(n, f"{key}[{i}]", src) for i, n in enumerate(value)]
    base = h._optional_number(cfg, "rope_freq_constant", src) or 10000.0
    per_layer = []
    for i, (q, kv) in enumerate(zip(lists["num_query_heads"], lists["num_kv_heads"])):
        try:
            per_layer.append(LayerAttention(num_heads=q, num_kv_heads=kv, head_dim=head_dim, rope_base=base))
        except ValueError as e:
            raise ValueError(f"{src}: layer {i}: {e} (num_query_heads[{i}], num_kv_heads[{i}])") from e
    first = per_layer[0]
    return AttentionConfig(embed_dim=width, num_heads=first.num_heads, num_kv_heads=first.num_kv_heads,
                           head_dim=head_dim, num_layers=layers, causal=True, bias=False, rope_base=base,
                           max_positions=h._optional_int(cfg, ("max_context_length",), src), model_type="openelm",
                           qk_norm="head" if h._optional_bool(cfg, "normalize_qk_projections", src) else None,
                           layers=tuple(per_layer))


def _stage_list(cfg: Mapping[str, Any], key: str, src: str) -> list[Any]:
    """``cfg[key]``, checked to be a non-empty list (one entry per stage)."""
    value = cfg.get(key)
    if not isinstance(value, list) or not value:
        raise ValueError(f"{src}: {key} must be a non-empty list (one entry per stage), got {value!r:.60}")
    return value


def _swin(cfg: Mapping[str, Any], src: str) -> AttentionConfig:
    """Swin: ``num_heads`` per stage, ``depths`` layers per stage, the width doubling by stage."""
    h = _hf()
    width = h._as_int(cfg.get("embed_dim"), "embed_dim", src)
    depths, heads = _stage_list(cfg, "depths", src), _stage_list(cfg, "num_heads", src)
    if len(depths) != len(heads):
        raise ValueError(f"{src}: depths and num_heads must have one entry per stage, got {len(depths)} and "
                         f"{len(heads)}")
    window = h._as_int(cfg.get("window_size", 7), "window_size", src)
    per_layer = []
    for stage, (depth, n) in enumerate(zip(depths, heads)):
        depth, n = h._as_int(depth, f"depths[{stage}]", src), h._as_int(n, f"num_heads[{stage}]", src)
        stage_width = width * 2 ** stage
        if stage_width % n:
            raise ValueError(f"{src}: stage {stage} width {stage_width} is not divisible by num_heads[{stage}]={n}")
        per_layer += [LayerAttention(num_heads=n, num_kv_heads=n, head_dim=stage_width // n, embed_dim=stage_width,
                                     kind=f"window {window}x{window}, stage {stage}")] * depth
    first = per_layer[0]
    return AttentionConfig(embed_dim=width, num_heads=first.num_heads, num_kv_heads=first.num_heads,
                           head_dim=first.head_dim, num_layers=len(per_layer), causal=False,
                           bias=bool(h._optional_bool(cfg, "qkv_bias", src) is not False), model_type="swin",
                           layers=tuple(per_layer))


def _deepseek(cfg: Mapping[str, Any], src: str) -> AttentionConfig:
    """DeepSeek-V2/V3: multi-head latent attention sizes under their own names.

    RoPE pairing: V2 always interleaved (complex pairs (2p, 2p+1)); V3 interleaved when
    ``rope_interleave`` is true (its default when absent), rotate-half when false or null,
    as transformers' ``if self.config.rope_interleave``.
    """
    h = _hf()
    sizes = {key: h._as_int(cfg.get(key), key, src)
             for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "kv_lora_rank",
                         "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    q_rank = cfg.get("q_lora_rank")
    q_rank = None if q_rank is None else h._as_int(q_rank, "q_lora_rank", src)
    heads = sizes["num_attention_heads"]
    params = h.rope_parameters(cfg, None, src)  # transformers v5 nests rope_theta and the scaling here
    base = (h._optional_number(params, "rope_theta", f"{src} rope_parameters")
            or h._optional_number(cfg, "rope_theta", src) or 10000.0)
    try:
        return AttentionConfig(
            embed_dim=sizes["hidden_size"], num_heads=heads, num_kv_heads=heads,
            head_dim=sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"], num_layers=sizes["num_hidden_layers"],
            causal=True, bias=bool(h._optional_bool(cfg, "attention_bias", src)), o_bias=False, rope_base=base,
            rotary_dim=sizes["qk_rope_head_dim"], max_positions=h._optional_int(cfg, h._KEYS_POSITIONS, src),
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
}
