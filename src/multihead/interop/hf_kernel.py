"""multihead's attention kernel in transformers' ``AttentionInterface``, and HF's masks.

Notation: B batch, S tokens (queries), Sk keys, H query heads, Hkv key/value heads, D head_dim.

:func:`register` adds the kernel under ``"multihead"``; then
``attn_implementation="multihead"`` works for any model that dispatches through that
registry (HF keeps its own projections and RoPE, we do the softmax(QKᵀ)V). HF hands
attention a 4-D mask (B or 1, 1, S, Sk): bool (True = attend, the ``"sdpa"`` format,
which :func:`register` asks for) or additive float (``"eager"``: 0 or ``finfo.min``);
or None when the mask is purely causal or absent, with causality in
``module.is_causal``. transformers is imported only inside :func:`register`.

What it accepts, by name (:func:`refusal`, :func:`check_keywords`): a model that transformers
lets run ``attn_implementation="sdpa"`` (its class's ``_supports_sdpa``; the kernel keeps
SDPA's contract: bool or additive masks, ``is_causal``, ``scaling``), and the keyword arguments
of :data:`HONOURED` (computed), :data:`CARRIES_NOTHING` (model plumbing that transformers
forwards to every attention function, meaningless here) and :data:`REFUSED_WHEN_SET`. Any
other model or keyword is refused, naming it: PEGASUS-X, BigBird-Pegasus, NLLB-MoE,
BridgeTower, GIT and DeepSeek-V4 say ``_supports_sdpa = False`` and would be computed wrong.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from .._memo import derived
from ..functional import attention
from ..masks import from_additive

__all__ = ["BACKEND_ATTR", "WATCH_ATTR", "KernelCall", "KernelWatcher",
           "bool_mask", "written_keys", "hf_recording", "attention_forward", "register", "NAME", "refusal",
           "check_keywords", "KEYWORDS", "HONOURED", "CARRIES_NOTHING", "REFUSED_WHEN_SET", "SDPA_OFF_BUT_COMPUTED"]

#: The name under which :func:`register` installs the kernel.
NAME = "multihead"
#: The attribute, in a calling module's ``__dict__``, naming the core backend the kernel uses there
#: (set by ``multihead.hf.patch(backend=...)`` on the modules it routes to the kernel).
BACKEND_ATTR = "multihead_backend"
#: The attribute, in a calling module's ``__dict__``, holding the :class:`KernelWatcher` that sees
#: each of its kernel calls (set by :func:`multihead.heads.capture` while its block is open).
WATCH_ATTR = "multihead_watch"


@dataclass(frozen=True)
class KernelCall:
    """What one kernel call received, after HF's projections, RoPE, cache and mask building.

    Attributes:
        query: (B, H, S, D).
        key, value: (B, Hkv, Sk, D) and (B, Hkv, Sk, Dv): the keys the call attends (a cache's
            written ones).
        mask: bool (B|1, 1|H, S, Sk), True = attend, or None (HF's mask; an additive one with real
            values is in ``bias``).
        bias: float (B|1, H|1, S, Sk) added to the scaled logits (T5's relative bias, a mask with
            real values: ``finfo.min`` entries mask), or None.
        is_causal: the causality the module states (``is_causal=`` or ``module.is_causal``).
        sliding_window: the ``sliding_window=`` the module passes, or None.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None
    is_causal: bool
    sliding_window: Any


class KernelWatcher(Protocol):
    """Who watches a module's kernel calls (:data:`WATCH_ATTR`): told of each call before the kernel
    computes (it may refuse it by raising), and of its result after."""

    weights: bool  # the kernel must compute the weights, for the watcher

    def before(self, call: KernelCall) -> None:
        """Check ``call`` before anything is computed; raise to refuse it."""

    def after(self, call: KernelCall, out: torch.Tensor, weights: torch.Tensor | None) -> None:
        """``out`` (B, H, S, Dv), per head; ``weights`` (B, H, S, Sk) when :attr:`weights` is set."""


# ---- masks ------------------------------------------------------------------------------
def bool_mask(attention_mask: torch.Tensor | None, sk: int | None = None) -> torch.Tensor | None:
    """An HF 4-D mask (bool or additive float) as ours: bool (B|1, 1|H, S, Sk), True = attend.

    An additive mask is converted once per mask tensor while it is unchanged
    (:func:`multihead._memo.derived`): every layer of a model call gets the same one from
    transformers, and the conversion's half-dozen small tensor operations and read-back cost more
    than the bundled model's attention kernel at its shapes.

    Raises:
        ValueError: a mask that is not 4-D, or a float mask holding a real bias (ALiBi).
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be a 4-D HF mask [B, 1, S, Sk], got shape {list(attention_mask.shape)}")
    cut = sk if sk is not None and attention_mask.shape[-1] != sk else None  # HF built it for a longer cache
    if attention_mask.dtype == torch.bool:
        return attention_mask if cut is None else attention_mask[..., :cut]
    return derived(attention_mask, ("bool", cut), lambda m: from_additive(m if cut is None else m[..., :cut]))


# ---- what the kernel accepts -----------------------------------------------------------------
#: Keyword arguments the kernel computes with HF's meaning (besides ``scaling`` and ``dropout``).
HONOURED: dict[str, str] = {
    "is_causal": "causal attention where HF gives no mask (default: module.is_causal)",
    "sliding_window": "the causal window where HF gives no mask (a mask already holds it)",
    "softcap": "logit soft-capping, cap · tanh(s / cap) (Gemma 2)",
    "s_aux": "one sink logit per head, (H,) (gpt-oss)",
    "output_attentions": "the per-head weights (B, H, S, Sk) are returned",
    "position_bias": "an additive bias (B|1, H, S, Sk) on the scaled logits (T5's relative position bias): "
                     "the core's bias=",
    "cu_seq_lens_q": "packed sequences of one row: attention stays inside each (the core's cu_seqlens)",
    "cu_seq_lens_k": "the keys' bounds of packed sequences: must equal cu_seq_lens_q",
}
#: Keyword arguments transformers forwards to every attention function that carry nothing the
#: kernel computes (their work is done before it is called, or after), with the reason.
CARRIES_NOTHING: dict[str, str] = {
    "position_ids": "RoPE is applied before the kernel; packing by position is in HF's mask",
    "position_embeddings": "RoPE is applied before the kernel",
    "cache_position": "the cache is updated before the kernel",
    "use_cache": "the cache is updated before the kernel",
    "past_key_values": "the cache is updated before the kernel",
    "past_key_value": "the cache is updated before the kernel",
    "cache": "the cache is updated before the kernel",
    "encoder_hidden_states": "keys and values were projected from it before the kernel",
    "max_length_q": "flash-attn's launch bound for cu_seq_lens_q",
    "max_length_k": "flash-attn's launch bound for cu_seq_lens_k",
    "output_hidden_states": "the model's outputs",
    "output_router_logits": "the mixture of experts' outputs",
    "return_dict": "the model's outputs",
    "num_items_in_batch": "the loss's normaliser",
    "labels": "the loss's targets (Gemma 4's unified model hands them to its text model)",
    "deterministic": "flash-attn's switch for a deterministic backward (ModernBERT); no value depends on it",
}
#: Keyword arguments with a meaning the kernel does not compute: refused unless None.
REFUSED_WHEN_SET: dict[str, str] = {
    "head_mask": "a per-head scaling of the attention probabilities",
}
#: Every keyword argument the kernel knows: the named parameters of :func:`attention_forward` and
#: the three lists.
KEYWORDS = (frozenset(HONOURED) | frozenset(CARRIES_NOTHING) | frozenset(REFUSED_WHEN_SET)
            | {"module", "query", "key", "value", "attention_mask", "scaling", "dropout"})


def check_keywords(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse, by name, a keyword argument outside the three lists, or one of
    :data:`REFUSED_WHEN_SET` that is not None.

    Raises:
        TypeError: an unknown keyword (named, with the calling class).
        ValueError: a set keyword whose meaning the kernel does not compute.
    """
    unknown = kwargs.keys() - KEYWORDS
    if unknown:
        raise TypeError(f"{type(module).__name__} passed keyword argument(s) {sorted(unknown)} to the multihead "
                        f"kernel, which implements only {sorted(HONOURED)} (and ignores HF's plumbing "
                        f"{sorted(CARRIES_NOTHING)}); use attn_implementation='eager' for this model")
    for name, meaning in REFUSED_WHEN_SET.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} ({meaning}, passed by {type(module).__name__}) is not supported by the "
                             "multihead kernel")


#: Model types transformers keeps off SDPA for a logit feature SDPA lacks and the kernel computes
#: (or for a reason of its own tests), each compared exact with eager through the kernel, padded
#: and through greedy generation, in tests/interop/test_kernel_route.py: accepted all the same.
SDPA_OFF_BUT_COMPUTED: dict[str, str] = {
    "gemma2": "soft-capping (softcap=)",
    "vaultgemma": "soft-capping (softcap=)",
    "gpt_oss": "sinks (s_aux=)",
    "flint": "sinks (s_aux=)",
    "granite_swa": "sinks (s_aux=)",
    "granitemoe_swa": "sinks (s_aux=)",
    "mimo_v2_flash": "sinks (s_aux=) and values wider than keys (D_v != D)",
    "speech_to_text": "its tests' inputs (transformers: 'tests always assume certain inputs'), not its attention",
    "time_series_transformer": "its tests' inputs (as speech_to_text), not its attention",
    "splinter": "BERT's attention; the class never sets _supports_sdpa (the default False), no gap is named",
}

#: Per config class (or attention class, for a module without a config): why the kernel refuses
#: its model, or None. Facts of transformers' classes, computed once each.
_REFUSALS: dict[type, str | None] = {}


def refusal(module: nn.Module | None = None, config: object | None = None) -> str | None:
    """Why the kernel refuses the model of ``config`` (default ``module.config``), or None.

    A model is accepted where transformers lets it run ``attn_implementation="sdpa"``: its
    model class (``MODEL_MAPPING_NAMES[config.model_type]``, else the classes of the config's
    modeling module built on that config class) says ``_supports_sdpa = True``. A module
    without a config is judged by the model classes of its own modeling module.
    """
    if config is None and module is not None:
        config = getattr(module, "config", None)
    key = type(config) if config is not None else type(module)
    if key not in _REFUSALS:
        _REFUSALS[key] = _sdpa_refusal(config, type(module) if module is not None else None)
    return _REFUSALS[key]


def _sdpa_refusal(config: object | None, module_cls: type | None) -> str | None:
    import transformers
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    if getattr(config, "model_type", None) in SDPA_OFF_BUT_COMPUTED:
        return None
    models: list[type] = []
    if config is not None:
        names = MODEL_MAPPING_NAMES.get(getattr(config, "model_type", None) or "", ())
        for name in (names,) if isinstance(names, str) else names:
            model = getattr(transformers, name, None)
            models += [model] if isinstance(model, type) else []
        where = type(config).__module__.replace(".configuration_", ".modeling_")
    else:
        assert module_cls is not None
        where = module_cls.__module__
    if not models:  # the model classes of the modeling module (built on this config class, if any)
        modeling = sys.modules.get(where)  # imported when its model runs
        if modeling is None:
            return None
        models = [c for c in vars(modeling).values() if isinstance(c, type) and issubclass(c, PreTrainedModel)
                  and c.__module__ == where and (config is None or getattr(c, "config_class", None) is type(config))]
        if config is None and any(getattr(c, "_supports_sdpa", False) for c in models):
            return None  # no config to tell the models apart: one supporting SDPA is enough
    refusing = [c.__name__ for c in models if not getattr(c, "_supports_sdpa", False)]
    if not refusing:
        return None
    kind = f" (model type {config.model_type!r})" if config is not None and hasattr(config, "model_type") else ""
    return (f"attn_implementation={NAME!r} is refused for {', '.join(refusing)}{kind}: transformers marks it "
            "_supports_sdpa=False (it refuses 'sdpa' too), so its attention does not keep the contract the kernel "
            "implements; use attn_implementation='eager', or multihead.hf.patch where its class is supported")


# ---- the kernel for AttentionInterface ------------------------------------------------------
def written_keys(mask: torch.Tensor | None, sq: int, sk: int, causal: bool) -> tuple[torch.Tensor | None, int]:
    """(mask, n): the keys of an HF cache a call attends to are its first n of Sk.

    HF hands the whole cache (B, Hkv, Sk, D) back from ``cache.update``; its mask (B|1, 1, S,
    Sk') covers the keys, so it is cut to Sk. HF drops the mask with Sk > S only when
    prefilling an empty static cache (purely causal): the keys past S are then unwritten
    slots, which HF's own kernels slice off too, so n = S.
    """
    if mask is not None:
        return mask[..., :sk], sk
    return None, (sq if causal and 1 < sq < sk else sk)


def hf_recording() -> dict[str, Any] | None:
    """The outputs transformers (5) is collecting for the running forward (``output_attentions=True``
    collects ``"attentions"``), or None when it collects nothing or is not installed.

    transformers 5 records attention weights with forward hooks on the attention modules and
    passes no ``output_attentions`` to them: its collector is the only way a module learns that
    the weights are wanted before computing them.
    """
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return None
    collector = getattr(output_capturing, "_active_collector", None)  # transformers' own state
    collecting = None if collector is None else collector.get()
    return collecting if isinstance(collecting, dict) else None


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention-function signature, computed by :func:`multihead.attention`.

    Args:
        module: the calling HF attention module (read for ``is_causal``).
        query: (B, H, S, D).
        key, value: (B, Hkv, Sk, D): GQA is handled by grouping, never by repeating K/V.
        attention_mask: 4-D bool (True = attend) or additive float, or None.
        scaling: logit scale; default 1/√D.
        dropout: attention-probability dropout (HF passes 0 in eval).
        **kwargs: :data:`HONOURED`: ``is_causal`` (else ``module.is_causal``), ``sliding_window``,
            ``output_attentions`` (then weights are returned), ``softcap`` (Gemma 2/3),
            ``s_aux`` (gpt-oss's sinks, (H,)), ``cu_seq_lens_q``/``_k`` (packed sequences, B = 1);
            :data:`CARRIES_NOTHING`, ignored; :data:`REFUSED_WHEN_SET` (``head_mask``) unless None.

    Returns:
        (attn_output (B, S, H, D), weights (B, H, S, Sk) or None), as HF expects.

    Raises:
        ValueError: a model transformers does not let run SDPA (:func:`refusal`), or packed
            sequences the core cannot take.
        TypeError: a keyword argument outside :data:`HONOURED`, :data:`CARRIES_NOTHING` and
            :data:`REFUSED_WHEN_SET`.
    """
    why = refusal(module)
    if why is not None:
        raise ValueError(why)
    check_keywords(module, kwargs)
    sq, sk = query.shape[2], key.shape[2]
    mask, bias = _mask_and_bias(attention_mask, kwargs.get("position_bias"), sk)
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
    # HF drops its mask only when causality alone describes it; one query (decoding) sees all keys.
    causal = bool(is_causal) and mask is None and sq > 1
    window = kwargs.get("sliding_window") if causal else None  # with a mask, the window is already in it
    _, n = written_keys(None, sq, sk, causal)
    key, value = key[:, :, :n], value[:, :, :n]
    want_weights = bool(kwargs.get("output_attentions", False))
    bias = None if bias is None else bias[..., :n]
    watcher: KernelWatcher | None = module.__dict__.get(WATCH_ATTR)
    call = KernelCall(query, key, value, mask, bias, bool(is_causal), kwargs.get("sliding_window"))
    if watcher is not None:
        watcher.before(call)
    result = attention(query, key, value, causal=causal, mask=mask, window=window, scale=scaling,
                       dropout_p=dropout, return_weights=want_weights or (watcher is not None and watcher.weights),
                       softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"), cu_seqlens=_packed(query, key, kwargs),
                       bias=bias, backend=module.__dict__.get(BACKEND_ATTR))
    out, weights = result if isinstance(result, tuple) else (result, None)  # (B, H, S, D); a tuple iff weights asked
    if watcher is not None:
        watcher.after(call, out, weights)
    return out.transpose(1, 2).contiguous(), weights if want_weights else None  # (B, S, H, D)


def _mask_and_bias(attention_mask: torch.Tensor | None, position_bias: torch.Tensor | None,
                   sk: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """HF's mask and T5's position bias as the core's ``mask`` (bool) and ``bias`` (float).

    A bool mask, or an additive one holding only 0 and the dtype's minimum, is a mask; an additive
    one with real values (a bias folded into the mask) is added as it is, as eager attention adds it.
    """
    try:
        mask = bool_mask(attention_mask, sk)
    except ValueError:
        if attention_mask is None or attention_mask.dim() != 4:
            raise
        real = attention_mask[..., :sk]  # (B|1, 1|H, S, Sk) additive, with real values
        return None, real if position_bias is None else position_bias[..., :sk] + real
    return mask, None if position_bias is None else position_bias[..., :sk]


def _packed(query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """HF's ``cu_seq_lens_q`` (N+1,) as the core's ``cu_seqlens``, or None when not given.

    Raises:
        ValueError: packed sequences over more than one row, or keys packed unlike queries.
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    if cu_q is None or cu_k is None or query.shape[0] != 1 or query.shape[2] != key.shape[2] \
            or not torch.equal(cu_q, cu_k):
        raise ValueError("cu_seq_lens_q/cu_seq_lens_k (packed sequences) are supported by the multihead kernel "
                         "for one row of packed self-attention (B = 1, equal bounds for queries and keys) only, got "
                         f"query {list(query.shape)}, key {list(key.shape)}")
    return cu_q


def _mask_for_accepted_models(sdpa_mask: Any) -> Any:
    """HF's ``sdpa_mask`` (bool, True = attend), refusing a model :func:`refusal` refuses: the
    mask is built for every model set to the kernel, also one whose attention never calls it
    (GIT's text layers add it as if it were eager's additive mask)."""

    def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        config = kwargs.get("config")
        why = None if config is None else refusal(config=config)
        if why is not None:
            raise ValueError(why)
        return sdpa_mask(*args, **kwargs)

    return mask


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` with transformers as ``name`` (idempotent).

    It also registers HF's ``sdpa_mask`` under the same name in ``AttentionMaskInterface``,
    so models build bool masks (True = attend) for it; without a mask function HF would
    build no padding mask at all for an unknown implementation. Both refuse a model that
    transformers does not let run ``"sdpa"`` (:func:`refusal`), at its first forward.

    Returns:
        ``name``, for ``from_pretrained(..., attn_implementation=name)``,
        ``model.set_attn_implementation(name)`` or a config's ``_attn_implementation``.

    Raises:
        ValueError: ``name`` is empty or one of HF's own implementations.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not isinstance(name, str) or not name or name in ("eager", "sdpa") or name.startswith("flash"):
        raise ValueError(f"name must be a new non-empty implementation name, got {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _mask_for_accepted_models(sdpa_mask))
    return name


