"""transformers' ``generate`` on multihead's in-place :class:`~multihead.KVCache` (issue #13).

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
  (``attn_implementation="sdpa"``, the default, and no padding in the batch), at the
  cache's own positions, runs ``layer(x, cache=kv)`` when that takes the fused native
  decode step (:func:`multihead.decode.why_not_fused`: one token per row, B ≤ 4, float32,
  bfloat16 or float16 on a CPU with AVX-512 or AVX2, ...); the step writes K/V into the
  cache itself.
* **update**: anything else (a mask — padding, eager attention — other positions, an
  unpatched layer, or the fused step not applying, whose reason is recorded) calls
  :meth:`~transformers.Cache.update`, which writes the new K/V in place and returns views
  of the held ones (B, Hkv, L, D); HF's mask then covers padding (left padding works: its
  slots are held and masked, as in HF's own caches).

Supported: greedy and sampling, batches with padding, beam search (``reorder_cache``
reorders the buffers in place), ``crop`` (assisted decoding's roll-back). Refused, by name:
growing past ``max_len`` (before anything is written; size ``max_len`` ≥ prompt +
``max_new_tokens``), ``batch_repeat_interleave`` / ``batch_select_indices`` on a filled
cache (the buffers are preallocated for one batch), K and V of different widths (DeepSeek's
latent attention caches the latent and the rotary key: use HF's cache there), layers that
are not attention (linear attention, shared KV), training (the cache stores no autograd
history). ``is_compileable`` is False: our cache keeps its lengths on the host.

The classes subclass transformers' and are built on first access of
``KVCacheAdapter`` (module ``__getattr__``): ``import multihead`` never imports transformers.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from ..cache import KVCache
from ..decode import fused_for, repeat_step
from ..masks import Structure
from ..module import MultiHeadAttention

__all__ = ["KVCacheAdapter", "is_adapter", "own_step"]  # noqa: F822 - KVCacheAdapter: module __getattr__

#: What :attr:`KVCacheAdapter.paths` records for a layer that went through ``update``.
UPDATE = "update"


def is_adapter(cache: object) -> bool:
    """Whether ``cache`` is a :class:`KVCacheAdapter` (without importing transformers)."""
    return getattr(cache, "_multihead_adapter", False) is True


def own_step(layer: MultiHeadAttention, layer_idx: int | None, cache: Any, x: torch.Tensor, mask: torch.Tensor | None,
             positions: torch.Tensor | None) -> torch.Tensor | None:
    """The fused native step ``layer(x, cache=kv)`` on the adapter's KVCache of ``layer_idx``, or None.

    Taken when HF gives no mask (purely causal, no padding), ``positions`` are the cache's
    own (each row's length onwards) — then our module's cached call computes what HF's
    would — and :func:`~multihead.decode.fused_for` (the question the layer's ``forward``
    asks too) gives the fused step. Otherwise the caller goes through ``cache.update`` (in
    place too; the reason is recorded in :attr:`KVCacheAdapter.paths`): unfused, the
    wrapper composes the layer's steps around ``update``.

    Args:
        layer: the patched layer's :class:`~multihead.MultiHeadAttention`.
        x: (B, S, E); mask: HF's mask as ours, or None; positions: (S,) or (B|1, S) or None.

    Returns:
        y (B, S, E), or None.
    """
    if mask is not None or layer_idx is None or torch.is_grad_enabled():
        return None
    slot = cache.slots[layer_idx]
    if not cache.at_own_positions(positions, slot.get_seq_length(), x.shape[1]):
        return None
    kv = slot.kv_for(layer, x)
    slot.check_room(x.shape[1])
    bare = _bare(layer)
    y = repeat_step(layer, x, kv) if bare else None  # the last step's checks still hold: not asked again
    if y is None:
        if bare:
            layer.check(x, cache=kv)  # what layer(x, cache=kv) checks first
        step = fused_for(layer, x, kv)
        if isinstance(step, str):  # the wrapper's own steps around update (in place) then
            slot.not_fused = step  # recorded by the update that follows
            return None
        y = step(x) if bare else layer(x, cache=kv)
    slot.record("fused")
    return y


def _bare(layer: MultiHeadAttention) -> bool:
    """Whether ``layer(x, cache=kv)`` is exactly its checks then the fused step (for a call
    :func:`~multihead.decode.fused_for` allowed): the class itself, no module hooks (its own or
    global ones), nobody watching its steps."""
    from torch.nn.modules import module as m

    return (type(layer) is MultiHeadAttention and layer.watch is None
            and not (layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks
                     or layer._backward_pre_hooks or m._global_forward_hooks or m._global_forward_pre_hooks
                     or m._global_backward_hooks or m._global_backward_pre_hooks))


@functools.cache
def _adapter_class() -> Any:
    """Build the classes on first use: they subclass transformers' (imported here, not at import)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class KVCacheLayer(CacheLayerMixin):
        """One layer's :class:`~multihead.KVCache`, made at the first write (its B, Hkv, D, dtype, device)."""

        is_compileable = False
        is_croppable = True
        is_sliding = False

        def __init__(self, max_len: int, layer_idx: int) -> None:
            super().__init__()
            self.max_len, self.layer_idx = max_len, layer_idx
            self.kv: KVCache | None = None
            self.path: str | None = None  # how the last call went (see KVCacheAdapter.paths)
            self.not_fused: str | None = None  # set by own_step when the fused step does not apply

        def __repr__(self) -> str:
            return f"KVCacheLayer(max_len={self.max_len}, kv={self.kv!r})"

        # -- making the KVCache --------------------------------------------------------------
        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            b, hkv, _, d = key_states.shape
            self._make(b, hkv, d, key_states.dtype, key_states.device)

        def _make(self, b: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device) -> KVCache:
            self.kv = KVCache(b, self.max_len, hkv, d, dtype=dtype, device=device)
            self.device, self.batch_size = device, b
            self.is_initialized = True
            self._views()
            return self.kv

        def kv_for(self, layer: Any, x: torch.Tensor) -> KVCache:
            """The KVCache, made for ``layer``'s K/V heads if this is the first write."""
            if self.kv is not None:
                return self.kv
            return self._make(x.shape[0], layer.num_kv_heads, layer.head_dim, x.dtype, x.device)

        def _views(self) -> None:
            """``keys``/``values``: views of the held tokens (B, Hkv, L, D), as HF's layers expose them."""
            assert self.kv is not None
            n = self.get_seq_length()
            self.keys, self.values = self.kv.k[:, :, :n], self.kv.v[:, :, :n]

        # -- writing ---------------------------------------------------------------------------
        def check_room(self, new_tokens: int) -> None:
            held = self.get_seq_length()
            if held + new_tokens > self.max_len:
                raise ValueError(
                    f"KVCacheAdapter layer {self.layer_idx} holds {held} of max_len={self.max_len} tokens per row: "
                    f"{new_tokens} more do not fit; make max_len >= prompt length + max_new_tokens "
                    "(nothing was written)")

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            """Write ``key_states``/``value_states`` (B, Hkv, S, D) in place; views of all held (B, Hkv, L, D)."""
            if key_states.shape[-1] != value_states.shape[-1] or key_states.shape[:-1] != value_states.shape[:-1]:
                raise ValueError(
                    f"KVCacheAdapter holds keys and values of one shape [B, Hkv, S, D], got keys "
                    f"{list(key_states.shape)} and values {list(value_states.shape)} (DeepSeek's latent attention "
                    "caches the latent and the rotary key: generate with transformers' own cache)")
            if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
                raise ValueError("KVCacheAdapter is for inference: it stores K/V without autograd history; "
                                 "run under torch.no_grad() (generate does)")
            if self.kv is None:
                self.lazy_initialization(key_states, value_states)
            assert self.kv is not None
            self.check_room(key_states.shape[2])
            b, hkv, s, d = key_states.shape
            self.kv.check_append(b, hkv, d, key_states.dtype, key_states.device, s)
            step = self.kv.append(key_states, value_states, None, structure=Structure())  # in place
            self.kv.commit(step)
            self.record(UPDATE if self.not_fused is None else f"{UPDATE} (not fused: {self.not_fused})")
            self.not_fused = None
            return step.keys, step.values

        def record(self, path: str) -> None:
            self.path = path
            self._views()

        # -- what generate asks ----------------------------------------------------------------
        def get_seq_length(self) -> int:
            return 0 if self.kv is None else max(self.kv.host_lengths())

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

        def get_max_length(self) -> int:
            return self.max_len

        def reset(self) -> None:
            if self.kv is not None:
                self.kv.reset()
                self._views()

        def crop(self, tokens_to_remove: int) -> None:
            """Remove the last ``-tokens_to_remove`` tokens (HF's convention: a negative count)."""
            if tokens_to_remove > 0:
                raise ValueError(f"crop takes a negative count of tokens to remove (transformers' convention), "
                                 f"got {tokens_to_remove}")
            if tokens_to_remove == 0 or self.kv is None:
                return
            self.kv.crop(max(0, self.get_seq_length() + tokens_to_remove))
            self._views()

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            """Beam search: row b takes row ``beam_idx[b]``'s tokens, in place."""
            if self.kv is None or self.get_seq_length() == 0:
                return
            self.kv.reorder(beam_idx)
            self._views()

        def batch_repeat_interleave(self, repeats: int) -> None:
            self._refuse_batch_change("batch_repeat_interleave")

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            self._refuse_batch_change("batch_select_indices")

        def _refuse_batch_change(self, what: str) -> None:
            if self.get_seq_length() > 0:
                raise ValueError(f"KVCacheAdapter cannot {what}: its buffers are preallocated for a batch of "
                                 f"{self.batch_size}; use transformers' DynamicCache for this generation mode")

        def offload(self) -> None:
            raise ValueError("KVCacheAdapter does not offload (its buffers stay where they were made)")

        prefetch = offload

    class KVCacheAdapter(Cache):
        """A transformers ``Cache`` on multihead's preallocated, in-place :class:`~multihead.KVCache`.

        Args:
            model: the (patched) transformers model, or its config: read for the number of
                layers and their types (attention only).
            max_len: C, the most tokens a row will hold (prompt + generated, padding included).

        Attributes:
            paths: per layer, how its last call went: ``"fused"`` (the native decode step),
                ``"update"`` (through :meth:`update`, in place), or ``"update (not fused:
                <reason>)"`` when only the fused step's own conditions failed; None before
                any call.

        Raises:
            TypeError: ``model`` is neither a model with a config nor a config.
            ValueError: ``max_len`` not a positive int, or a layer type that is not attention.
        """

        _multihead_adapter = True
        layer_class: type = KVCacheLayer

        def __init__(self, model: Any, max_len: int) -> None:
            from transformers.cache_utils import get_layer_types_and_kwargs

            if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
                raise ValueError(f"max_len must be a positive int (prompt + new tokens), got {max_len!r}")
            config = getattr(model, "config", model)
            if not hasattr(config, "get_text_config"):
                raise TypeError(f"model must be a transformers model or config, got {type(model).__name__}")
            text = config.get_text_config(decoder=True)
            types, _ = get_layer_types_and_kwargs(text)
            other = [(i, t) for i, t in enumerate(types) if t not in ("full_attention", "sliding_attention")]
            if other:
                raise ValueError(f"KVCacheAdapter holds attention layers' K/V only; layer {other[0][0]} is "
                                 f"{other[0][1]!r}")
            self.slots = [KVCacheLayer(max_len, i) for i in range(len(types))]  # = self.layers, typed
            super().__init__(layers=list(self.slots))
            self.max_len = max_len
            self._checked: tuple[torch.Tensor, int, bool] | None = None

        def at_own_positions(self, positions: torch.Tensor | None, held: int, s: int) -> bool:
            """Whether ``positions`` ((S,) or (B|1, S)) are ``held .. held + s - 1`` in every row.

            One device read per step: HF hands every layer of a step the same positions
            tensor, and every layer holds the same count before its write.
            """
            if positions is None:
                return True
            checked = self._checked
            if checked is not None and checked[0] is positions and checked[1] == held:
                return checked[2]
            want = torch.arange(held, held + s, device=positions.device)
            own = positions.shape[-1] == s and bool((positions == want).all())
            self._checked = (positions, held, own)  # the reference keeps the identity unique
            return own

        @property
        def paths(self) -> list[str | None]:
            return [slot.path for slot in self.slots]

        @property
        def nbytes(self) -> int:
            """Bytes of every layer's K and V buffers (0 before the first write)."""
            return sum(slot.kv.nbytes for slot in self.slots if slot.kv is not None)

        def __repr__(self) -> str:
            return f"KVCacheAdapter(max_len={self.max_len}, layers={len(self.layers)}, held={self.get_seq_length()})"

    KVCacheAdapter.__module__ = KVCacheLayer.__module__ = __name__
    return KVCacheAdapter


def __getattr__(name: str) -> Any:
    """``KVCacheAdapter`` and ``KVCacheLayer``: built (importing transformers) on first access."""
    if name in ("KVCacheAdapter", "KVCacheLayer"):
        adapter = _adapter_class()
        return adapter if name == "KVCacheAdapter" else adapter.layer_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
