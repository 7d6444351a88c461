"""Hugging Face attention modules to and from :class:`~multihead.MultiHeadAttention`: weights.

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads, D head_dim.

Only the classes of :mod:`multihead.interop.hf_registry` are converted, each by its
description (never guessed from weight names); config facts (RoPE base, windows) are read
by :mod:`multihead.interop.hf_config`. The weight layouts:

* BERT family (BertAttention): ``self.query/key/value``; W_o is ``output.dense``, followed
  by dropout, the residual and a LayerNorm.
* GPT-2 family (GPT2Attention): fused ``c_attn`` and ``c_proj`` Conv1D, stored ``[in, out]``,
  the transpose of nn.Linear.
* q_proj classes (Llama, Mistral, Qwen2, ViT, Cohere, ...): ``q_proj/k_proj/v_proj/o_proj``
  nn.Linear, our names and layout; RoPE as each class's registry entry says. Phi's (layout
  ``"dense"``): the same with W_o named ``dense``.
* fused ``query_key_value`` classes (GPT-NeoX, Falcon, BLOOM: layout ``"qkv-grouped"``): the
  rows are G groups of [q_1 .. q_g | k | v] heads of D rows each
  (:func:`multihead.interop.hf_registry.qkv_groups`); W_o is
  ``dense``.
* out_proj classes (CLIP, OPT, BART, mBART, Whisper): ``q_proj/k_proj/v_proj/out_proj``,
  our layout with W_o under another name; Whisper's k_proj has no bias (nor has ours then).
* DistilBERT (DistilBertSelfAttention): ``q_lin/k_lin/v_lin/out_lin``.

transformers is never imported here at module level.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import check_overrides
from ..module import MultiHeadAttention
from ..mrope import MRoPE
from ..qk_norm import RMSNorm
from ..rope import RoPE
from ..rope_scaling import RopeScaling
from . import hf_config, hf_registry
from .checkpoint import load_state

__all__ = ["from_hf", "to_hf", "hf_family", "state_from_hf", "state_to_hf"]


@dataclass(frozen=True)
class _Link:
    """Our tensor ``ours`` is rows ``rows`` of HF tensor ``theirs`` (transposed first if ``transpose``).

    With ``groups`` G > 1, ``theirs`` is G equal blocks of rows and ``rows`` is taken from each
    block, the results stacked (fused per-head layouts: GPT-NeoX, Falcon, BLOOM).
    """

    ours: str
    theirs: str
    rows: slice | None = None
    transpose: bool = False
    groups: int = 1


def hf_family(module: nn.Module) -> str | None:
    """The weight layout of ``module``'s registered class, or None if the class is not registered.

    Returns:
        ``"bert"`` (BertAttention: ``.self`` + ``.output.dense``), ``"bert-self"``
        (BertSelfAttention: query/key/value, no W_o), ``"gpt2"`` (``c_attn`` + ``c_proj``),
        ``"q_proj"`` (q_proj/k_proj/v_proj/o_proj nn.Linear), ``"phi3"`` (fused ``qkv_proj``),
        ``"dense"`` (q/k/v_proj + ``dense``, Phi),
        ``"out_proj"`` (q/k/v_proj + ``out_proj``), ``"distilbert"`` (``q_lin`` ... ``out_lin``),
        or None. A registered class
        may still be refused for its configuration: see :func:`hf_registry.why_not`.
    """
    spec = hf_registry.spec_of(module)
    return None if spec is None else spec.layout


def _links(module: nn.Module, family: str) -> list[_Link]:
    if family in ("bert", "bert-self"):
        pre = "self." if family == "bert" else ""
        links = [_Link(f"{o}.{p}", f"{pre}{t}.{p}") for o, t in
                 (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")) for p in ("weight", "bias")]
        if family == "bert":
            links += [_Link("o_proj.weight", "output.dense.weight"), _Link("o_proj.bias", "output.dense.bias")]
    elif family == "gpt2":
        c_proj: Any = module.c_proj
        e = c_proj.weight.shape[1]  # Conv1D weight is [in, out]
        links = [_Link(f"{o}.weight", "c_attn.weight", slice(i * e, (i + 1) * e), transpose=True)
                 for i, o in enumerate(("q_proj", "k_proj", "v_proj"))]
        links += [_Link(f"{o}.bias", "c_attn.bias", slice(i * e, (i + 1) * e))
                  for i, o in enumerate(("q_proj", "k_proj", "v_proj"))]
        links += [_Link("o_proj.weight", "c_proj.weight", transpose=True), _Link("o_proj.bias", "c_proj.bias")]
    elif family == "qkv-grouped":
        links = _qkv_grouped_links(module)
    elif family == "phi3":  # fused qkv_proj: rows [q (H·D) | k (Hkv·D) | v (Hkv·D)]
        phi3: Any = module  # transformers' module: its attributes are not typed here
        q_rows = phi3.config.num_attention_heads * phi3.head_dim
        kv_rows = phi3.num_key_value_heads * phi3.head_dim
        cuts = (slice(0, q_rows), slice(q_rows, q_rows + kv_rows), slice(q_rows + kv_rows, q_rows + 2 * kv_rows))
        links = [_Link(f"{o}.{p}", f"qkv_proj.{p}", rows) for o, rows in zip(("q_proj", "k_proj", "v_proj"), cuts)
                 for p in ("weight", "bias")]
        links += [_Link(f"o_proj.{p}", f"o_proj.{p}") for p in ("weight", "bias")]
    elif family == "wqkv":  # fused Wqkv: rows [q | k | v], H·D each (ModernBERT); W_o named Wo
        modern: Any = module  # transformers' module: its attributes are not typed here
        rows = int(modern.config.num_attention_heads) * int(modern.head_dim)
        links = [_Link(f"{o}.{p}", f"Wqkv.{p}", slice(i * rows, (i + 1) * rows))
                 for i, o in enumerate(("q_proj", "k_proj", "v_proj")) for p in ("weight", "bias")]
        links += [_Link(f"o_proj.{p}", f"Wo.{p}") for p in ("weight", "bias")]
    elif family in _RENAMED:
        links = _renamed_links(family)
    elif family == "dense":  # q/k/v_proj, W_o named dense (Phi)
        links = [_Link(f"{n}.{p}", f"{n}.{p}") for n in ("q_proj", "k_proj", "v_proj") for p in ("weight", "bias")]
        links += [_Link(f"o_proj.{p}", f"dense.{p}") for p in ("weight", "bias")]
    else:
        links = [_Link(f"{n}.{p}", f"{n}.{p}") for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                 for p in ("weight", "bias")]
        spec = hf_registry.spec_of(module)
        q_norm, k_norm = spec.norm_names if spec is not None else ("q_norm", "k_norm")
        links += [_Link("q_norm.weight", f"{q_norm}.weight"), _Link("k_norm.weight", f"{k_norm}.weight"),
                  _Link("sinks", "sinks")]  # where the class has them
    params = dict(module.named_parameters())
    return [link for link in links if params.get(link.theirs) is not None]


def _family_or_raise(module: nn.Module, config: Any | None = None) -> str:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    layout = hf_registry.require_spec(module, config).layout
    if layout == "latent":  # DeepSeek (issue #15): another layer class, its own weight names
        raise ValueError(f"{type(module).__name__} is multi-head latent attention: convert it with "
                         "multihead.MultiHeadLatentAttention.from_hf")
    return layout


def state_from_hf(module: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The HF module's parameters (or their ``.grad``) named and laid out as our layer's.

    Args:
        module: a supported HF attention module (see :func:`hf_family`).
        grads: take each parameter's ``.grad`` instead of its value (to compare training).

    Returns:
        ``{"q_proj.weight": (H·D, E), ...}``, detached views where possible; BertSelfAttention
        gives no ``o_proj`` entries (it has no W_o).

    Raises:
        ValueError: unsupported module, or ``grads`` with a parameter that has no grad.
    """
    family = _family_or_raise(module)
    params = dict(module.named_parameters())
    out = {}
    for link in _links(module, family):
        t = params[link.theirs].grad if grads else params[link.theirs].detach()
        if t is None:
            raise ValueError(f"parameter {link.theirs} of {type(module).__name__} has no grad")
        t = t.T if link.transpose else t
        if link.groups > 1:
            out[link.ours] = _grouped_rows(t, link).flatten(0, 1)  # (G·n, ...)
        else:
            out[link.ours] = t if link.rows is None else t[link.rows]
    return out


def state_to_hf(state: Mapping[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
    """Inverse of :func:`state_from_hf`: our layer's tensors in the HF module's names and layout.

    Args:
        state: ``{"q_proj.weight": ..., ...}`` (e.g. a layer's ``state_dict()`` or its grads).
        module: the HF module that fixes names, fusing and transposes.

    Returns:
        ``{hf_name: tensor}`` shaped like the module's parameters (new tensors).

    Raises:
        ValueError: a tensor ``state`` lacks or a shape that does not fit, naming the key.
    """
    family = _family_or_raise(module)
    params = dict(module.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for link in _links(module, family):
        if link.ours not in state:
            raise ValueError(f"state has no tensor {link.ours!r} (needed for {link.theirs})")
        target = out.setdefault(link.theirs, torch.empty_like(params[link.theirs].detach()))
        view = target.T if link.transpose else target
        if link.groups > 1:  # a (G, n, ...) view into target; ours is (G·n, ...)
            view = _grouped_rows(view, link)
            want = [view.shape[0] * view.shape[1], *view.shape[2:]]
        else:
            view = view if link.rows is None else view[link.rows]
            want = list(view.shape)
        if list(state[link.ours].shape) != want:
            raise ValueError(f"state[{link.ours!r}] must have shape {want} for {link.theirs}, "
                             f"got {list(state[link.ours].shape)}")
        view.copy_(state[link.ours].reshape(view.shape))
    return out


def to_hf(layer: MultiHeadAttention, module: nn.Module) -> nn.Module:
    """Copy ``layer``'s weights back into the HF ``module`` in place (inverse of :func:`from_hf`).

    Returns:
        ``module``.

    Raises:
        TypeError: ``layer`` is not a MultiHeadAttention.
        ValueError: unsupported module or sizes that do not fit, naming the tensor.
    """
    if not isinstance(layer, MultiHeadAttention):
        raise TypeError(f"layer must be a multihead.MultiHeadAttention, got {type(layer).__name__}")
    new = state_to_hf(layer.state_dict(), module)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, t in new.items():
            params[name].copy_(t)
    return module


def from_hf(module: nn.Module, config: Any | None = None, **overrides: Any) -> MultiHeadAttention:
    """Convert a Hugging Face attention module, copying its weights.

    Only the classes of :data:`multihead.interop.hf_registry.REGISTRY` are converted, each
    by its description: BertAttention (W_o = ``output.dense``; the dropout + residual +
    LayerNorm after it is *not* part of the result), BertSelfAttention (no W_o: ``o_proj``
    is the identity, without bias), GPT2Attention (fused Conv1D, transposed), and the
    q_proj/k_proj/v_proj/o_proj classes (Llama, Mistral, Qwen2, ViT without RoPE, Cohere
    with interleaved RoPE, ...), the fused ``query_key_value`` classes (GPT-NeoX with
    partial RoPE, Falcon with RoPE, BLOOM with ALiBi; see :func:`hf_registry.qkv_groups`), the out_proj
    classes (CLIP, OPT, BART, mBART, Whisper: their self- and cross-attention alike, a
    cross-attention layer being called with ``context``) and DistilBERT's. Heads, KV heads
    (GQA), bias, causal (``is_causal``), the logit scale (``scaling``), the window where the
    class has one, and RoPE (base from the config via :mod:`multihead.interop.hf_config`) or
    ALiBi carry over. A Llama 4 layer attends causally: its chunks are the caller's mask, as
    the HF module takes them from its model's (``mh.hf.patch``'s wrapper computes them).

    Args:
        module: the HF attention module (eval mode recommended; dropout carries over).
        config: the model config; default ``module.config``. Read for RoPE and windows.
        **overrides: ``causal``, ``scale``, ``window``, ``backend``, ``rope``, ``dropout``.

    Returns:
        a :class:`MultiHeadAttention` on the module's device and dtype, same train/eval mode.

    Raises:
        TypeError: ``module`` is not an nn.Module.
        ValueError: a class that is not registered, a submodule or attribute its
            description does not cover (q/k norms, gates, sinks...), cross-attention, a
            config value it does not cover (RoPE scaling other than the default, partial
            rotary, OLMo's clip_qkv...), naming the class and the reason; what only the
            family's patch wrapper computes (Llama 4's temperature tuning in no-RoPE layers).
    """
    _family_or_raise(module, config)
    spec = hf_registry.require_spec(module, config)
    if spec.alone is not None:  # what only the family's patch wrapper computes (Llama 4's temperature)
        spec.alone(module, config if config is not None else hf_registry._config_of(module))
    return convert(module, config, **overrides)


def convert(module: nn.Module, config: Any | None = None, **overrides: Any) -> MultiHeadAttention:
    """:func:`from_hf` without its description's ``alone`` rule: the layer a patch wrapper runs and
    completes (Llama 4's, whose wrapper scales q by position where the class does).

    Raises:
        TypeError, ValueError: as :func:`from_hf`.
    """
    family = _family_or_raise(module, config)
    spec = hf_registry.require_spec(module, config)
    config = config if config is not None else hf_registry._config_of(module)
    state = state_from_hf(module)  # our names and layout
    w = state["q_proj.weight"]  # (H·D, E)
    read = {"bert": _bert_settings, "bert-self": _bert_settings, "gpt2": _gpt2_settings, "q_proj": _q_proj_settings,
            "phi3": _q_proj_settings, "dense": _q_proj_settings, "wqkv": _q_proj_settings,
            "qkv-grouped": _qkv_grouped_settings,
            **{family: _renamed_settings for family in _RENAMED}}
    settings, sizes = read[family](module, config, state, spec)
    head_dim = sizes.pop("head_dim")
    layer = MultiHeadAttention(
        w.shape[1], w.shape[0] // head_dim, num_kv_heads=state["k_proj.weight"].shape[0] // head_dim,
        head_dim=head_dim, bias="q_proj.bias" in state, o_bias=sizes.pop("o_bias", "o_proj.bias" in state),
        **check_overrides(settings, overrides), device=w.device, dtype=w.dtype,
    )
    if "q_proj.bias" in state and "k_proj.bias" not in state:
        layer.k_proj.register_parameter("bias", None)  # Whisper: q/v/out_proj have biases, k_proj none
    if not spec.norm_weight and layer.qk_norm is not None:
        _weightless(layer.q_norm)
        _weightless(layer.k_norm)
    load_state(layer, state)
    return layer.train(module.training)


def _weightless(norm: RMSNorm) -> None:
    """A q/k norm without a weight (Llama 4's L2 norm): its weight ones as a non-persistent buffer,
    nothing to train and nothing in the state dict; ``x / rms(x) · 1`` is ``x / rms(x)`` exactly."""
    ones = torch.ones_like(norm.weight).detach()  # (D,)
    del norm.weight
    norm.register_buffer("weight", ones, persistent=False)


# Each reader returns (settings, sizes) and may complete ``state`` (BertSelfAttention's W_o).
def _bert_settings(module: Any, config: Any, state: dict[str, torch.Tensor],
                   spec: hf_registry.AttentionSpec) -> tuple[dict, dict]:
    inner = getattr(module, "self", module)  # BertAttention.self, or a BertSelfAttention itself
    w = state["q_proj.weight"]
    head_dim = w.shape[0] // inner.num_attention_heads
    sizes: dict[str, Any] = {"head_dim": head_dim}
    if "o_proj.weight" not in state:  # BertSelfAttention: no W_o, so o_proj is the identity
        state["o_proj.weight"] = torch.eye(w.shape[0], dtype=w.dtype, device=w.device)
        sizes["o_bias"] = False
    settings = {"causal": bool(getattr(inner, "is_causal", False)),
                "scale": float(inner.scaling), "dropout": float(inner.dropout.p)}
    return settings, sizes


def _gpt2_settings(module: Any, config: Any, state: dict[str, torch.Tensor],
                   spec: hf_registry.AttentionSpec) -> tuple[dict, dict]:
    # transformers folds scale_attn_weights and scale_attn_by_inverse_layer_idx into .scaling
    settings = {"causal": bool(module.is_causal), "scale": float(module.scaling),
                "dropout": float(module.attn_dropout.p)}
    return settings, {"head_dim": int(module.head_dim)}


def _q_proj_settings(module: Any, config: Any, state: dict[str, torch.Tensor],
                     spec: hf_registry.AttentionSpec) -> tuple[dict, dict]:
    """q/k/v/o_proj classes: every setting from the description, the module and hf_config."""
    head_dim = int(module.head_dim)
    src = f"{spec.name} config"
    window = {None: None, "module": getattr(module, "sliding_window", None),
              "is_sliding": module.sliding_window if getattr(module, "is_sliding", False) else None,
              "config": hf_config.module_window(config, src) if config is not None else None}[spec.window]
    # ModernBERT has no scaling attribute: its forward passes head_dim ** -0.5
    scale = module.scaling if spec.layout != "wqkv" else head_dim ** -0.5
    settings: dict[str, Any] = {
        "causal": bool(module.is_causal), "scale": float(scale),
        "dropout": float(module.attention_dropout or 0.0), "window": window, "rope": _rope(module, config, spec),
    }
    norm = getattr(module, spec.norm_names[0], None) if spec.qk_norm is not None else None
    if norm is not None:  # every layer but Llama 4's no-RoPE ones, which hold no qk_norm
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None:
            raise TypeError(f"{spec.name}: {spec.norm_names[0]} must have variance_epsilon or eps, got "
                            f"{type(norm).__name__}")
        settings.update(qk_norm=spec.qk_norm, norm_offset=spec.norm_offset, norm_eps=float(eps))
    if spec.softcap and module.attn_logit_softcapping is not None:
        settings["softcap"] = float(module.attn_logit_softcapping)
    if "sinks" in spec.params:
        settings["sinks"] = True
    return settings, {"head_dim": head_dim}


def _rope(module: Any, config: Any, spec: hf_registry.AttentionSpec) -> RoPE | None:
    if spec.rope is None or (spec.rope_on is not None and not spec.rope_on(module, config)):
        return None  # no position encoding in this class, or in this layer (SmolLM3's no-RoPE layers)
    src = f"{spec.name} config"
    theta = spec.rope_theta(module, config) if spec.rope_theta is not None else None
    if theta is not None:  # a base the class computes itself, unscaled (HunYuan's NTK-alpha)
        base, scaling, factor = theta, None, 1.0
    else:
        base, scaling, factor = hf_config.module_rope(config, _layer_type(module, config, spec), src,
                                                      partial=spec.partial_rotary)
    head_dim = int(module.head_dim)
    if spec.rope is not None and spec.rope in hf_registry.MROPE_KINDS:
        return _mrope(config, spec.name, spec.rope, head_dim, base, scaling)
    return RoPE.from_facts(head_dim, base, interleaved=spec.rope == "interleaved", rotary_dim=int(head_dim * factor),
                           max_positions=hf_config.module_max_positions(config), scaling=scaling)


def _mrope(config: Any, name: str, kind: str, head_dim: int, base: float, scaling: RopeScaling | None) -> MRoPE:
    """Qwen-VL text attention's M-RoPE (class ``name``, ``rope`` kind ``kind``): its sections from
    ``mrope_section`` (or the class's default), its slot layout from :data:`hf_registry.MROPE_KINDS`,
    over all of D."""
    layout, default = hf_registry.MROPE_KINDS[kind]
    sections = hf_config.module_mrope_sections(config, default, f"{name} config")
    return MRoPE.from_sections(head_dim, base, sections=sections, layout=layout,
                               max_positions=hf_config.module_max_positions(config), scaling=scaling)


def _layer_type(module: Any, config: Any, spec: hf_registry.AttentionSpec) -> str | None:
    """The layer type that picks the module's ``rope_parameters``: its attribute, or (ModernBERT)
    ``config.layer_types[module.layer_idx]``, as its model picks them."""
    if spec.layer_type_attr != hf_registry.CONFIG_LAYER_TYPE:
        return getattr(module, spec.layer_type_attr, None)
    kinds, idx = getattr(config, "layer_types", None), module.layer_idx
    if not isinstance(kinds, (list, tuple)) or not isinstance(idx, int) or not 0 <= idx < len(kinds):
        raise ValueError(f"{spec.name}: its layer type is config.layer_types[layer_idx]; got layer_types="
                         f"{kinds!r:.80} and layer_idx={idx!r}")
    return str(kinds[idx])


# ---- fused query_key_value: GPT-NeoX (Pythia), Falcon, BLOOM -----------------------------------------
def _qkv_grouped_links(module: nn.Module) -> list[_Link]:
    groups, per, d = hf_registry.qkv_groups(module)
    cuts = {"q_proj": slice(0, per * d), "k_proj": slice(per * d, (per + 1) * d),
            "v_proj": slice((per + 1) * d, (per + 2) * d)}
    links = [_Link(f"{o}.{p}", f"query_key_value.{p}", rows, groups=groups) for o, rows in cuts.items()
             for p in ("weight", "bias")]
    return links + [_Link(f"o_proj.{p}", f"dense.{p}") for p in ("weight", "bias")]


def _grouped_rows(t: torch.Tensor, link: _Link) -> torch.Tensor:
    """(G, n, ...) view of ``t``: rows ``link.rows`` of each of its ``link.groups`` blocks."""
    return t.unflatten(0, (link.groups, -1))[:, link.rows]


def _qkv_grouped_settings(module: Any, config: Any, state: dict[str, torch.Tensor],
                          spec: hf_registry.AttentionSpec) -> tuple[dict, dict]:
    """GPT-NeoX: RoPE on the first ``rotary_ndims`` dims, ``scaling``. Falcon (RoPE only: ALiBi is
    refused by its registry check): scores / sqrt(D), and no attention dropout, which its RoPE
    path never applies. BLOOM: ALiBi with the standard slopes, always causal (BloomModel's mask)."""
    head_dim = hf_registry.qkv_groups(module)[2]
    if spec.alibi:  # BLOOM: alibi · 1 (beta) + q·k · inv_norm_factor
        settings: dict[str, Any] = {"causal": True, "scale": float(module.inv_norm_factor), "alibi": True,
                                    "dropout": float(module.attention_dropout.p)}
    elif spec.name == "FalconAttention":
        settings = {"causal": bool(module.is_causal), "scale": float(module.inv_norm_factor), "dropout": 0.0,
                    "rope": _fused_rope(config, spec, head_dim)}
    else:  # GPTNeoXAttention (a float), PersimmonAttention (an nn.Dropout)
        dropout = module.attention_dropout
        dropout = dropout.p if isinstance(dropout, nn.Dropout) else dropout
        settings = {"causal": bool(module.is_causal), "scale": float(module.scaling),
                    "dropout": float(dropout or 0.0), "rope": _fused_rope(config, spec, head_dim)}
    return settings, {"head_dim": head_dim}


def _fused_rope(config: Any, spec: hf_registry.AttentionSpec, head_dim: int) -> RoPE:
    base, scaling, factor = hf_config.module_rope(config, None, f"{spec.name} config", partial=spec.partial_rotary)
    return RoPE.from_facts(head_dim, base, interleaved=spec.rope == "interleaved", rotary_dim=int(head_dim * factor),
                           max_positions=hf_config.module_max_positions(config), scaling=scaling)


# ---- out_proj and DistilBERT layouts (CLIP, OPT, BART, mBART, Whisper; DistilBERT) ------------------------
#: Layouts that are ours under other names: (HF name of q, k, v, o) per layout.
_RENAMED = {"out_proj": ("q_proj", "k_proj", "v_proj", "out_proj"),
            "distilbert": ("q_lin", "k_lin", "v_lin", "out_lin")}


def _renamed_links(family: str) -> list[_Link]:
    """q/k/v/o_proj weight and bias, each one HF tensor of the same shape under the layout's name."""
    return [_Link(f"{ours}.{p}", f"{theirs}.{p}") for ours, theirs in zip(("q_proj", "k_proj", "v_proj", "o_proj"),
                                                                          _RENAMED[family]) for p in ("weight", "bias")]


def _renamed_settings(module: Any, config: Any, state: dict[str, torch.Tensor],
                      spec: hf_registry.AttentionSpec) -> tuple[dict, dict]:
    """CLIP (``scale``), OPT/BART/mBART/Whisper (``scaling``), DistilBERT (``scaling``, an
    nn.Dropout): no position encoding, no window; causality from ``is_causal``."""
    heads = int(module.n_heads if spec.layout == "distilbert" else module.num_heads)
    scale = module.scale if spec.layout == "out_proj" and "scale" in vars(module) else module.scaling
    dropout = module.dropout.p if isinstance(module.dropout, nn.Dropout) else module.dropout
    settings = {"causal": bool(module.is_causal), "scale": float(scale), "dropout": float(dropout or 0.0)}
    return settings, {"head_dim": state["q_proj.weight"].shape[0] // heads}
