"""The transformers ``Cache`` classes of :class:`KVCacheAdapter` (imported on first use).

Notation: B batch, S new tokens, L tokens held per row, C = ``max_len`` (slots per row),
Hkv key/value heads, D head_dim.

This module imports transformers at import time: :mod:`multihead.interop.hf_cache` imports it
only when ``KVCacheAdapter`` is first asked for, so ``import multihead`` never does. What the
adapter is for, its two paths and its static answers under ``torch.compile`` are described there.
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
        self.kv: KVCache | None = None  # keys/values: views of it (properties)
        self.path: str | None = None  # how the last call went (see KVCacheAdapter.paths)
        self.not_fused: str | None = None  # set by own_step when the fused step does not apply
        #: the state before this layer's last write (KVCache, lengths, path), for :meth:`undo`;
        #: the lengths a (B,) tensor after a traced write (they are not read on the host there)
        self._before: tuple[KVCache | None, list[int] | torch.Tensor, str | None] | None = None
        self._writing = False  # between begin_write and record (own_step, then maybe update)

    def __repr__(self) -> str:
        return f"KVCacheLayer(max_len={self.max_len}, kv={self.kv!r})"

    # -- what HF reads: views of the held tokens ---------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        """The held keys (B, Hkv, L, D), a view of the KVCache's buffer (None before the first write)."""
        return None if self.kv is None else self.kv.k[:, :, :self._held()]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        _views_only("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """The held values (B, Hkv, L, D), a view of the KVCache's buffer (None before the first write)."""
        return None if self.kv is None else self.kv.v[:, :, :self._held()]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        _views_only("values", value)

    # -- making the KVCache --------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, hkv, _, d = key_states.shape
        self._make(b, hkv, d, key_states.dtype, key_states.device)

    def _make(self, b: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        self.kv = KVCache(b, self.max_len, hkv, d, dtype=dtype, device=device)
        self.device, self.batch_size = device, b
        self.is_initialized = True
        return self.kv

    def kv_for(self, layer: Any, x: torch.Tensor) -> KVCache:
        """The KVCache, made for ``layer``'s K/V heads if this is the first write (or it is empty
        and was made for another batch, width, dtype or device: a new generate)."""
        b, hkv, d = x.shape[0], layer.num_kv_heads, layer.head_dim
        if self.kv is not None and self._fits(b, hkv, d, x.dtype, x.device):
            return self.kv
        return self._make(b, hkv, d, x.dtype, x.device)

    def _fits(self, b: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the KVCache takes this write; an empty one made for other shapes is made again.
        (Its shapes first: a traced step reads no length.)"""
        kv = self.kv
        assert kv is not None
        if (kv.k.shape[0], kv.k.shape[1], kv.k.shape[3], kv.dtype, kv.device) == (b, hkv, d, dtype, device):
            return True
        return self._held() > 0  # a filled cache: KVCache.check_append refuses what does not fit, by name

    # -- writing ---------------------------------------------------------------------------
    def check_room(self, new_tokens: int) -> None:
        held = self._held()
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
        if torch.compiler.is_compiling():
            return self._update_static(key_states, value_states)
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

    def _update_static(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`update` as ``torch.compile`` traces it: K/V (B, Hkv, S, D) written at each row's
        device length (:meth:`KVCache.append_static`); the whole buffers (B, Hkv, C, D) returned,
        of which HF's mask (sized to C by :meth:`get_mask_sizes`) hides the slots not yet written.
        Nothing read depends on a length: one graph for every step. A step past ``max_len`` fails
        its device assertion (a ``RuntimeError``) before anything is written. The undo record
        keeps the lengths on the device (:meth:`undo` rolls back with :meth:`KVCache.crop_static`)."""
        b, hkv, _, d = key_states.shape
        before = self.kv
        self._before = (before, [] if before is None else before.lengths.clone(), self.path)  # for undo
        if before is None or not self._fits(b, hkv, d, key_states.dtype, key_states.device):
            self.lazy_initialization(key_states, value_states)
        assert self.kv is not None
        self.kv.append_static(key_states, value_states)
        self.path, self.not_fused = UPDATE, None
        return self.kv.k, self.kv.v

    def begin_write(self) -> None:
        """Remember the state before this write (once per write: own_step, then maybe update)."""
        if not self._writing:
            self._before = (self.kv, [] if self.kv is None else self.kv.host_lengths(), self.path)
            self._writing = True

    def record(self, path: str) -> None:
        """End a write: how it went (see :attr:`KVCacheAdapter.paths`)."""
        self.path = path
        self._writing = False

    def undo(self) -> None:
        """Back to the state before the last write (the tokens it wrote forgotten, a KVCache it
        made dropped): a forward refused at a later layer changes no layer."""
        if self._before is None:
            return
        kv, lengths, path = self._before
        self._before, self._writing, self.path, self.kv = None, False, path, kv
        if kv is None:
            self.is_initialized = False
            return
        if isinstance(lengths, list):
            kv.crop(lengths)
        else:  # a traced write's: rolled back on the device, as it was written
            kv.crop_static(lengths)

    # -- what generate asks ----------------------------------------------------------------
    def _held(self) -> int:
        """L, the tokens held per row (the longest row), from the host mirror."""
        return 0 if self.kv is None else max(self.kv.host_lengths())

    def get_seq_length(self) -> Any:
        """L: an int; traced by ``torch.compile``, a 0-d tensor (a host int would be a constant of
        the graph, one graph per length), as transformers' ``StaticCache`` answers."""
        if self.kv is not None and torch.compiler.is_compiling():
            return self.kv.lengths.amax()
        return self._held()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(keys the next call attends to, offset): L + S eager; C traced (:meth:`_update_static`)."""
        if torch.compiler.is_compiling():
            return self.max_len, 0
        return self._held() + query_length, 0

    def get_max_length(self) -> int:
        return self.max_len

    def reset(self) -> None:
        self._before, self._writing = None, False
        if self.kv is not None:
            self.kv.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (HF's convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove (transformers' convention), "
                             f"got {tokens_to_remove}")
        if tokens_to_remove == 0 or self.kv is None:
            return
        self.kv.crop(max(0, self._held() + tokens_to_remove))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b takes row ``beam_idx[b]``'s tokens, in place."""
        if self.kv is None or self._held() == 0:
            return
        self.kv.reorder(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse_batch_change("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse_batch_change("batch_select_indices")

    def _refuse_batch_change(self, what: str) -> None:
        if self._held() > 0:
            raise ValueError(f"KVCacheAdapter cannot {what}: its buffers are preallocated for a batch of "
                             f"{self.batch_size}; use transformers' DynamicCache for this generation mode")

    def offload(self) -> None:
        raise ValueError("KVCacheAdapter does not offload (its buffers stay where they were made)")

    prefetch = offload


def _views_only(name: str, value: torch.Tensor | None) -> None:
    """The setter of :attr:`KVCacheLayer.keys`/``values``: views derived from the KVCache, never
    stored (transformers' ``CacheLayerMixin.__init__`` sets them to None, which is what they are
    before the first write)."""
    if value is not None:
        raise ValueError(f"KVCacheLayer.{name} is a view of the tokens its KVCache holds; write them "
                         "through update()")


class KVCacheAdapter(Cache):
    """A transformers ``Cache`` on multihead's preallocated, in-place :class:`~multihead.KVCache`.

    Args:
        model: the (patched) transformers model, or its config: read for the number of
            layers and their types (attention only).
        max_len: C, the most tokens a row will hold (prompt + generated, padding included).

    Attributes:
        paths: per layer, how its last call went: ``"fused"`` (the native decode step),
            ``"update"`` (through :meth:`update`, in place; every call traced by
            ``torch.compile``), or ``"update (not fused: <reason>)"`` when only the fused
            step's own conditions failed; None before any call.

    One adapter serves any number of ``generate`` calls: each starts empty
    (:meth:`new_sequence`, called when ``generate`` takes the cache), with buffers made again
    if the batch changed. A ``generate`` whose first tokens are not at position 0 (only new
    tokens given, with a longer attention mask, to continue tokens the adapter does not hold)
    is refused; pass the whole sequence.

    Raises:
        TypeError: ``model`` is neither a model with a config nor a config.
        ValueError: ``max_len`` not a positive int, or a layer type that is not attention;
            at a call, a layer index the adapter was not built for (a model with more
            layers: the forward's earlier writes are undone first, so no layer changes).
        RuntimeError: traced by ``torch.compile``, a step past ``max_len`` or a generate not
            starting at position 0 (device assertions; nothing is written).
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
        # a sliding or chunked layer's keys are all held: HF's mask hides the ones it does not attend to
        other = [(i, t) for i, t in enumerate(types)
                 if t not in ("full_attention", "sliding_attention", "chunked_attention")]
        if other:
            raise ValueError(f"KVCacheAdapter holds attention layers' K/V only; layer {other[0][0]} is "
                             f"{other[0][1]!r}")
        self.slots = [KVCacheLayer(max_len, i) for i in range(len(types))]  # = self.layers, typed
        super().__init__(layers=list(self.slots))
        self.max_len = max_len
        self._checked: tuple[torch.Tensor, int, bool] | None = None
        self._starts: tuple[torch.Tensor, int, int, torch.Tensor | None | bool] | None = None
        self._given = False  # transformers' generate has taken this cache (see _is_user_defined)
        self._forgotten = 0  # tokens per row forgotten when the running generate began
        self._first_write = False  # a generate began and has not written yet (see _check_fresh)

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
        self._first_write = True
        self.reset()
        self._checked = None
        self._starts = None

    def slot(self, layer_idx: int, positions: torch.Tensor | None = None) -> KVCacheLayer:
        """Layer ``layer_idx``'s :class:`KVCacheLayer`, checked before it is written.

        Args:
            positions: the write's token positions ((S,) or (B|1, S)), when the caller has them.

        Raises:
            ValueError: a layer index past the layers the adapter was built for (this
                forward's writes to the others are undone first); the first write of a
                ``generate`` whose positions do not start at 0 (it meant to continue tokens the
                adapter does not hold). Nothing is written.
            RuntimeError: that first write, traced by ``torch.compile`` (a device assertion:
                positions are not read on the host there).
        """
        n = len(self.slots)
        if not 0 <= layer_idx < n:
            for slot in self.slots:
                slot.undo()
            raise ValueError(f"KVCacheAdapter was built for {n} layers, got a call for layer {layer_idx} (the model "
                             f"has at least {layer_idx + 1}): build it from the model that uses it, "
                             f"KVCacheAdapter(model, max_len) (this forward's writes were undone: no layer changed)")
        if self._first_write and layer_idx == 0:
            self._check_fresh(positions)
        return self.slots[layer_idx]

    def _check_fresh(self, positions: torch.Tensor | None) -> None:
        """A generate's first write (after :meth:`new_sequence`): a new sequence starts at position 0.

        The same rule eager and traced; traced it is a device assertion (a host read of the
        positions would break the graph), its message without the values it cannot read.
        """
        first = None if positions is None else positions[..., :1]  # (1,) or (B|1, 1)
        advice = ("pass generate the whole sequence (the earlier tokens too), or continue with transformers' "
                  "DynamicCache (nothing was written)")
        if first is not None and first.numel() and torch.compiler.is_compiling():
            torch._assert_async((first == 0).all(), "KVCacheAdapter starts every generate empty, but this "
                                f"generate's first tokens are not at position 0: {advice}")
        elif first is not None and first.numel() and bool((first != 0).any()):
            raise ValueError(  # still the first write to come: the generate is refused
                f"KVCacheAdapter starts every generate empty (it held {self._forgotten} tokens per row, forgotten "
                f"when this generate began), but this generate's first tokens are at position {int(first.max())}: "
                f"{advice}")
        self._first_write = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``layer_idx``'s K/V (B, Hkv, S, D) in place (:meth:`KVCacheLayer.update`),
        after :meth:`slot`'s checks; views of all held (B, Hkv, L, D) (traced by ``torch.compile``:
        the whole buffers (B, Hkv, C, D), HF's mask sized to C)."""
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

    def row_starts(self, positions: torch.Tensor | None, held: int, batch: int) -> torch.Tensor | None | bool:
        """Each row's first slot for one new token per row at ``positions`` ((1,) or (B|1, 1)):
        ``held - positions``, (B,) int64, where every row's start lies in [0, held] and one is
        not 0 (HF's positions of a left-padded batch count its real tokens, so a row's start is
        its padding); None where every start is 0 (or no positions); False where a start lies
        outside. Remembered for HF's positions tensor of the step (one read for all layers).
        """
        if positions is None:
            return None
        found = self._starts
        if found is not None and found[0] is positions and found[1:3] == (held, batch):
            return found[3]
        last = positions.reshape(-1, positions.shape[-1])[:, -1].to(torch.int64)  # (B|1,)
        starts = (held - last).expand(batch).contiguous()
        answer: torch.Tensor | None | bool = False
        if positions.shape[-1] == 1 and last.shape[0] in (1, batch):
            low, high = (int(v) for v in torch.aminmax(starts))
            answer = (starts if high > 0 else None) if 0 <= low and high <= held else False
        self._starts = (positions, held, batch, answer)  # the reference keeps the identity unique
        return answer

    @property
    def paths(self) -> list[str | None]:
        return [slot.path for slot in self.slots]

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's K and V buffers (0 before the first write)."""
        return sum(slot.kv.nbytes for slot in self.slots if slot.kv is not None)

    def __repr__(self) -> str:
        return f"KVCacheAdapter(max_len={self.max_len}, layers={len(self.layers)}, held={self.get_seq_length()})"
