"""The Hugging Face config facts, and how each value is read: one rule per fact.

Notation: E embed_dim, H query heads, Hkv key/value heads, D head_dim, L layers.

Which model types multihead reads (:data:`ENCODERS`, :data:`DECODERS`), under which keys
a size may appear (``KEYS_*``: aliases that must agree), and the readers of one value,
each naming the source and the key in its errors. Two kinds of caller use them:

* :mod:`multihead.interop.hf_layers` maps a whole ``config.json`` dict to an
  :class:`~multihead.AttentionConfig` (:meth:`multihead.AttentionConfig.from_hf`);
* the converters (:mod:`~multihead.interop.hf_weights`, :mod:`~multihead.interop.hf_registry`)
  read one fact of a module's config, a dict or a transformers config object alike
  (:func:`field`, the ``module_*`` readers).

RoPE is read by one rule for both: :func:`rope_base` (θ and its aliases) and
:func:`rotary_factor` (partial rotary), :func:`rope_parameters` (one layer type's) and
:func:`rope_scaling`. This module builds no config: it imports nothing of multihead but
a number check and :class:`~multihead.RopeScaling`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..config import check_positive_float
from ..rope_scaling import RopeScaling

__all__ = ["ENCODERS", "DECODERS", "INTERLEAVED_ROPE", "DEFAULT_ROPE_BASE", "read_json", "field", "pick",
           "required", "optional_int", "as_int", "optional_bool", "optional_number", "rope_parameters",
           "rope_base", "rotary_factor", "rope_scaling", "module_rope_base", "module_rope", "module_window",
           "module_max_positions", "module_flag", "module_mrope_sections"]

# Bidirectional self-attention (causal=False); absolute or relative positions, no RoPE.
ENCODERS = frozenset({"bert", "roberta", "distilbert", "albert", "electra", "xlm-roberta",
                      "vit", "deit", "clip_vision_model", "mpnet"})
# Causal self-attention. Values: (q/k/v bias, o bias, RoPE) when the file is silent.
DECODERS: Mapping[str, tuple[bool, bool, bool]] = {
    "gpt2": (True, True, False), "opt": (True, True, False),
    "gpt_neox": (True, True, True), "gptj": (False, False, True), "phi": (True, True, True),
    "falcon": (False, False, True), "stablelm": (False, False, True),
    "llama": (False, False, True), "mistral": (False, False, True), "mixtral": (False, False, True),
    "qwen2": (True, False, True), "qwen2_moe": (True, False, True),
    "qwen3": (False, False, True), "qwen3_moe": (False, False, True),
    "gemma": (False, False, True), "gemma2": (False, False, True), "gemma3_text": (False, False, True),
    "phi3": (False, False, True), "olmo": (False, False, True), "olmo2": (False, False, True),
    "starcoder2": (True, True, True),
    "bloom": (True, True, False), "gpt_oss": (True, True, True),
}
# GPT-J pairs coordinates (2p, 2p+1) like Meta's original checkpoints; HF Llama rotates halves.
INTERLEAVED_ROPE = frozenset({"gptj"})
#: θ of a RoPE family whose config names none (transformers' default too).
DEFAULT_ROPE_BASE = 10000.0

# The names one size goes by across families (aliases: two given must agree).
KEYS_WIDTH = ("hidden_size", "n_embd", "d_model")
KEYS_HEADS = ("num_attention_heads", "n_head", "num_heads")
KEYS_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
KEYS_HEAD_DIM = ("head_dim", "d_kv")
KEYS_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
KEYS_POSITIONS = ("max_position_embeddings", "n_positions")
KEYS_QKV_BIAS = ("qkv_bias", "use_qkv_bias")  # q/k/v only
KEYS_ALL_BIAS = ("attention_bias", "bias", "enable_bias")  # q/k/v and o

MAX_CONFIG_BYTES = 64 << 20
#: A multimodal file nests its language model's config once (twice at most in practice).
MAX_TEXT_CONFIG_DEPTH = 4


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


# ---- one value of a config dict: every error names the source and the key ---------------------------
def pick(cfg: Mapping[str, Any], keys: Sequence[str], src: str) -> tuple[str, Any] | None:
    """(key, value) of the first alias present (null counts as absent); aliases must agree."""
    found = [(k, cfg[k]) for k in keys if cfg.get(k) is not None]
    for k, v in found[1:]:
        if v != found[0][1]:
            raise ValueError(f"{src}: {found[0][0]}={found[0][1]!r} and {k}={v!r} contradict each other")
    return found[0] if found else None


def required(cfg: Mapping[str, Any], keys: Sequence[str], src: str) -> tuple[str, Any]:
    """(key, value) of the first alias present; a missing field is refused, listing the aliases."""
    found = pick(cfg, keys, src)
    if found is None:
        raise ValueError(f"{src}: missing field, expected one of {', '.join(keys)}")
    return found


def optional_int(cfg: Mapping[str, Any], keys: Sequence[str], src: str) -> int | None:
    """The int >= 1 under the first alias present, or None."""
    found = pick(cfg, keys, src)
    return None if found is None else as_int(found[1], found[0], src)


def as_int(value: object, key: str, src: str) -> int:
    """``value`` if it is an int >= 1 (not a bool), else raise naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{src}: {key} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{src}: {key} must be >= 1, got {value}")
    return value


def optional_bool(cfg: Mapping[str, Any], key: str, src: str) -> bool | None:
    """``cfg[key]`` if it is true or false, None when absent or null."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{src}: {key} must be true or false, got {type(value).__name__} {value!r}")
    return value


def optional_number(cfg: Mapping[str, Any], key: str, src: str) -> float | None:
    """``cfg[key]`` as a finite float > 0, None when absent or null."""
    value = cfg.get(key)
    if value is None:
        return None
    try:
        return check_positive_float(key, value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{src}: {e}") from e


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


def rope_base(cfg: Mapping[str, Any], params: Mapping[str, Any], src: str) -> float | None:
    """θ as the config gives it, or None when it names none.

    Read from ``params`` (one layer type's ``rope_parameters``, :func:`rope_parameters`)
    ``rope_theta``, then the top level's ``rope_theta`` and ``rotary_emb_base`` (GPT-NeoX's
    older name); two of them that differ are refused.
    """
    base = optional_number(params, "rope_theta", f"{src} rope_parameters")
    for key in ("rope_theta", "rotary_emb_base"):
        other = optional_number(cfg, key, src)
        if base is not None and other is not None and other != base:
            raise ValueError(f"{src}: rope_parameters.rope_theta={base} and {key}={other} contradict each other")
        base = other if base is None else base
    return base


def rotary_factor(cfg: Mapping[str, Any], params: Mapping[str, Any], src: str) -> float | None:
    """The partial rotary factor as the config gives it (rotated share of D), or None.

    The first given of ``params``' ``partial_rotary_factor``, the top level's
    ``partial_rotary_factor`` and ``rotary_pct`` (GPT-NeoX's older name).

    Raises:
        ValueError: a factor above 1, or not a finite number > 0, naming the key.
    """
    factor = None
    for where, key in ((params, "partial_rotary_factor"), (cfg, "partial_rotary_factor"), (cfg, "rotary_pct")):
        factor = factor if factor is not None else optional_number(where, key, src)
    if factor is not None and factor > 1:
        raise ValueError(f"{src}: partial rotary factor must be in (0, 1], got {factor}")
    return factor


def rope_scaling(cfg: Mapping[str, Any], params: Mapping[str, Any], src: str) -> RopeScaling | None:
    """The RoPE scaling of ``params`` (one layer type's ``rope_parameters``) or of ``rope_scaling``."""
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
        return RopeScaling.from_hf(scaling, max_positions=optional_int(cfg, KEYS_POSITIONS, src))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{src}: rope_scaling: {e}") from e


def module_rope(cfg: Any, layer_type: str | None, src: str, *,
                partial: bool = False) -> tuple[float, RopeScaling | None, float]:
    """(θ, RopeScaling or None, rotary fraction) of an attention layer's RoPE.

    The rules of :func:`rope_base`, :func:`rotary_factor` and :func:`rope_scaling`, on the
    config as a dict (a config object's ``to_dict()``) whose legacy ``rope_scaling`` is not
    read: the classes take their RoPE from ``rope_parameters`` (transformers v5). θ defaults
    to :data:`DEFAULT_ROPE_BASE`.

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
    plain = cfg if isinstance(cfg, Mapping) else cfg.to_dict()
    params = rope_parameters(plain, layer_type, src)
    factor = rotary_factor(plain, params, src)
    if factor not in (None, 1.0) and not partial:
        raise ValueError(f"{src}: partial_rotary_factor={factor} is not supported for this class; only 1.0")
    base = rope_base(plain, params, src)
    scaling = rope_scaling({**plain, "rope_scaling": None}, params, src)
    return DEFAULT_ROPE_BASE if base is None else base, scaling, 1.0 if factor is None else factor


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
    return module_rope(cfg, layer_type, src)[0]


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


def module_mrope_sections(cfg: Any, default: Sequence[int], src: str) -> tuple[int, ...]:
    """M-RoPE's frequency slots per position row: ``rope_parameters["mrope_section"]``, or the
    class's ``default`` where the config gives none, as the Qwen-VL rotary embeddings read it.

    Raises:
        TypeError: ``mrope_section`` not a list of ints, naming the key.
    """
    params = rope_parameters(cfg, None, src)
    sections = params.get("mrope_section")
    if sections is None:
        return tuple(default)
    if isinstance(sections, (str, bytes)) or not isinstance(sections, Sequence) or any(
            isinstance(n, bool) or not isinstance(n, int) for n in sections):
        raise TypeError(f"{src}: rope_parameters.mrope_section must be a list of ints, got {sections!r}")
    return tuple(sections)
