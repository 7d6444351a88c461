"""transformers' ``generate`` on multihead's in-place :class:`~multihead.KVCache`.

Notation: B batch, S new tokens, L tokens held per row, C = ``max_len`` (slots per row),
Hkv key/value heads, D head_dim.

:class:`KVCacheAdapter` is a transformers ``Cache`` whose layers are one
:class:`~multihead.KVCache` each, preallocated at the first write (B, Hkv, C, D) and written
in place; HF's ``DynamicCache`` concatenates every layer's whole K/V at every step instead.
Pass it to ``generate`` (``cache=``, or the older ``past_key_values=``)::

    model = mh.hf.patch(AutoModelForCausalLM.from_pretrained(...))
    cache = mh.hf.KVCacheAdapter(model, max_len=prompt_len + max_new_tokens)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=..., cache=cache)

Each layer call takes one of two paths, recorded in :attr:`KVCacheAdapter.paths`:

* **fused**: a patched layer (:func:`multihead.hf.patch`) whose call HF makes with no mask
  (``attn_implementation="sdpa"``, the default, and no padding in the batch) at the cache's
  own positions, or, decoding one token per row, with a mask that is exactly the layer's own
  rule over each row's keys from its first real one (a left-padded batch: positions
  ``held - start``; a sliding layer past its window; eager attention's mask), runs the fused
  native decode step (:func:`multihead.decode.why_not_fused`: B ≤ 8, float32, bfloat16 or
  float16 on a CPU with AVX-512 or AVX2, ...; a left-padded row's slots before its start are
  never read): ``layer(x, cache=kv)``, or the step itself where that call adds nothing
  (padded rows take only that); the step writes K/V into the cache itself.
* **update**: anything else (a mask that hides more, other positions, an
  unpatched layer, or the fused step not applying, whose reason is recorded) calls
  :meth:`~transformers.Cache.update`, which writes the new K/V in place and returns views
  of the held ones (B, Hkv, L, D); HF's mask then covers padding (left padding works: its
  slots are held and masked, as in HF's own caches).

**Compiled.** With the model's forward compiled (``model.forward = torch.compile(model.forward)``),
the traced calls take a third answer, static shapes, as transformers' ``StaticCache`` gives:
``update`` writes at each row's length kept on the device and returns the whole buffers (B,
Hkv, C, D), HF's mask is sized to C (it hides the slots not yet written, padding too) and the
length HF asks for is a 0-d tensor. No shape and no Python value in the graph depends on a
length: no graph break, and one graph serves every decoding step and the later ``generate``
calls of the same batch size. The fused step is not taken there (``paths`` reads ``"update"``),
and the two checks made inside the graph (room for the new tokens, a generate starting at
position 0) are device assertions: a ``RuntimeError`` before anything is written.
``is_compileable`` stays False, so ``generate`` does not compile the model itself or build the
mask outside it; compile the whole forward, not single layers (the mask's size and the keys
``update`` returns must both be the traced ones).

Supported: greedy and sampling, batches with padding, beam search (``reorder_cache``
reorders the buffers in place), ``crop`` (assisted decoding's roll-back), one adapter for
many ``generate`` calls (each starts empty; a new batch size remakes the buffers). Refused,
by name: a model with more layers than the adapter was built for (at its first extra layer,
the forward's earlier writes undone), a ``generate`` whose first tokens are not at position 0
(only new tokens passed, to continue tokens the adapter does not hold: it forgets what it held
when a generate begins), growing past ``max_len`` (before anything is written; size ``max_len``
≥ prompt + ``max_new_tokens``), ``batch_repeat_interleave`` / ``batch_select_indices`` on a
filled cache (the buffers are preallocated for one batch), K and V of different widths
(DeepSeek's latent attention caches the latent and the rotary key: use HF's cache there),
layers that are not attention (linear attention, shared KV), training (the cache stores no
autograd history).

The classes subclass transformers' and live in :mod:`multihead.interop.hf_cache_adapter`,
imported on first access of ``KVCacheAdapter`` (module ``__getattr__``): ``import multihead``
never imports transformers.
"""

from __future__ import annotations

from typing import Any

import torch

from ..decode import FusedStep, fused_for, repeat_step
from ..module import MultiHeadAttention
from .hf_structure import is_own_rule

__all__ = ["KVCacheAdapter", "is_adapter", "own_step"]  # noqa: F822 - KVCacheAdapter: module __getattr__

def is_adapter(cache: object) -> bool:
    """Whether ``cache`` is a :class:`KVCacheAdapter` (without importing transformers)."""
    return getattr(cache, "_multihead_adapter", False) is True


def own_step(layer: MultiHeadAttention, layer_idx: int | None, cache: Any, x: torch.Tensor, mask: torch.Tensor | None,
             positions: torch.Tensor | None, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """The fused native step ``layer(x, cache=kv)`` on the adapter's KVCache of ``layer_idx``, or None.

    Taken when HF's mask says nothing beyond the layer's own rule and the positions are the
    cache's own — no mask (purely causal, no padding) at each row's length onwards; or, for one
    new token per row, a mask equal to the layer's rule over each row's keys from its start
    (:func:`~multihead.interop.hf_structure.is_own_rule`: a sliding layer's mask once the cache
    passes its window, an eager model's all-True one, a left-padded batch's, whose positions
    ``held - start`` give the starts the step takes) — then the fused step computes what HF's
    call would — and :func:`~multihead.decode.fused_for` (the question the layer's ``forward``
    asks too) gives the fused step. Otherwise the caller goes through ``cache.update`` (in place too;
    the reason is recorded in :attr:`KVCacheAdapter.paths`): unfused, the wrapper composes
    the layer's steps around ``update``.

    Args:
        layer: the patched layer's :class:`~multihead.MultiHeadAttention`.
        x: (B, S, E); mask: HF's mask as ours (B|1, 1|H, S, Sk), or None; positions: (S,) or
            (B|1, S) or None; attention_mask: the mask as HF handed it (its answer is
            remembered for that tensor, which HF shares among a call's layers).

    Returns:
        y (B, S, E), or None.
    """
    if layer_idx is None or torch.is_grad_enabled() or torch.compiler.is_compiling() or (
            mask is not None and x.shape[1] != 1):
        return None  # traced: update's static write (the adapter's shapes do not follow the lengths there)
    slot = cache.slot(layer_idx, positions)  # checked: a layer the adapter has, a new generate at 0
    held = slot.get_seq_length()
    fits, starts = _left_padding(layer, cache, x, mask, positions, attention_mask, held)
    if not fits:
        return None  # other positions, or a mask beyond the rule and left padding: the step-by-step way
    bare = _bare(layer)
    if starts is not None and not bare:
        return None  # layer(x, cache=kv) takes no padding: the step-by-step way
    slot.begin_write()
    kv = slot.kv_for(layer, x)
    slot.check_room(x.shape[1])
    y = repeat_step(layer, x, kv, starts) if bare else None  # the last step's checks still hold: not asked again
    if y is None:
        if bare:
            layer.check(x, cache=kv)  # what layer(x, cache=kv) checks first
        step = fused_for(layer, x, kv)
        if isinstance(step, str):  # the wrapper's own steps around update (in place) then
            slot.not_fused = step  # recorded by the update that follows
            return None
        # bare: the step itself (eager here: a FusedStep); else the module's call (no padding then)
        y = step(x, starts=starts) if bare and isinstance(step, FusedStep) else layer(x, cache=kv)
    slot.record("fused")
    return y


def _left_padding(layer: MultiHeadAttention, cache: Any, x: torch.Tensor, mask: torch.Tensor | None,
                  positions: torch.Tensor | None, attention_mask: torch.Tensor | None,
                  held: int) -> tuple[bool, torch.Tensor | None]:
    """Whether the fused step computes HF's call on the cache's ``held`` tokens, and the rows'
    first slots it then takes: None (at the cache's own positions, HF's mask none or the layer's
    rule), or (B,) int64 (one new token per row of a left-padded batch: positions ``held -
    starts``, HF's mask the layer's rule over each row's keys from its start)."""
    if mask is None or x.shape[1] != 1:
        return cache.at_own_positions(positions, held, x.shape[1]), None
    starts = cache.row_starts(positions, held, x.shape[0])  # None: every row from slot 0
    if starts is False or mask.shape[-1] != held + 1:
        return False, None
    return is_own_rule(layer.structure, attention_mask, mask, 1, starts), starts


def _bare(layer: MultiHeadAttention) -> bool:
    """Whether ``layer(x, cache=kv)`` is exactly its checks then the fused step (for a call
    :func:`~multihead.decode.fused_for` allowed): the class itself, no module hooks (its own or
    global ones), nobody watching its steps."""
    from torch.nn.modules import module as m

    return (type(layer) is MultiHeadAttention and layer.watch is None
            and not (layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks
                     or layer._backward_pre_hooks or m._global_forward_hooks or m._global_forward_pre_hooks
                     or m._global_backward_hooks or m._global_backward_pre_hooks))


def __getattr__(name: str) -> Any:
    """``KVCacheAdapter`` and ``KVCacheLayer``: imported (with transformers) on first access."""
    if name in ("KVCacheAdapter", "KVCacheLayer"):
        from . import hf_cache_adapter

        return getattr(hf_cache_adapter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
