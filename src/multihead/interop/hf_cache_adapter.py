"""The transformers ``Cache`` classes of :class:`KVCacheAdapter` (imported on first use).

Notation: B batch, S new tokens, L tokens held per row, C = ``max_len`` (slots per row),
Hkv key/value heads, D head_dim.

This module imports transformers at import time: :mod:`multihead.interop.hf_cache` imports it
only when ``KVCacheAdapter`` is first asked for, so ``import multihead`` never does. What the
adapter is for, and its two paths, are described there.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from ..cache import KVCache
from ..masks import Structure

__all__ = ["KVCacheAdapter", "KVCacheLayer", "UPDATE"]

#: What :attr:`KVCacheAdapter.paths` records for a layer that went through ``update``.
UPDATE = "update"


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
        #: the state before this layer's last write (KVCache, lengths, path), for :meth:`undo`
        self._before: tuple[KVCache | None, list[int], str | None] | None = None
        self._writing = False  # between begin_write and record (own_step, then maybe update)

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
        """The KVCache, made for ``layer``'s K/V heads if this is the first write (or it is empty
        and was made for another batch, width, dtype or device: a new generate)."""
        b, hkv, d = x.shape[0], layer.num_kv_heads, layer.head_dim
        if self.kv is not None and self._fits(b, hkv, d, x.dtype, x.device):
            return self.kv
        return self._make(b, hkv, d, x.dtype, x.device)

    def _fits(self, b: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the KVCache takes this write; an empty one made for other shapes is made again."""
        kv = self.kv
        assert kv is not None
        if self.get_seq_length() > 0:
            return True  # a filled cache: KVCache.check_append refuses what does not fit, by name
        return (kv.k.shape[0], kv.k.shape[1], kv.k.shape[3], kv.dtype, kv.device) == (b, hkv, d, dtype, device)

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
        b, hkv, s, d = key_states.shape
        self.begin_write()
        if self.kv is None or not self._fits(b, hkv, d, key_states.dtype, key_states.device):
            self.lazy_initialization(key_states, value_states)
        assert self.kv is not None
        self.check_room(s)
        self.kv.check_append(b, hkv, d, key_states.dtype, key_states.device, s)
        step = self.kv.append(key_states, value_states, None, structure=Structure())  # in place
        self.kv.commit(step)
        self.record(UPDATE if self.not_fused is None else f"{UPDATE} (not fused: {self.not_fused})")
        self.not_fused = None
        return step.keys, step.values

    def begin_write(self) -> None:
        """Remember the state before this write (once per write: own_step, then maybe update)."""
        if not self._writing:
            self._before = (self.kv, [] if self.kv is None else self.kv.host_lengths(), self.path)
            self._writing = True

    def record(self, path: str) -> None:
        """End a write: how it went (see :attr:`KVCacheAdapter.paths`)."""
        self.path = path
        self._writing = False
        self._views()

    def undo(self) -> None:
        """Back to the state before the last write (the tokens it wrote forgotten, a KVCache it
        made dropped): a forward refused at a later layer changes no layer."""
        if self._before is None:
            return
        kv, lengths, path = self._before
        self._before, self._writing, self.path, self.kv = None, False, path, kv
        if kv is None:
            self.keys, self.values, self.is_initialized = None, None, False
            return
        kv.crop(lengths)
        self._views()

    # -- what generate asks ----------------------------------------------------------------
    def get_seq_length(self) -> int:
        return 0 if self.kv is None else max(self.kv.host_lengths())

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return self.max_len

    def reset(self) -> None:
        self._before, self._writing = None, False
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

    One adapter serves any number of ``generate`` calls: each starts empty
    (:meth:`new_sequence`, called when ``generate`` takes the cache), with buffers made again
    if the batch changed. A ``generate`` meant to continue the tokens the adapter held (only
    the new tokens given, with the whole attention mask) is refused; pass the whole sequence.

    Raises:
        TypeError: ``model`` is neither a model with a config nor a config.
        ValueError: ``max_len`` not a positive int, or a layer type that is not attention;
            at a call, a layer index the adapter was not built for (a model with more
            layers: the forward's earlier writes are undone first, so no layer changes).
    """

    _multihead_adapter = True
    layer_class: type = KVCacheLayer

    def __init__(self, model: Any, max_len: int) -> None:
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
        self._given = False  # transformers' generate has taken this cache (see _is_user_defined)
        self._forgotten = 0  # tokens per row forgotten when a generate began, until its first write

    # -- a new generate starts empty -----------------------------------------------------------
    @property
    def _is_user_defined(self) -> bool:
        """transformers' mark on a cache given to ``generate`` (set at every call's start)."""
        return self._given

    @_is_user_defined.setter
    def _is_user_defined(self, given: bool) -> None:
        # transformers 5's generate sets this on the cache it was given before it reads the cache's
        # length (which it would take for tokens of this prompt already cached): the one moment a
        # new generate is known, so the adapter forgets the last one's tokens here.
        self._given = bool(given)
        if given:
            self.new_sequence()

    def new_sequence(self) -> None:
        """Forget every held token (what ``generate`` does first with this cache); the buffers
        stay and are made again only if the next batch differs."""
        self._forgotten = self.get_seq_length()
        self.reset()
        self._checked = None

    def slot(self, layer_idx: int, positions: torch.Tensor | None = None) -> KVCacheLayer:
        """Layer ``layer_idx``'s :class:`KVCacheLayer`, checked before it is written.

        Args:
            positions: the write's token positions ((S,) or (B|1, S)), when the caller has them.

        Raises:
            ValueError: a layer index past the layers the adapter was built for (this
                forward's writes to the others are undone first); the first write of a
                ``generate`` whose positions do not start at 0 after the adapter forgot
                tokens (it meant to continue them). Nothing is written.
        """
        n = len(self.slots)
        if not 0 <= layer_idx < n:
            for slot in self.slots:
                slot.undo()
            raise ValueError(f"KVCacheAdapter was built for {n} layers, got a call for layer {layer_idx} (the model "
                             f"has at least {layer_idx + 1}): build it from the model that uses it, "
                             f"KVCacheAdapter(model, max_len) (this forward's writes were undone: no layer changed)")
        if self._forgotten and layer_idx == 0:
            self._check_fresh(positions)
        return self.slots[layer_idx]

    def _check_fresh(self, positions: torch.Tensor | None) -> None:
        """The first write after :meth:`new_sequence` forgot tokens: a new sequence starts at position 0."""
        forgotten, self._forgotten = self._forgotten, 0
        first = None if positions is None else positions[..., :1]  # (1,) or (B|1, 1)
        if first is not None and first.numel() and bool((first != 0).any()):
            self._forgotten = forgotten  # the generate is refused: still the first write to come
            raise ValueError(
                f"KVCacheAdapter starts every generate empty (it held {forgotten} tokens per row, forgotten when this "
                f"generate began), but this generate's first tokens are at position {int(first.max())}: pass generate "
                "the whole sequence (the earlier tokens too), or continue with transformers' DynamicCache "
                "(nothing was written)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``layer_idx``'s K/V (B, Hkv, S, D) in place (:meth:`KVCacheLayer.update`),
        after :meth:`slot`'s checks; views of all held (B, Hkv, L, D)."""
        call = kwargs.get("kwargs")
        positions = call.get("position_ids") if isinstance(call, dict) else None  # a patched layer's call
        self.slot(layer_idx, positions)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

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
