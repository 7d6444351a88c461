"""The checks of one call of :class:`multihead.MultiHeadAttention`, all before any work.

Notation: B batch, S tokens (queries), Sk keys, E embed_dim, H query heads.

:func:`validate_call` runs every check of a call once, before anything is computed or
written to a cache: the layer's ``forward`` calls it first, then trusts its inputs.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from ._checks import check_bool_mask, check_finite as _check_finite, check_tensor
from .cache import KVCache
from .masks import key_padding_mask, packed_cu_seqlens
from .rope import RoPE, check_positions

__all__ = ["validate_call", "Inputs", "refuse_unexpected", "refuse_positional", "ATTENTION_HABITS",
           "LAYER_HABITS"]


class Layer(Protocol):
    """What the checks read of a :class:`multihead.MultiHeadAttention` (its sizes and parts)."""

    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kdim: int
    causal: bool
    rope: RoPE | None
    alibi_slopes: torch.Tensor | None
    q_proj: nn.Linear

    def parameters(self, recurse: bool = True) -> Any: ...


class Inputs(NamedTuple):
    """A validated call, as the steps take it.

    Attributes:
        real: with a cache, real new tokens per row (right padding), or None (all real).
        mask: the combined 4-D bool mask (B|1, H|1, S|1, Sk|1) (mask and key_mask), or None.
        positions: RoPE positions (S,) or (B, S) as given, or None (see :meth:`rope_positions`).
        cu_seqlens: (B|1, N+1) packed sequences' bounds (``packed=True``), or None.
    """

    real: list[int] | None
    mask: torch.Tensor | None
    positions: torch.Tensor | None
    cu_seqlens: torch.Tensor | None

    def rope_positions(self, cache: KVCache | None, s: int) -> tuple[torch.Tensor | None, int | None]:
        """(positions, bound) for the RoPE step: the given ones, or with a cache each row's next
        ``s`` positions (B, S) with their exclusive bound known on the host (no device read)."""
        if cache is None or self.positions is not None:
            return self.positions, None
        return cache.positions(s), max(cache.host_lengths()) + s


#: Keywords of torch's attention APIs that :func:`multihead.attention` does not take, each with
#: its multihead equivalent (multihead's masks are bool, True = may attend).
ATTENTION_HABITS: dict[str, str] = {
    "attn_mask": "pass mask= (bool, True = may attend, broadcastable to (B, H, Sq, Sk)): a boolean attn_mask "
                 "of scaled_dot_product_attention has that polarity already (mask=attn_mask); one of "
                 "nn.MultiheadAttention means True = ignore (mask=multihead.masks.from_torch_mha(attn_mask)); "
                 "an additive float mask: mask=multihead.masks.from_additive(attn_mask)",
    "is_causal": "pass causal=True (aligned bottom-right: query i sees keys up to i + Sk - Sq; "
                 "scaled_dot_product_attention's is_causal aligns top-left, the same when Sq == Sk)",
    "key_padding_mask": "torch's key_padding_mask (B, Sk) means True = ignore (padding); pass "
                        "mask=multihead.masks.key_padding_mask(~key_padding_mask) ((B, 1, 1, Sk), True = may attend)",
    "need_weights": "pass return_weights=True: the per-head weights (B, H, Sq, Sk), never averaged "
                    "(torch averages over heads by default: take weights.mean(dim=1))",
    "average_attn_weights": "weights are never averaged: pass return_weights=True and take weights.mean(dim=1)",
    "enable_gqa": "grouped-query attention needs no flag: k and v with Hkv heads dividing H are grouped",
}

#: Keywords of ``torch.nn.MultiheadAttention.forward`` that :class:`multihead.MultiHeadAttention`
#: does not take, each with its equivalent (the layer is batch-first unless built ``batch_first=False``).
LAYER_HABITS: dict[str, str] = {
    "attn_mask": "pass mask= (bool, True = may attend, broadcastable to (B, H, S, Sk)); nn.MultiheadAttention's "
                 "boolean attn_mask means True = ignore: mask=multihead.masks.from_torch_mha(attn_mask) "
                 "(it converts a float -inf mask too); scaled_dot_product_attention's boolean attn_mask "
                 "has multihead's polarity already",
    "is_causal": "causality is the layer's setting: build it with causal=True (or pass mask=)",
    "key_padding_mask": "pass key_mask=~key_padding_mask: key_mask (B, Sk) is True = real token, torch's "
                        "key_padding_mask is True = ignore (padding)",
    "need_weights": "pass return_weights=True: the per-head weights (B, H, S, Sk), never averaged "
                    "(torch averages over heads by default: take weights.mean(dim=1)); without it only y is "
                    "returned, not a tuple",
    "average_attn_weights": "weights are never averaged: pass return_weights=True and take weights.mean(dim=1)",
    "query": "the layer takes x (B, S, E) and optionally context (B, Sk, kdim), not query/key/value: "
             "layer(x) for self-attention, layer(x, context) for cross-attention",
    "key": "the layer takes x and context, not query/key/value: context feeds both k_proj and v_proj "
           "(layer(x, context))",
    "value": "the layer takes x and context, not query/key/value: context feeds both k_proj and v_proj "
             "(layer(x, context))",
}


def refuse_unexpected(where: str, unexpected: dict[str, object], habits: dict[str, str]) -> TypeError:
    """The TypeError for keyword arguments ``where`` does not take (``unexpected``, non-empty):
    Python's message, with the multihead equivalent of each that ``habits`` knows (torch's names)."""
    names = ", ".join(repr(name) for name in unexpected)
    message = f"{where} got unexpected keyword argument{'s' if len(unexpected) > 1 else ''} {names}"
    hints = [f"{name}: {habits[name]}" for name in unexpected if name in habits]
    return TypeError(message + ("; " + "; ".join(hints) if hints else ""))


def refuse_positional(x: object, context: object, extra: tuple[object, ...]) -> TypeError:
    """The TypeError for a layer called with more positional arguments than (x, context), as
    torch's ``mha(query, key, value)``: the call that means the same, where there is one."""
    if len(extra) == 1 and extra[0] is context:
        hint = "self-attention is layer(x)" if context is x else \
            "key is value: layer(x, context) (context feeds both k_proj and v_proj)"
    else:
        hint = ("self-attention is layer(x), cross-attention layer(x, context): one context feeds both k_proj "
                "and v_proj, so a key different from the value has no equivalent")
    return TypeError(f"MultiHeadAttention.forward takes x (B, S, E) and optionally context (B, Sk, kdim), got "
                     f"{2 + len(extra)} positional arguments (torch's mha(query, key, value)): {hint}; "
                     "the layer is batch-first (B, S, E) unless built with batch_first=False")


def validate_call(layer: Layer, x: torch.Tensor, context: torch.Tensor | None, mask: torch.Tensor | None,
                  key_mask: torch.Tensor | None, positions: torch.Tensor | None, cache: KVCache | None, *,
                  packed: bool = False, check_finite: bool = False, programmable: tuple[str, ...] = ()) -> Inputs:
    """Every check of a call, once, before any work (``check_finite`` first). ``programmable``: the
    names of the programmable keywords given (``mask_mod``...): with a cache they need its keys in
    position order (:func:`_check_positional_cache`); the core attention step checks their values
    against the call's (Sq, Sk), inside the cache's staged write (undone if it raises)."""
    if check_finite:
        for name, t in (("x", x), ("context", context)):
            if isinstance(t, torch.Tensor):
                _check_finite(name, t)
    if packed and (positions is None or context is not None or cache is not None):
        raise ValueError("packed=True needs positions (restarting where each sequence begins) and no "
                         "context or cache")
    real = _check_cache(layer, x, context, mask, key_mask, cache) if cache is not None else None
    if cache is not None and programmable:
        _check_positional_cache(cache, real, x.shape[1], programmable[0])
    # packed without a rope: the positions only mark where each sequence begins (checked below)
    at = positions if layer.rope is not None or not packed else None
    attn_mask = _check_inputs(layer, x, context, mask, None if cache is not None else key_mask, at)
    if attn_mask is not None and attn_mask.dim() < 4:  # a 4-D one stays the caller's own tensor
        attn_mask = attn_mask[(None,) * (4 - attn_mask.dim())]  # (B|1, H|1, S|1, Sk|1)
    cu = None
    if packed:
        assert positions is not None  # checked above
        cu = packed_cu_seqlens(check_positions(positions, x.shape[0], x.shape[1]))  # once per positions tensor
    return Inputs(real, attn_mask, positions, cu)


def _check_cache(
    layer: Layer,
    x: torch.Tensor,
    context: torch.Tensor | None,
    mask: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    cache: KVCache,
) -> list[int] | None:
    """Validate a cached call before anything is written; return real tokens per row."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a multihead.KVCache (from layer.new_cache), got {type(cache).__name__}")
    if context is not None:
        raise ValueError("cache with context is not supported: a cache holds a sequence's own keys")
    if mask is not None:
        raise ValueError("mask is not supported with a cache (the cache builds the causal mask); "
                         "mark padding with key_mask")
    if hasattr(layer.q_proj.weight, "device_mesh"):
        raise ValueError("cache= is not supported under parallelize_module (the cache would hold every K/V "
                         "head); use multihead.parallel.shard_heads(layer, group).new_cache")
    check_tensor("x", x, ndim=3)
    _check_matches_weight("x", x, layer.q_proj.weight, layer.embed_dim, "[B, S, E]")
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in layer.parameters())):
        raise ValueError("cache= is for inference: call the layer under torch.no_grad() or "
                         "torch.inference_mode() (cached K/V keep no autograd history; x or a parameter "
                         "requires grad)")
    b, s, _ = x.shape
    real = None
    if key_mask is not None:
        _check_key_mask(key_mask, b, s, x.device)
        real = key_mask.sum(dim=1).tolist()
        right_padded = torch.arange(s, device=key_mask.device)[None, :] < key_mask.sum(dim=1, keepdim=True)
        if not torch.equal(right_padded, key_mask):
            raise ValueError("key_mask with a cache must be right-padded (each row's real tokens first, "
                             "then padding); left padding would leave holes in the cache")
    if layer.alibi_slopes is not None and cache.ring:
        raise ValueError("a ring cache with alibi is not supported: ALiBi's distances need the keys in "
                         "position order; use new_cache(..., ring=False)")
    cache.check_append(b, layer.num_kv_heads, layer.head_dim, x.dtype, x.device, s)
    cache.claim(layer)  # another layer's cache is refused
    return real


def _check_positional_cache(cache: KVCache, real: list[int] | None, s: int, name: str) -> None:
    """The cached keys are the positions 0 .. Sk-1 of every row, so that ``name`` (a mask_mod,
    block_mask, bias or score_mod, indexed by ``q_idx = i + Sk - S`` and ``kv_idx``, bottom-right
    aligned) sees each query's and key's cache position: every row of the same length, no padding,
    and a ring that has not wrapped (its slots would not be positions)."""
    lengths = cache.host_lengths()
    if real is not None:
        why = f"key_mask padding (real tokens per row {real})"
    elif len(set(lengths)) > 1:
        why = f"rows of different lengths {lengths}"
    elif cache.ring and lengths[0] + s > cache.capacity:
        why = (f"a ring cache that wraps ({lengths[0]} held + {s} new > capacity {cache.capacity}): its slots are "
               "not positions")
    else:
        return
    raise ValueError(f"{name} with a cache needs the cached keys at positions 0 .. Sk-1 of every row (q_idx and "
                     f"kv_idx are cache positions), got {why}; run the call without a cache, or use "
                     "new_cache(..., ring=False) and rows of one length")


def _check_inputs(
    layer: Layer,
    x: torch.Tensor,
    context: torch.Tensor | None,
    mask: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    positions: torch.Tensor | None,
) -> torch.Tensor | None:
    """Validate everything before computing; return the combined bool mask or None."""
    weight = layer.q_proj.weight
    check_tensor("x", x, ndim=3)
    _check_matches_weight("x", x, weight, layer.embed_dim, "[B, S, E]")
    b, s, _ = x.shape
    sk = s
    if context is None and layer.kdim != layer.embed_dim:
        raise ValueError(f"the layer has kdim={layer.kdim} != embed_dim={layer.embed_dim}: "
                         "it attends to a context, so pass context")
    if context is not None:
        if layer.causal:
            raise ValueError("context was given to a causal layer: cross-attention is not causal; "
                             "build the cross-attention layer with causal=False")
        if layer.rope is not None:
            raise ValueError("context was given to a layer with rope: queries and keys of two "
                             "sequences share no positions; build the cross-attention layer with rope=None")
        check_tensor("context", context, ndim=3)
        _check_matches_weight("context", context, weight, layer.kdim, "[B, Sk, kdim]")
        if context.shape[0] != b:
            raise ValueError(f"context must have batch size {b} like x, got {context.shape[0]}")
        sk = context.shape[1]
    if positions is not None:
        if layer.rope is None:
            raise ValueError("positions were given but the layer has no rope to apply them")
        positions = check_positions(positions, b, s)
        if positions.device != x.device:
            raise ValueError(f"positions must be on device {x.device} like x, got {positions.device}")
    combined = None
    if mask is not None:
        combined = check_bool_mask("mask", mask, (b, layer.num_heads, s, sk), "[B, H, S, Sk]")
        if mask.device != x.device:
            raise ValueError(f"mask must be on device {x.device} like x, got {mask.device}")
    if key_mask is not None:
        _check_key_mask(key_mask, b, sk, x.device)
        padding = key_padding_mask(key_mask)  # (B, 1, 1, Sk)
        combined = padding if combined is None else combined & padding
    return combined


def _check_key_mask(key_mask_in: object, b: int, sk: int, device: torch.device) -> None:
    """key_mask: bool (B, Sk), True = real token, on x's device."""
    key_mask = check_tensor("key_mask", key_mask_in, ndim=2)
    if key_mask.dtype != torch.bool:
        raise TypeError(f"key_mask must be a bool tensor (True = real token), got dtype {key_mask.dtype}")
    if tuple(key_mask.shape) != (b, sk):
        raise ValueError(f"key_mask must have shape [B, Sk] = [{b}, {sk}], got {list(key_mask.shape)}")
    if key_mask.device != device:
        raise ValueError(f"key_mask must be on device {device} like x, got {key_mask.device}")


def _check_matches_weight(name: str, t: torch.Tensor, weight: torch.Tensor, width: int, legend: str) -> None:
    if t.shape[-1] != width:
        raise ValueError(f"{name} must have last dim {width} in {legend}, got shape {list(t.shape)}")
    if t.dtype != weight.dtype:
        raise TypeError(f"{name} must have dtype {weight.dtype} like the layer's weights, got {t.dtype}")
    if t.device != weight.device:
        raise ValueError(f"{name} must be on device {weight.device} like the layer's weights, got {t.device}")
