"""The sizes of one attention layer (and of the L layers of a model).

Notation: E embed_dim (``hidden_size``), H query heads, Hkv key/value heads, D head_dim,
L layers, S tokens.

    E --q_proj--> H·D     E --k_proj--> Hkv·D     E --v_proj--> Hkv·D     H·D --o_proj--> E

H·D equals E in the seed (``d_head = d / h``); Gemma and Qwen3 set D explicitly and
H·D may differ from E. Query head i reads key/value head ``i // (H // Hkv)``:
Hkv = H is MHA, Hkv = 1 is MQA, anything in between is GQA.

Where layers differ (Gemma 2/3 alternate sliding-window and full-attention layers; OpenELM
and Swin vary the heads), ``layers`` holds one :class:`LayerAttention` per layer and the
top-level fields describe the typical (full-attention, widest) layer for callers that read
one layer.

This module knows no file format: :meth:`AttentionConfig.from_hf` is a convenience over
:func:`multihead.interop.hf_layers.read`, where the Hugging Face facts (which model types,
which keys) live. :func:`check_overrides` is the one rule for the keyword overrides a
layer built from a config or converted from a module accepts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ._checks import MAX_DIM, check_int
from .qk_norm import QK_NORMS
from .rope_scaling import RopeScaling

__all__ = ["AttentionConfig", "LayerAttention", "OVERRIDABLE", "check_overrides", "check_positive_float"]

MAX_LAYERS = 10_000
MAX_POSITIONS = 1 << 30
# Projection weights of one layer; Llama-3.1-405B has 5.7e8, so 4.3e9 is never real.
MAX_LAYER_PARAMS = 1 << 32

#: Keyword overrides a layer built from a config, or converted from a module, accepts: settings,
#: never sizes (the config or the weights fix those).
OVERRIDABLE = frozenset({"causal", "dropout", "scale", "window", "backend", "rope"})


@dataclass(frozen=True, kw_only=True)
class LayerAttention:
    """The attention of one layer, where layers differ.

    Args:
        num_heads, num_kv_heads, head_dim: H, Hkv (dividing H), D of this layer.
        embed_dim: E of this layer where the width changes by stage (Swin); None = the model's.
        window: sliding window, or None for full attention.
        rope_base: θ of this layer (Gemma 3's local layers use 10000, its global ones 1e6),
            or None without RoPE.
        rope_scaling: this layer's RoPE scaling, or None.
        kind: a label: ``"full_attention"``, ``"sliding_attention"`` (transformers'
            ``layer_types``) or the family's own name for it.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    embed_dim: int | None = None
    window: int | None = None
    rope_base: float | None = None
    rope_scaling: RopeScaling | None = None
    kind: str = "full_attention"

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            check_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads, got num_heads={self.num_heads}, "
                             f"num_kv_heads={self.num_kv_heads}")
        for name in ("embed_dim", "window"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), maximum=MAX_POSITIONS)
        if self.rope_base is not None:
            check_positive_float("rope_base", self.rope_base)
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", _scaling_from_dict(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}")
        if not isinstance(self.kind, str):
            raise TypeError(f"kind must be a str, got {type(self.kind).__name__}")

    @property
    def kv_numbers_per_token(self) -> int:
        """K and V numbers one token adds to this layer's cache: 2·Hkv·D."""
        return 2 * self.num_kv_heads * self.head_dim


def _scaling_from_dict(d: Mapping[str, Any]) -> RopeScaling:
    """A RopeScaling from its ``asdict`` form (lists for the longrope factors)."""
    return RopeScaling(**d)


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """The shape of a multi-head attention layer (and of the L layers of a model).

    Args:
        embed_dim: E, model width (``hidden_size``).
        num_heads: H, query heads; with ``layer_num_heads``, the widest layer's H.
        num_kv_heads: Hkv, key/value heads; must divide H (and every per-layer H).
        head_dim: D, always explicit here (``from_hf`` derives E // H when a file omits it).
        num_layers: L.
        causal: mask future tokens (decoders); False = bidirectional (encoders, ViT).
        bias: bias on q_proj, k_proj, v_proj.
        o_bias: bias on o_proj; None = same as ``bias`` (Qwen2: bias=True, o_bias=False).
        rope_base: RoPE base θ, or None for no RoPE.
        rope_interleaved: RoPE pairing: False rotate-half (HF), True interleaved (GPT-J, Meta).
        rotary_dim: rotated coordinates per head (partial rotary); None = all D.
        max_positions: trained context length, or None.
        window: sliding window (Mistral's ``sliding_window``): keys per query, or None.
        scale: logit scale; None = 1/√D.
        model_type: the Hugging Face ``model_type`` it came from, if any.
        layer_num_heads: per-layer H (lists in some ViT configs); its length must be L.
            K/V heads per layer: H_i for an MHA config (Hkv == H), else Hkv.
        layers: one :class:`LayerAttention` per layer (L entries) where layers differ in
            heads, head_dim, window or RoPE; None = every layer as the top-level fields
            (and ``layer_num_heads``) say. :meth:`layer` gives any layer either way.
        rope_scaling: RoPE scaling of the typical layer (:class:`~multihead.RopeScaling`).
        qk_norm: ``"head"`` or ``"proj"`` QK-norm (Qwen3/Gemma 3, OLMo 2), ``"head_after_rope"``
            (HunYuan dense: over D, after RoPE), or None.
        softcap: logit soft-capping (Gemma 2), or None.
        alibi: ALiBi position biases (BLOOM, MPT).
        sinks: learned attention sinks (gpt-oss).
        kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim:
            multi-head latent attention (DeepSeek-V2/V3, their config names): K/V compressed
            to ``kv_lora_rank`` numbers per token plus one shared rotary key of
            ``qk_rope_head_dim``; then ``head_dim = qk_nope_head_dim + qk_rope_head_dim``.
            All None for ordinary attention; ``kv_lora_rank`` set requires the three head dims.

    Raises:
        TypeError: a field of the wrong type (bools are not ints).
        ValueError: a size out of range or an inconsistent combination, named with the
            expected and the actual values.
    """

    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int = 1
    causal: bool = False
    bias: bool = True
    o_bias: bool | None = None
    rope_base: float | None = None
    rope_interleaved: bool = False
    rotary_dim: int | None = None
    max_positions: int | None = None
    window: int | None = None
    scale: float | None = None
    model_type: str | None = None
    layer_num_heads: tuple[int, ...] | None = None
    layers: tuple[LayerAttention, ...] | None = None
    rope_scaling: RopeScaling | None = None
    qk_norm: str | None = None
    softcap: float | None = None
    alibi: bool = False
    sinks: bool = False
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("embed_dim", "num_heads", "num_kv_heads", "head_dim"):
            check_int(name, getattr(self, name))
        check_int("num_layers", self.num_layers, maximum=MAX_LAYERS)
        if self.num_heads * self.head_dim > MAX_DIM:
            raise ValueError(f"num_heads * head_dim must be <= {MAX_DIM}, got "
                             f"{self.num_heads} * {self.head_dim} = {self.num_heads * self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads, got "
                             f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}")
        params = (2 * self.embed_dim * self.num_heads + 2 * self.embed_dim * self.num_kv_heads) * self.head_dim
        if params > MAX_LAYER_PARAMS:
            raise ValueError(f"projection weights per layer must be <= {MAX_LAYER_PARAMS}, got {params} "
                             f"(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                             f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim})")
        for name in ("causal", "bias", "rope_interleaved"):
            _check_bool(name, getattr(self, name))
        if self.o_bias is not None:
            _check_bool("o_bias", self.o_bias)
        if self.rope_base is not None:
            check_positive_float("rope_base", self.rope_base)
        elif self.rope_interleaved or self.rotary_dim is not None:
            given = "rope_interleaved=True" if self.rope_interleaved else f"rotary_dim={self.rotary_dim}"
            raise ValueError(f"{given} needs rope_base (RoPE on), got rope_base=None")
        if self.rotary_dim is not None:
            check_int("rotary_dim", self.rotary_dim, minimum=2, maximum=self.head_dim)
            if self.rotary_dim % 2:
                raise ValueError(f"rotary_dim must be even (coordinates rotate in pairs), got {self.rotary_dim}")
        for name in ("max_positions", "window"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), maximum=MAX_POSITIONS)
        if self.scale is not None:
            check_positive_float("scale", self.scale)
        if self.model_type is not None and not isinstance(self.model_type, str):
            raise TypeError(f"model_type must be a str or None, got {type(self.model_type).__name__}")
        if self.layer_num_heads is not None:
            object.__setattr__(self, "layer_num_heads", self._checked_layer_heads(self.layer_num_heads))
        self._check_features()
        if self.layers is not None:
            object.__setattr__(self, "layers", self._checked_layers(self.layers))
        self._check_rope_dims()

    def _check_rope_dims(self) -> None:
        """Each layer's RoPE scaling fits its rotary dims (RopeScaling.check_rotary_dim), refused when read."""
        for lay in (self.layer(0),) if self.layers is None else self.layers:
            if lay.rope_base is not None and lay.rope_scaling is not None:
                lay.rope_scaling.check_rotary_dim(lay.head_dim if self.rotary_dim is None else self.rotary_dim)

    def _check_features(self) -> None:
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", _scaling_from_dict(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}")
        if self.qk_norm is not None and self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {list(QK_NORMS)} or None, got {self.qk_norm!r}")
        if self.softcap is not None:
            check_positive_float("softcap", self.softcap)
        for name in ("alibi", "sinks"):
            _check_bool(name, getattr(self, name))
        if self.alibi and self.rope_base is not None:
            raise ValueError(f"alibi=True needs rope_base=None (ALiBi replaces RoPE), got rope_base={self.rope_base}")
        latent = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for name in latent:
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        if self.kv_lora_rank is not None:
            nope, rope_dim = self.qk_nope_head_dim, self.qk_rope_head_dim
            if nope is None or rope_dim is None or self.v_head_dim is None:
                missing = [n for n in latent[2:] if getattr(self, n) is None]
                raise ValueError(f"kv_lora_rank (latent attention) needs {', '.join(missing)}, got None")
            if self.head_dim != nope + rope_dim:
                raise ValueError(f"head_dim must be qk_nope_head_dim + qk_rope_head_dim = "
                                 f"{nope + rope_dim} for latent attention, got {self.head_dim}")

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    def _checked_layers(self, value: object) -> tuple[LayerAttention, ...]:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TypeError(f"layers must be a sequence of LayerAttention, got {type(value).__name__}")
        layers = tuple(LayerAttention(**v) if isinstance(v, Mapping) else v for v in value)
        bad = [i for i, v in enumerate(layers) if not isinstance(v, LayerAttention)]
        if bad:
            raise TypeError(f"layers[{bad[0]}] must be a LayerAttention, got {type(layers[bad[0]]).__name__}")
        if len(layers) != self.num_layers:
            raise ValueError(f"layers must have num_layers={self.num_layers} entries, got {len(layers)}")
        if self.layer_num_heads is not None and tuple(v.num_heads for v in layers) != self.layer_num_heads:
            raise ValueError("layers and layer_num_heads disagree on the heads per layer")
        return layers

    def layer(self, index: int) -> LayerAttention:
        """The attention of layer ``index`` (0-based): ``layers[index]``, or derived from the top level."""
        check_int("layer", index, minimum=0, maximum=self.num_layers - 1)
        if self.layers is not None:
            return self.layers[index]
        h, hkv = self.heads_in_layer(index)
        return LayerAttention(num_heads=h, num_kv_heads=hkv, head_dim=self.head_dim, window=self.window,
                              rope_base=self.rope_base, rope_scaling=self.rope_scaling,
                              kind="full_attention" if self.window is None else "sliding_attention")

    def layer_kinds(self) -> dict[LayerAttention, list[int]]:
        """Each distinct layer (heads, head_dim, window, RoPE) and the layers that have it, in order."""
        kinds: dict[LayerAttention, list[int]] = {}
        for i in range(self.num_layers):
            kinds.setdefault(self.layer(i), []).append(i)
        return kinds

    def _checked_layer_heads(self, value: object) -> tuple[int, ...]:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TypeError(f"layer_num_heads must be a sequence of ints, got {type(value).__name__}")
        heads = tuple(check_int(f"layer_num_heads[{i}]", h) for i, h in enumerate(value))
        if len(heads) != self.num_layers:
            raise ValueError(f"layer_num_heads must have num_layers={self.num_layers} entries, got {len(heads)}")
        if max(heads) != self.num_heads:
            raise ValueError(f"num_heads must be the widest layer's head count max(layer_num_heads)="
                             f"{max(heads)}, got {self.num_heads}")
        if self.num_kv_heads != self.num_heads:
            bad = [h for h in heads if h % self.num_kv_heads]
            if bad:
                raise ValueError(f"every layer_num_heads entry must be a multiple of num_kv_heads="
                                 f"{self.num_kv_heads}, got {bad}")
        return heads

    # ---- derived sizes -------------------------------------------------------------
    @property
    def kv_group_size(self) -> int:
        """Query heads per key/value head, H // Hkv (1 for MHA, H for MQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kind(self) -> str:
        """``"MHA"``, ``"GQA"`` or ``"MQA"``."""
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def effective_o_bias(self) -> bool:
        """Whether o_proj has a bias (``o_bias``, or ``bias`` when it is None)."""
        return self.bias if self.o_bias is None else self.o_bias

    @property
    def effective_scale(self) -> float:
        """The logit scale actually used: ``scale`` or 1/√D (per head, not 1/√E)."""
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale

    @property
    def effective_rotary_dim(self) -> int | None:
        """Rotated coordinates per head: ``rotary_dim``, D when RoPE is on, None without RoPE."""
        if self.rope_base is None:
            return None
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def heads_in_layer(self, layer: int) -> tuple[int, int]:
        """(H, Hkv) of layer ``layer`` (0-based), honouring ``layers`` and ``layer_num_heads``."""
        check_int("layer", layer, minimum=0, maximum=self.num_layers - 1)
        if self.layers is not None:
            return self.layers[layer].num_heads, self.layers[layer].num_kv_heads
        if self.layer_num_heads is None:
            return self.num_heads, self.num_kv_heads
        h = self.layer_num_heads[layer]
        return h, (h if self.num_kv_heads == self.num_heads else self.num_kv_heads)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict of the fields; ``AttentionConfig(**d)`` rebuilds it."""
        d = asdict(self)
        if d["layer_num_heads"] is not None:
            d["layer_num_heads"] = list(d["layer_num_heads"])
        if d["layers"] is not None:
            d["layers"] = list(d["layers"])
        return d

    # ---- reading Hugging Face files --------------------------------------------------
    @classmethod
    def from_hf(cls, source: Mapping[str, Any] | str | os.PathLike[str]) -> AttentionConfig:
        """Read a Hugging Face config: a dict, a config.json path, or a folder holding one.

        Field names of every family are accepted (``hidden_size``/``n_embd``/``d_model``,
        ``num_attention_heads``/``n_head``, ...); two names for one size must agree.
        ``head_dim`` is read where given (Gemma, Qwen3), else E // H, which must divide.
        RoPE base from ``rope_parameters`` (transformers v5), ``rope_theta`` or
        ``rotary_emb_base`` (10000 for a RoPE family that is silent); partial rotary from
        ``partial_rotary_factor``/``rotary_pct``/``rotary_dim``. ``sliding_window`` counts
        unless ``use_sliding_window`` is false. Multimodal files are read from ``text_config``.
        Falcon's KV heads follow ``FalconConfig`` (``num_kv_heads`` counts only without
        ``multi_query``); ALiBi, Falcon's new decoder architecture and ALBERT's shared
        layers are refused. Model types outside :data:`~multihead.interop.hf_config.ENCODERS`,
        :data:`~multihead.interop.hf_config.DECODERS` and :data:`~multihead.interop.hf_layers.SPECIAL`
        are refused by name.

        Raises:
            ValueError: unreadable, truncated or non-JSON file, a missing file, a top level
                that is not an object, missing or contradictory fields, unknown model types;
                the message names the file and the field.
            TypeError: ``source`` of the wrong type, or a field of the wrong type.
        """
        # The one import of this module that goes up: the reader builds AttentionConfigs, so it
        # imports this module; this method is a convenience over it (tests/core/test_imports.py).
        from .interop.hf_layers import read

        return read(source)

def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_positive_float(name: str, value: object) -> float:
    """``float(value)`` for a finite number > 0 (not a bool).

    Raises:
        TypeError: ``value`` is not a number, naming ``name``.
        ValueError: ``value`` is not finite or not > 0, naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


def check_overrides(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` updated by ``overrides``, whose keys must be in :data:`OVERRIDABLE`.

    Args:
        defaults: the settings read from a config or a module (``causal``, ``scale``, ...).
        overrides: what the caller asked for instead.

    Returns:
        a new dict: ``{**defaults, **overrides}``.

    Raises:
        ValueError: a key of ``overrides`` that is not a setting, listing the allowed ones.
    """
    unknown = sorted(set(overrides) - OVERRIDABLE)
    if unknown:
        raise ValueError(f"overrides may only set {sorted(OVERRIDABLE)} (sizes come from the weights), "
                         f"got {unknown}")
    return {**defaults, **overrides}
