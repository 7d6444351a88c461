"""Reading Hugging Face ``config.json`` files: the one reader of HF config facts.

Notation: E embed_dim, H query heads, Hkv key/value heads, D head_dim, L layers.

:meth:`multihead.AttentionConfig.from_hf` parses through here; the rules (which keys
count, and when) are per model type.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import hf_layers
from ..config import (_KEYS_ALL_BIAS, _KEYS_HEAD_DIM, _KEYS_HEADS, _KEYS_KV_HEADS, _KEYS_LAYERS, _KEYS_POSITIONS,
                      _KEYS_QKV_BIAS, _KEYS_WIDTH, DECODERS, ENCODERS, INTERLEAVED_ROPE, MAX_CONFIG_BYTES,
                      AttentionConfig, _check_positive_float)

#: A multimodal file nests its language model's config once (twice at most in practice).
MAX_TEXT_CONFIG_DEPTH = 4

__all__ = ["parse", "read_json", "field", "rope_parameters", "module_rope_base", "module_window",
           "module_max_positions", "module_flag"]


def read_json(path: Path) -> Mapping[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path}: no such config file")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: a config.json must be <= {MAX_CONFIG_BYTES} bytes, got {size}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
    except (UnicodeDecodeError, ValueError, OSError) as e:
        raise ValueError(f"{path}: cannot be read as a JSON config ({e})") from e
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to be a config.json (JSON objects or arrays nested "
                         f"beyond Python's recursion limit)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a JSON object, got {type(data).__name__}")
    return data


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number a config may hold")


def parse(cfg: Mapping[str, Any], src: str) -> AttentionConfig:
    """Map one HF config dict to an AttentionConfig; every error names ``src`` and the key."""
    text = cfg.get("text_config")
    if _pick(cfg, _KEYS_WIDTH, src) is None and isinstance(text, Mapping):
        if src.count("text_config") >= MAX_TEXT_CONFIG_DEPTH:
            raise ValueError(f"{src}: text_config nested more than {MAX_TEXT_CONFIG_DEPTH} levels deep")
        return parse(text, f"{src} text_config")
    model_type = cfg.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise TypeError(f"{src}: model_type must be a str, got {type(model_type).__name__} {model_type!r}")
    # per-layer head lists, latent attention: keys of their own
    if model_type is not None and model_type in hf_layers.SPECIAL:
        return hf_layers.SPECIAL[model_type](cfg, src)

    width_key, width = _required(cfg, _KEYS_WIDTH, src)
    width = _as_int(width, width_key, src)
    heads_key, heads = _required(cfg, _KEYS_HEADS, src)
    layer_heads = None
    if isinstance(heads, list):  # per-layer head counts
        layer_heads = tuple(_as_int(h, f"{heads_key}[{i}]", src) for i, h in enumerate(heads))
        if not layer_heads:
            raise ValueError(f"{src}: {heads_key} must not be an empty list")
        heads = max(layer_heads)
    else:
        heads = _as_int(heads, heads_key, src)
    layers_key, layers = _required(cfg, _KEYS_LAYERS, src)
    layers = _as_int(layers, layers_key, src)
    if layer_heads is not None and len(layer_heads) != layers:
        raise ValueError(f"{src}: {heads_key} has {len(layer_heads)} entries, expected one per layer ({layers})")

    head_dim = _optional_int(cfg, _KEYS_HEAD_DIM, src)
    if head_dim is None:
        if layer_heads is not None and len(set(layer_heads)) > 1:
            raise ValueError(f"{src}: {heads_key} varies by layer, so head_dim must be given explicitly")
        if width % heads:
            raise ValueError(f"{src}: {width_key}={width} must be divisible by {heads_key}={heads} "
                             "when head_dim is not given")
        head_dim = width // heads

    kv_key, kv_heads = _pick(cfg, _KEYS_KV_HEADS, src) or (None, None)
    if model_type == "falcon":
        kv_key, kv_heads = _falcon_kv_heads(cfg, heads, kv_key, kv_heads, src)
    if model_type == "albert" and cfg.get("num_hidden_groups", 1) != layers:
        raise ValueError(f"{src}: ALBERT shares its layers (num_hidden_groups={cfg.get('num_hidden_groups', 1)}, "
                         f"num_hidden_layers={layers}): one config per distinct layer is not supported")
    if _optional_bool(cfg, "alibi", src):
        raise ValueError(f"{src}: alibi=true (ALiBi position biases) is not supported")
    if kv_heads is None:
        kv_heads = 1 if _optional_bool(cfg, "multi_query", src) else heads
    elif heads % _as_int(kv_heads, kv_key or _KEYS_KV_HEADS[0], src) or any(h % kv_heads for h in layer_heads or ()):
        raise ValueError(f"{src}: {heads_key}={list(layer_heads) if layer_heads else heads} must be "
                         f"divisible by {kv_key}={kv_heads}")

    causal = _causal(cfg, model_type, src)
    bias, o_bias = _bias(cfg, model_type, src)
    rope_base, rotary_dim = _rope(cfg, model_type, head_dim, src)
    try:
        config = AttentionConfig(
            embed_dim=width, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            num_layers=layers, causal=causal, bias=bias, o_bias=o_bias, rope_base=rope_base,
            rope_interleaved=rope_base is not None and model_type in INTERLEAVED_ROPE,
            rotary_dim=rotary_dim, max_positions=_optional_int(cfg, _KEYS_POSITIONS, src),
            window=_window(cfg, model_type, src), scale=_scale(cfg, src), model_type=model_type,
            layer_num_heads=layer_heads,
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"{src}: {e}") from e
    return hf_layers.extend(config, cfg, model_type, src)  # RoPE scaling, QK-norm, ..., per-layer attention


def _falcon_kv_heads(cfg: Mapping[str, Any], heads: int, key: str | None, value: Any,
                     src: str) -> tuple[str | None, Any]:
    """FalconConfig's rule: ``num_kv_heads`` counts only with ``new_decoder_architecture`` or
    ``multi_query=false``; ``multi_query`` defaults to true (Falcon-7B: 1 KV head, though its
    saved config says num_kv_heads=71)."""
    if _optional_bool(cfg, "new_decoder_architecture", src):
        # transformers caches K/V expanded to all H heads there, unlike the weights' Hkv.
        raise ValueError(f"{src}: Falcon's new_decoder_architecture is not supported (its KV cache holds "
                         f"every query head, not num_kv_heads)")
    if _optional_bool(cfg, "multi_query", src) is not False:
        return "multi_query", 1
    return key, heads if value is None else value


def _pick(cfg: Mapping[str, Any], keys: Sequence[str], src: str) -> tuple[str, Any] | None:
    """(key, value) of the first alias present (null counts as absent); aliases must agree."""
    found = [(k, cfg[k]) for k in keys if cfg.get(k) is not None]
    for k, v in found[1:]:
        if v != found[0][1]:
            raise ValueError(f"{src}: {found[0][0]}={found[0][1]!r} and {k}={v!r} contradict each other")
    return found[0] if found else None


def _required(cfg: Mapping[str, Any], keys: Sequence[str], src: str) -> tuple[str, Any]:
    found = _pick(cfg, keys, src)
    if found is None:
        raise ValueError(f"{src}: missing field, expected one of {', '.join(keys)}")
    return found


def _optional_int(cfg: Mapping[str, Any], keys: Sequence[str], src: str) -> int | None:
    found = _pick(cfg, keys, src)
    return None if found is None else _as_int(found[1], found[0], src)


def _as_int(value: object, key: str, src: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{src}: {key} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{src}: {key} must be >= 1, got {value}")
    return value


def _optional_bool(cfg: Mapping[str, Any], key: str, src: str) -> bool | None:
    value = cfg.get(key)
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{src}: {key} must be true or false, got {type(value).__name__} {value!r}")
    return value


def _optional_number(cfg: Mapping[str, Any], key: str, src: str) -> float | None:
    value = cfg.get(key)
    if value is None:
        return None
    try:
        return _check_positive_float(key, value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{src}: {e}") from e


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
    for key in _KEYS_ALL_BIAS:
        value = _optional_bool(cfg, key, src)
        if value is not None:
            qkv = out = value
    for key in _KEYS_QKV_BIAS:
        value = _optional_bool(cfg, key, src)
        if value is not None:
            qkv = value
    return qkv, (None if out == qkv else out)


def _rope(cfg: Mapping[str, Any], model_type: str | None, head_dim: int, src: str) -> tuple[float | None, int | None]:
    params = rope_parameters(cfg, "full_attention", src)  # mixed layer types (Gemma 3): the full-attention layers
    base = _optional_number(params, "rope_theta", f"{src} rope_parameters")
    for key in ("rope_theta", "rotary_emb_base"):
        other = _optional_number(cfg, key, src)
        if base is not None and other is not None and other != base:
            raise ValueError(f"{src}: rope_parameters.rope_theta={base} and {key}={other} contradict each other")
        base = other if base is None else base
    has_rope = DECODERS[model_type][2] if model_type is not None and model_type in DECODERS else base is not None
    if not has_rope or _optional_bool(cfg, "alibi", src):
        return None, None
    base = 10000.0 if base is None else base
    explicit = _optional_int(cfg, ("rotary_dim",), src)
    factor = None
    for where, key in ((params, "partial_rotary_factor"), (cfg, "partial_rotary_factor"), (cfg, "rotary_pct")):
        factor = factor if factor is not None else _optional_number(where, key, src)
    if factor is not None and factor > 1:
        raise ValueError(f"{src}: partial rotary factor must be in (0, 1], got {factor}")
    rotary = explicit if explicit is not None else (None if factor in (None, 1.0) else int(head_dim * factor))
    return base, rotary


def _window(cfg: Mapping[str, Any], model_type: str | None, src: str) -> int | None:
    window = _optional_int(cfg, ("sliding_window",), src)
    if window is None or _optional_bool(cfg, "use_sliding_window", src) is False:
        return None
    layer_types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern")
    mixed = (model_type == "gemma2" or (isinstance(pattern, int) and pattern > 1)
             or (isinstance(layer_types, list) and len(set(map(str, layer_types))) > 1))
    return None if mixed else window


def _scale(cfg: Mapping[str, Any], src: str) -> float | None:
    if _optional_bool(cfg, "scale_attn_weights", src) is False:
        return 1.0  # GPT-2 option: raw dot products
    scalar = _optional_number(cfg, "query_pre_attn_scalar", src)  # Gemma 2/3
    return None if scalar is None else 1.0 / math.sqrt(scalar)


# ---- facts a converter reads from a model's config (object or dict) ------------------------------
def field(cfg: Any, key: str) -> Any:
    """``cfg[key]`` of a config dict, or the attribute of a config object; None when absent."""
    return cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key, None)


def rope_parameters(cfg: Any, layer_type: str | None, src: str) -> Mapping[str, Any]:
    """``rope_parameters`` of one layer type: transformers v5 nests them per layer type
    (``{"sliding_attention": {...}, "full_attention": {...}}``, Gemma 3, ModernBERT) or
    gives one dict for every layer. ``layer_type`` picks the nested one; {} when absent."""
    params = field(cfg, "rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"{src}: rope_parameters must be an object, got {type(params).__name__}")
    params = params or {}
    nested = {k: v for k, v in params.items() if isinstance(v, Mapping)}
    if nested and "rope_theta" not in params:
        if layer_type not in nested:
            raise ValueError(f"{src}: rope_parameters is given per layer type {sorted(nested)}, "
                             f"but this layer's type is {layer_type!r}")
        return nested[layer_type]
    return params


def module_rope_base(cfg: Any, layer_type: str | None, src: str) -> float:
    """RoPE base θ of an attention layer whose class applies plain RoPE to all of D.

    Raises:
        ValueError: no config, a ``rope_type`` other than ``"default"`` (scaled RoPE) or a
            partial rotary factor other than 1, naming the key.
    """
    if cfg is None:
        raise ValueError(f"{src}: a config is required for RoPE settings; pass config=")
    params = rope_parameters(cfg, layer_type, src)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{src}: rope_parameters rope_type={rope_type!r} is not supported; only 'default'")
    factor = params.get("partial_rotary_factor", field(cfg, "partial_rotary_factor"))
    if factor not in (None, 1, 1.0):
        raise ValueError(f"{src}: partial_rotary_factor={factor} is not supported for this class; only 1.0")
    base = params.get("rope_theta", field(cfg, "rope_theta"))
    return 10000.0 if base is None else _check_positive_float("rope_theta", base)


def module_rope(cfg: Any, layer_type: str | None, src: str, *, partial: bool = False) -> tuple[float, Any, float]:
    """(θ, RopeScaling or None, rotary fraction) of an attention layer's RoPE.

    ``partial``: the class rotates the first ``int(D · partial_rotary_factor)`` dims (Phi-3);
    otherwise a factor other than 1 is refused.

    Every type of transformers' ``ROPE_INIT_FUNCTIONS`` but ``proportional`` is read
    (:mod:`multihead.rope_scaling` computes them bit for bit).

    Raises:
        ValueError: no config, an unknown or malformed scaling, a partial rotary factor
            other than 1, naming the key.
    """
    if cfg is None:
        raise ValueError(f"{src}: a config is required for RoPE settings; pass config=")
    params = rope_parameters(cfg, layer_type, src)
    factor = params.get("partial_rotary_factor", field(cfg, "partial_rotary_factor"))
    if factor not in (None, 1, 1.0) and not partial:
        raise ValueError(f"{src}: partial_rotary_factor={factor} is not supported for this class; only 1.0")
    factor = 1.0 if factor is None else _check_positive_float("partial_rotary_factor", factor)
    base = params.get("rope_theta", field(cfg, "rope_theta"))
    base = 10000.0 if base is None else _check_positive_float("rope_theta", base)
    plain = cfg if isinstance(cfg, Mapping) else cfg.to_dict()
    return base, hf_layers.rope_scaling({**plain, "rope_scaling": None}, params, src), factor


def module_window(cfg: Any, src: str) -> int | None:
    """``config.sliding_window`` as the classes that pass it to HF's kernel read it (Mistral)."""
    window = field(cfg, "sliding_window")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{src}: sliding_window must be a positive int or None, got {window!r}")
    return window


def module_max_positions(cfg: Any) -> int | None:
    """``max_position_embeddings`` (the RoPE table length worth precomputing), or None."""
    positions = field(cfg, "max_position_embeddings")
    return positions if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0 else None


def module_flag(cfg: Any, key: str, src: str) -> bool | None:
    """A true/false config key a class's forward depends on (Falcon's ``alibi``); None when absent.

    Raises:
        TypeError: a value that is neither a bool nor None, naming the key.
    """
    value = field(cfg, key) if cfg is not None else None
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{src}: {key} must be true or false, got {type(value).__name__} {value!r}")
    return value
