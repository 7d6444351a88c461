"""multihead's attention kernel in transformers' ``AttentionInterface``, and HF's masks.

Notation: B batch, S tokens (queries), Sk keys, H query heads, Hkv key/value heads, D head_dim.

:func:`register` adds the kernel under ``"multihead"``; then
``attn_implementation="multihead"`` works for any model that dispatches through that
registry (HF keeps its own projections and RoPE, we do the softmax(QKᵀ)V). HF hands
attention a 4-D mask (B or 1, 1, S, Sk): bool (True = attend, the ``"sdpa"`` format,
which :func:`register` asks for) or additive float (``"eager"``: 0 or ``finfo.min``);
or None when the mask is purely causal or absent, with causality in
``module.is_causal``. transformers is imported only inside :func:`register`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..functional import attention
from ..masks import from_additive

__all__ = ["bool_mask", "written_keys", "hf_recording", "attention_forward", "register", "NAME"]

#: The name under which :func:`register` installs the kernel.
NAME = "multihead"


# ---- masks ------------------------------------------------------------------------------
def bool_mask(attention_mask: torch.Tensor | None, sk: int | None = None) -> torch.Tensor | None:
    """An HF 4-D mask (bool or additive float) as ours: bool (B|1, 1|H, S, Sk), True = attend.

    Raises:
        ValueError: a mask that is not 4-D, or a float mask holding a real bias (ALiBi).
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be a 4-D HF mask [B, 1, S, Sk], got shape {list(attention_mask.shape)}")
    mask = attention_mask if sk is None else attention_mask[..., :sk]  # may be built for a longer cache
    return mask if mask.dtype == torch.bool else from_additive(mask)


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
        **kwargs: ``is_causal`` (else ``module.is_causal``), ``sliding_window``,
            ``output_attentions`` (then weights are returned), ``softcap`` (Gemma 2/3),
            ``s_aux`` (gpt-oss's sinks, (H,)); ``position_bias`` is refused.

    Returns:
        (attn_output (B, S, H, D), weights (B, H, S, Sk) or None), as HF expects.

    Raises:
        ValueError: a position bias, or an additive mask with real bias values.
    """
    if kwargs.get("position_bias") is not None:
        raise ValueError("position_bias (additive attention bias, T5 style) is not supported by the multihead kernel")
    sq, sk = query.shape[2], key.shape[2]
    mask = bool_mask(attention_mask, sk)
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
    # HF drops its mask only when causality alone describes it; one query (decoding) sees all keys.
    causal = bool(is_causal) and mask is None and sq > 1
    window = kwargs.get("sliding_window") if causal else None  # with a mask, the window is already in it
    _, n = written_keys(None, sq, sk, causal)
    key, value = key[:, :, :n], value[:, :, :n]
    want_weights = bool(kwargs.get("output_attentions", False))
    result = attention(query, key, value, causal=causal, mask=mask, window=window, scale=scaling,
                       dropout_p=dropout, return_weights=want_weights, softcap=kwargs.get("softcap"),
                       sinks=kwargs.get("s_aux"))
    out, weights = result if isinstance(result, tuple) else (result, None)  # (B, H, S, D); a tuple iff want_weights
    return out.transpose(1, 2).contiguous(), weights  # (B, S, H, D)


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` with transformers as ``name`` (idempotent).

    It also registers HF's ``sdpa_mask`` under the same name in ``AttentionMaskInterface``,
    so models build bool masks (True = attend) for it; without a mask function HF would
    build no padding mask at all for an unknown implementation.

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
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


