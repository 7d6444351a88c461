"""Converters at the edges: torch and Hugging Face modules, configs and checkpoint files.

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads, D head_dim.

Inside multihead every layer is a :class:`~multihead.MultiHeadAttention` with four
``nn.Linear`` (``y = x · Wᵀ + b``, weights ``[out, in]``), batch-first tensors and masks
where True = may attend. Peers store the same numbers differently; this module maps them:

* ``torch.nn.MultiheadAttention``: ``in_proj_weight`` [3E, E] (or ``q/k/v_proj_weight``)
  and ``out_proj``; seq-first by default, masks True = ignore.
* BERT family (BertAttention): ``self.query/key/value``; W_o is ``output.dense``, followed
  by dropout, the residual and a LayerNorm.
* GPT-2 family (GPT2Attention): fused ``c_attn`` and ``c_proj`` Conv1D, stored ``[in, out]``,
  the transpose of nn.Linear.
* Llama family (Llama, Mistral, Qwen2, ...): ``q_proj/k_proj/v_proj/o_proj`` nn.Linear,
  our names and layout; RoPE rotate-half.

Only the attention part is converted: BertAttention's output adds dropout, the residual
and a LayerNorm, which belong to the surrounding block (:func:`multihead.hf.patch` keeps
them around the converted layer). Checkpoints are read with safetensors only; pickles
(``.bin``, ``.pt``, ...) are never unpickled (:func:`load_safetensors`).

transformers is never imported here at module level; the converters recognise modules by
their attributes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import AttentionConfig
from .module import MultiHeadAttention
from .rope import RoPE, half_to_interleaved, interleaved_to_half

__all__ = [
    "from_torch", "from_hf", "from_config", "to_hf", "hf_family", "state_from_hf", "state_to_hf",
    "load_safetensors", "load_state", "interleaved_to_half", "half_to_interleaved", "PICKLE_SUFFIXES",
]

#: File suffixes of pickled checkpoints, refused by :func:`load_safetensors`.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
#: RoPE tables are precomputed up to this many positions; later ones are computed on the fly.
ROPE_TABLE_POSITIONS = 8192
#: Keyword overrides a converter accepts: settings, never sizes (the weights fix those).
OVERRIDABLE = frozenset({"causal", "dropout", "scale", "window", "backend", "rope"})


# ---- torch.nn.MultiheadAttention ------------------------------------------------------
def from_torch(module: nn.Module, **overrides: Any) -> MultiHeadAttention:
    """Convert a ``torch.nn.MultiheadAttention``, copying its weights.

    Our layer is always batch-first, (B, S, E); ``batch_first`` of the torch module only
    says how *it* reads inputs, so the converter copies weights and ignores it: transpose
    seq-first inputs (S, B, E) yourself. Torch masks use True = ignore; convert them with
    :func:`multihead.masks.from_torch_mha`. ``kdim``/``vdim`` are carried (cross-attention
    through ``context``, which feeds both k_proj and v_proj, so ``key is value``).

    Args:
        module: a ``torch.nn.MultiheadAttention``.
        **overrides: settings the torch module does not have: ``causal``, ``scale``,
            ``window``, ``backend``, ``rope``, ``dropout``.

    Returns:
        a :class:`MultiHeadAttention` on the module's device and dtype, same mode.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.MultiheadAttention``.
        ValueError: ``add_bias_kv`` or ``add_zero_attn`` (no equivalent), or an
            override that is not a setting.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError("module has add_bias_kv=True or add_zero_attn=True: extra learned or zero key/value "
                         "slots have no equivalent in multihead")
    e, h = module.embed_dim, module.num_heads
    if module._qkv_same_embed_dim:
        w_q, w_k, w_v = module.in_proj_weight.detach().chunk(3)  # [E, E] each
    else:
        w_q, w_k, w_v = (module.q_proj_weight.detach(), module.k_proj_weight.detach(),
                         module.v_proj_weight.detach())
    state = {"q_proj.weight": w_q, "k_proj.weight": w_k, "v_proj.weight": w_v,
             "o_proj.weight": module.out_proj.weight.detach()}
    bias = module.in_proj_bias is not None
    if bias:
        b_q, b_k, b_v = module.in_proj_bias.detach().chunk(3)
        state.update({"q_proj.bias": b_q, "k_proj.bias": b_k, "v_proj.bias": b_v})
    o_bias = module.out_proj.bias is not None
    if o_bias:
        state["o_proj.bias"] = module.out_proj.bias.detach()
    settings = _settings({"dropout": float(module.dropout)}, overrides)
    layer = MultiHeadAttention(e, h, bias=bias, o_bias=o_bias, kdim=module.kdim, vdim=module.vdim,
                               device=w_q.device, dtype=w_q.dtype, **settings)
    load_state(layer, state)
    return layer.train(module.training)


# ---- Hugging Face modules ---------------------------------------------------------------
@dataclass(frozen=True)
class _Link:
    """Our tensor ``ours`` is rows ``rows`` of HF tensor ``theirs`` (transposed first if ``transpose``)."""

    ours: str
    theirs: str
    rows: slice | None = None
    transpose: bool = False


def hf_family(module: nn.Module) -> str | None:
    """Which supported Hugging Face layout ``module`` has, recognised by its attributes.

    Returns:
        ``"bert"`` (BertAttention: ``.self`` + ``.output.dense``), ``"bert-self"``
        (BertSelfAttention: query/key/value, no W_o), ``"gpt2"`` (``c_attn`` + ``c_proj``),
        ``"llama"`` (q_proj/k_proj/v_proj/o_proj nn.Linear: Llama, Mistral, Qwen2, ...),
        or None for anything else.
    """
    inner = getattr(module, "self", None)
    dense = getattr(getattr(module, "output", None), "dense", None)
    if isinstance(inner, nn.Module) and _has_linears(inner, "query", "key", "value") and isinstance(dense, nn.Linear):
        return "bert"
    if _has_linears(module, "query", "key", "value") and hasattr(module, "num_attention_heads"):
        return "bert-self"
    if hasattr(module, "c_attn") and hasattr(module, "c_proj") and hasattr(module, "head_dim"):
        return "gpt2"
    if _has_linears(module, "q_proj", "k_proj", "v_proj", "o_proj") and hasattr(module, "head_dim"):
        return "llama"
    return None


def _has_linears(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def _links(module: nn.Module, family: str) -> list[_Link]:
    if family in ("bert", "bert-self"):
        pre = "self." if family == "bert" else ""
        links = [_Link(f"{o}.{p}", f"{pre}{t}.{p}") for o, t in
                 (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")) for p in ("weight", "bias")]
        if family == "bert":
            links += [_Link("o_proj.weight", "output.dense.weight"), _Link("o_proj.bias", "output.dense.bias")]
    elif family == "gpt2":
        e = module.c_proj.weight.shape[1]  # Conv1D weight is [in, out]
        links = [_Link(f"{o}.weight", "c_attn.weight", slice(i * e, (i + 1) * e), transpose=True)
                 for i, o in enumerate(("q_proj", "k_proj", "v_proj"))]
        links += [_Link(f"{o}.bias", "c_attn.bias", slice(i * e, (i + 1) * e))
                  for i, o in enumerate(("q_proj", "k_proj", "v_proj"))]
        links += [_Link("o_proj.weight", "c_proj.weight", transpose=True), _Link("o_proj.bias", "c_proj.bias")]
    else:
        links = [_Link(f"{n}.{p}", f"{n}.{p}") for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                 for p in ("weight", "bias")]
    params = dict(module.named_parameters())
    return [link for link in links if params.get(link.theirs) is not None]


def _family_or_raise(module: nn.Module) -> str:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    family = hf_family(module)
    if family is None:
        raise ValueError(f"module {type(module).__name__} is not a supported Hugging Face attention layout "
                         "(BertAttention/BertSelfAttention, GPT2Attention, or q_proj/k_proj/v_proj/o_proj "
                         "like LlamaAttention, MistralAttention, Qwen2Attention)")
    return family


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
        view = view if link.rows is None else view[link.rows]
        if tuple(view.shape) != tuple(state[link.ours].shape):
            raise ValueError(f"state[{link.ours!r}] must have shape {list(view.shape)} for {link.theirs}, "
                             f"got {list(state[link.ours].shape)}")
        view.copy_(state[link.ours])
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

    Supported layouts (see :func:`hf_family`): BertAttention (W_o = ``output.dense``; the
    dropout + residual + LayerNorm after it is *not* part of the result), BertSelfAttention
    (no W_o: ``o_proj`` is the identity, without bias), GPT2Attention (fused Conv1D,
    transposed), and the q_proj/k_proj/v_proj/o_proj family (Llama, Mistral with its
    sliding window, Qwen2 with q/k/v bias and no o bias). Heads, KV heads (GQA), bias,
    causal, the logit scale (``module.scaling``: GPT-2's ``scale_attn_weights=False`` and
    ``scale_attn_by_inverse_layer_idx`` included) and RoPE (base, from the config) carry over.

    Args:
        module: the HF attention module (eval mode recommended; dropout carries over).
        config: the model config; default ``module.config``. Read for RoPE and windows.
        **overrides: ``causal``, ``scale``, ``window``, ``backend``, ``rope``, ``dropout``.

    Returns:
        a :class:`MultiHeadAttention` on the module's device and dtype, same train/eval mode.

    Raises:
        TypeError: ``module`` is not an nn.Module.
        ValueError: an unsupported layout or feature (cross-attention, relative position
            embeddings, q/k norms, logit soft-capping, RoPE scaling other than the default
            or partial rotary in the Llama family), naming it.
    """
    family = _family_or_raise(module)
    config = config if config is not None else getattr(module, "config", None)
    state = state_from_hf(module)  # our names and layout
    w = state["q_proj.weight"]  # (H·D, E)
    read = {"bert": _bert_settings, "bert-self": _bert_settings, "gpt2": _gpt2_settings, "llama": _llama_settings}
    settings, sizes = read[family](module, config, state)
    head_dim = sizes.pop("head_dim")
    layer = MultiHeadAttention(
        w.shape[1], w.shape[0] // head_dim, num_kv_heads=state["k_proj.weight"].shape[0] // head_dim,
        head_dim=head_dim, bias="q_proj.bias" in state, o_bias=sizes.pop("o_bias", "o_proj.bias" in state),
        **_settings(settings, overrides), device=w.device, dtype=w.dtype,
    )
    load_state(layer, state)
    return layer.train(module.training)


# Each reader returns (settings, sizes) and may complete ``state`` (BertSelfAttention's W_o).
def _bert_settings(module: nn.Module, config: Any, state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    inner = getattr(module, "self", module)  # BertAttention.self, or a BertSelfAttention itself
    if getattr(module, "is_cross_attention", False) or "CrossAttention" in type(inner).__name__:
        raise ValueError(f"module {type(module).__name__} is a cross-attention: not supported")
    kind = getattr(inner, "position_embedding_type", None) or getattr(config, "position_embedding_type", None)
    if kind not in (None, "absolute"):
        raise ValueError(f"position_embedding_type={kind!r} (relative position scores) is not supported; "
                         "only 'absolute'")
    w = state["q_proj.weight"]
    head_dim = w.shape[0] // inner.num_attention_heads
    sizes: dict[str, Any] = {"head_dim": head_dim}
    if "o_proj.weight" not in state:  # BertSelfAttention: no W_o, so o_proj is the identity
        state["o_proj.weight"] = torch.eye(w.shape[0], dtype=w.dtype, device=w.device)
        sizes["o_bias"] = False
    settings = {"causal": bool(getattr(inner, "is_causal", False)),
                "scale": float(getattr(inner, "scaling", head_dim ** -0.5)), "dropout": float(inner.dropout.p)}
    return settings, sizes


def _gpt2_settings(module: nn.Module, config: Any, state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    if getattr(module, "is_cross_attention", False) or hasattr(module, "q_attn"):
        raise ValueError("module is a GPT-2 cross-attention (is_cross_attention=True): not supported")
    if hasattr(module, "scaling"):  # transformers folds scale_attn_weights and the layer-index option in
        scale = float(module.scaling)
    else:
        scale = module.head_dim ** -0.5 if getattr(module, "scale_attn_weights", True) else 1.0
        if getattr(module, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(module.layer_idx + 1)
    settings = {"causal": bool(getattr(module, "is_causal", True)), "scale": scale,
                "dropout": float(module.attn_dropout.p)}
    return settings, {"head_dim": int(module.head_dim)}


def _llama_settings(module: nn.Module, config: Any, state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    if getattr(module, "is_cross_attention", False):
        raise ValueError(f"module {type(module).__name__} is a cross-attention: not supported")
    for name in ("q_norm", "k_norm"):
        if getattr(module, name, None) is not None:
            raise ValueError(f"module has {name} (per-head q/k normalisation, Qwen3/OLMo 2 style): not supported")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("config.attn_logit_softcapping is set: logit soft-capping is not supported")
    head_dim = int(module.head_dim)
    settings: dict[str, Any] = {
        "causal": bool(getattr(module, "is_causal", True)),
        "scale": float(getattr(module, "scaling", head_dim ** -0.5)),
        "dropout": float(getattr(module, "attention_dropout", 0.0) or 0.0),
        "window": getattr(module, "sliding_window") if hasattr(module, "sliding_window")
        else getattr(config, "sliding_window", None),
        "rope": _hf_rope(config, head_dim),
    }
    num_heads = state["q_proj.weight"].shape[0] // head_dim
    heads = getattr(config, "num_attention_heads", None)
    if heads is not None and heads != num_heads:
        raise ValueError(f"config.num_attention_heads={heads} contradicts q_proj ({num_heads} heads "
                         f"of head_dim {head_dim})")
    return settings, {"head_dim": head_dim}


def _hf_rope(config: Any, head_dim: int) -> RoPE:
    """Our RoPE for a Llama-family config: default rope type only, full rotary."""
    if config is None:
        raise ValueError("config is required for a Llama-family module (RoPE settings); pass config=")
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config rope_parameters rope_type={rope_type!r} is not supported; only 'default'")
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    if factor != 1.0:
        raise ValueError(f"config partial_rotary_factor={factor} is not supported for this family; only 1.0")
    positions = getattr(config, "max_position_embeddings", None) or ROPE_TABLE_POSITIONS
    return RoPE(head_dim, float(base), max_positions=min(int(positions), ROPE_TABLE_POSITIONS))


def _settings(defaults: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - OVERRIDABLE)
    if unknown:
        raise ValueError(f"overrides may only set {sorted(OVERRIDABLE)} (sizes come from the weights), "
                         f"got {unknown}")
    return {**defaults, **overrides}


# ---- configs ------------------------------------------------------------------------------
def from_config(
    config: AttentionConfig,
    *,
    layer: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> MultiHeadAttention:
    """Build an (untrained) layer of the shape ``config`` describes.

    Args:
        config: an :class:`~multihead.AttentionConfig`.
        layer: which layer (0-based) for per-layer head counts (``layer_num_heads``).
        device: e.g. ``"meta"`` to build without allocating (shapes only).
        dtype: of the parameters.
        **overrides: ``causal``, ``scale``, ``window``, ``backend``, ``rope``, ``dropout``.

    Returns:
        a :class:`MultiHeadAttention` with freshly initialised weights (and RoPE on ``device``).

    Raises:
        TypeError: ``config`` is not an AttentionConfig.
        ValueError: ``layer`` out of range, or a bad override.
    """
    if not isinstance(config, AttentionConfig):
        raise TypeError(f"config must be a multihead.AttentionConfig, got {type(config).__name__}")
    h, hkv = config.heads_in_layer(layer)
    rope = None
    if config.rope_base is not None:
        positions = min(config.max_positions or ROPE_TABLE_POSITIONS, ROPE_TABLE_POSITIONS)
        rope = RoPE(config.head_dim, config.rope_base, interleaved=config.rope_interleaved,
                    rotary_dim=config.rotary_dim, max_positions=positions)
    settings = _settings({"causal": config.causal, "scale": config.scale, "window": config.window,
                          "rope": rope}, overrides)
    built = MultiHeadAttention(config.embed_dim, h, num_kv_heads=hkv, head_dim=config.head_dim,
                               bias=config.bias, o_bias=config.effective_o_bias, device=device, dtype=dtype,
                               **settings)
    if built.rope is not None and device is not None:
        built.rope.to(device)
    return built


# ---- checkpoint files -----------------------------------------------------------------------
def load_safetensors(path: str | os.PathLike[str], *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read tensors from a ``.safetensors`` file, or from a folder's ``model.safetensors``.

    A sharded folder (``model.safetensors.index.json``) is read shard by shard. Pickled
    checkpoints are refused without being opened: unpickling runs arbitrary code, so
    multihead never calls ``torch.load`` on them. Convert them once in a trusted
    environment (e.g. ``safetensors.torch.save_file``).

    Args:
        path: a ``.safetensors`` file or a checkpoint folder.
        device: where to put the tensors.

    Returns:
        ``{name: tensor}``.

    Raises:
        ValueError: a pickle suffix (``.bin``, ``.pt``, ``.pth``, ``.pkl``, ``.ckpt``), a
            folder with only pickled weights, another suffix, or a corrupt file (named).
        FileNotFoundError: nothing at ``path``.
    """
    import json

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise ValueError(f"{path}: pickled checkpoints ({', '.join(PICKLE_SUFFIXES)}) are refused: unpickling "
                         "can run arbitrary code, so multihead never unpickles; convert the file to .safetensors")
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from e
            out: dict[str, torch.Tensor] = {}
            for shard in shards:
                out.update(load_safetensors(path / shard, device=device))
            return out
        single = path / "model.safetensors"
        if not single.is_file():
            pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
            why = f" (only pickled weights {pickles}, which are refused)" if pickles else ""
            raise ValueError(f"{path}: no model.safetensors{why}")
        path = single
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: expected a .safetensors file, got suffix {path.suffix!r}")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e


def load_state(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    prefix: str = "",
    ignore: Iterable[str] = (),
) -> nn.Module:
    """Load ``tensors`` into ``module`` strictly, with errors that name the key.

    Every entry of ``module.state_dict()`` must be present with the same shape, and every
    tensor must be used. Tensors naming a non-persistent buffer (``position_ids`` in BERT
    checkpoints) are accepted and skipped. Values are cast to each parameter's dtype.

    Args:
        module: e.g. a :class:`MultiHeadAttention` or a transformers model.
        tensors: ``{name: tensor}``, e.g. from :func:`load_safetensors`.
        prefix: strip this from the tensor names first (``"bert."``); names without it
            are then treated as extra.
        ignore: tensor names to skip silently (e.g. a head the module does not have).

    Returns:
        ``module``.

    Raises:
        ValueError: a missing tensor, an extra tensor, or a shape mismatch, naming the key.
    """
    ignore = set(ignore)
    given = {(k[len(prefix):] if prefix and k.startswith(prefix) else k): v
             for k, v in tensors.items() if k not in ignore}
    expected = module.state_dict()
    buffers = {name for name, _ in module.named_buffers()}
    missing = sorted(set(expected) - set(given))
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r}" +
                         (f" (and {len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else ""))
    extra = sorted(set(given) - set(expected) - buffers)
    if extra:
        raise ValueError(f"checkpoint has unexpected tensor {extra[0]!r}" +
                         (f" (and {len(extra) - 1} more: {extra[1:4]})" if len(extra) > 1 else ""))
    for name, want in expected.items():
        got = given[name]
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {list(got.shape)}, "
                             f"expected {list(want.shape)}")
        if not isinstance(got, torch.Tensor) or not (got.is_floating_point() == want.is_floating_point()):
            raise ValueError(f"checkpoint tensor {name!r} has dtype {getattr(got, 'dtype', type(got))}, "
                             f"expected a tensor like {want.dtype}")
    module.load_state_dict({k: given[k] for k in expected}, strict=True)
    return module
