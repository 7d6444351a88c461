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
