"""Run Hugging Face models on multihead: patch their attention modules, or register a kernel.

Notation: B batch, S tokens (queries), Sk keys, E embed_dim, H query heads, Hkv key/value
heads, D head_dim.

Two ways in, for two needs:

* :func:`patch` swaps every supported attention *module* of a model (the classes of
  :data:`multihead.interop.hf_registry.REGISTRY`, exact or refused: a class that is not
  listed, or carries something its description does not cover, is refused by name)
  for a wrapper around a converted
  :class:`~multihead.MultiHeadAttention`: our projections, split, RoPE, attention, concat
  and o_proj run; the wrapper keeps the HF module's forward signature and return value
  ``(attn_output (B, S, E), None)``, so the model runs unchanged. :func:`unpatch` puts the
  original module objects back. DeepSeek-V2/V3's latent attention is wrapped around a
  :class:`~multihead.MultiHeadLatentAttention` instead (HF's cache then holds the latent and
  the rotary key, and decoding attends through the absorbed up-projections).
* :func:`register` adds multihead's attention *kernel* to transformers'
  ``AttentionInterface`` under ``"multihead"``; then ``attn_implementation="multihead"``
  works for any model that dispatches through that registry (HF keeps its own
  projections and RoPE, we do the softmax(QKᵀ)V).

HF hands attention a 4-D mask (B or 1, 1, S, Sk): bool (True = attend, the ``"sdpa"``
format, which :func:`register` asks for) or additive float (``"eager"``: 0 or
``finfo.min``); or None when the mask is purely causal or absent, with causality in
``module.is_causal``. :func:`multihead.masks.from_additive` turns float masks into ours.

Every wrapper composes the layer's public steps (``project``, ``split``, ``rotate``,
``attend``, ``output``), with or without HF's cache, so what the steps do holds on every
patched class: ``output_attentions=True`` returns each layer's weights (B, H, S, Sk), as the
eager HF class does (transformers 5 records them with hooks that :func:`patch` installs on
the wrappers as they were on the originals), and :func:`multihead.heads.capture` records
every call, cached ones included. DeepSeek's latent attention refuses both by name.
A wrapper's ``state_dict`` is the original module's (names and layout), holding the
wrapper's current weights, so ``save_pretrained`` writes a checkpoint the unpatched class
loads; loading a state dict *into* a patched model is refused (unpatch first). Weights
trained while patched stay in the wrappers until saved or copied back with
:func:`multihead.interop.to_hf`. During generation
HF's own cache object is kept: the wrapper then runs the layer's modules step by step
around ``cache.update`` (see :meth:`PatchedAttention.attend`); BART, mBART and Whisper's
cross-attention fills and reads HF's ``EncoderDecoderCache`` as those classes do. Other
cross-attention modules (GPT-2's, BERT's) are refused.

This module imports transformers lazily: ``import multihead`` never imports it.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any, Literal, overload

import torch
import torch.nn.functional as F
from torch import nn

from ..latent import MultiHeadLatentAttention
from ..masks import Structure
from ..module import MultiHeadAttention
from . import hf_cache, hf_mrope, hf_registry, hf_routes
from .hf_weights import convert, to_hf
from .hf_kernel import NAME, attention_forward, bool_mask, hf_recording, register, written_keys
from .hf_routes import Route

__all__ = ["patch", "unpatch", "is_patched", "routes", "Route",
           "register", "attention_forward", "PatchedAttention", "NAME",
           "attention_modules", "set_submodule"]


# ---- module patching ------------------------------------------------------------------------
class PatchedAttention(nn.Module):
    """A :class:`MultiHeadAttention` wearing an HF attention module's forward signature.

    ``self.mh`` is the converted layer; the original HF module is kept outside the module
    tree (not in ``parameters()``) for :func:`unpatch`. Subclasses adapt one family's call
    convention; all return ``(attn_output (B, S, E), None)``.
    """

    original: Any  # the HF module (kept in __dict__, outside the module tree)

    def __init__(self, original: nn.Module, mh: MultiHeadAttention) -> None:
        super().__init__()
        self.mh = mh
        self.__dict__["original"] = original  # not a submodule: its weights stay out of ours
        self.layer_idx = getattr(original, "layer_idx", getattr(getattr(original, "self", None), "layer_idx", None))
        self.is_causal = mh.causal
        #: (H, Hkv) the original class holds, to tell a pruned layer (multihead.heads.prune) at save time
        self.original_heads = _head_counts(mh)
        #: transformers' output keys recorded from this module (``attentions``...): see :func:`patch`
        self.records: tuple[str, ...] = ()
        #: (1, N) positions restarting at each text while the encoder runs packed (hf_packing), else None
        self.packing: torch.Tensor | None = None
        self.train(original.training)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The original module's state dict (its names and layout) with this wrapper's weights.

        So ``save_pretrained`` on a patched model writes what the unpatched class loads.
        """
        if args:
            raise TypeError("PatchedAttention.state_dict takes keyword arguments only")
        self._check_not_pruned(prefix)
        original = self._synced_original()
        return original.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def _check_not_pruned(self, prefix: str) -> None:
        """Refuse, by name, a layer whose heads :func:`multihead.heads.prune` removed: the original
        class has no pruned shapes (transformers keeps no pruned heads for these models)."""
        now = _head_counts(self.mh)
        if now != self.original_heads:
            (h, hkv), (h_now, hkv_now) = self.original_heads, now
            raise ValueError(
                f"cannot write the {type(self.original).__name__} state dict at {prefix!r}: its heads were pruned "
                f"({h} query / {hkv} K/V heads -> {h_now} / {hkv_now}) and that class only loads unpruned "
                "shapes, so state_dict() and save_pretrained() of a pruned patched model are refused; save the "
                "model before pruning (save_pretrained) with the head spec, and prune again after loading: "
                "multihead.heads.prune(multihead.hf.patch(Model.from_pretrained(path)), spec) gives the same "
                "model (weights trained after pruning have no checkpoint form in this class)")

    def _synced_original(self) -> nn.Module:
        """The original, moved to our device/dtype/mode, holding our current weights."""
        weight = self.mh.q_proj.weight
        original = self.original.to(device=weight.device, dtype=weight.dtype).train(self.training)
        with torch.no_grad():
            to_hf(self.mh, original)
        return original

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
        raise ValueError(f"cannot load a state dict into a patched {type(self.original).__name__} at "
                         f"{prefix!r}: call multihead.hf.unpatch(model) first, load, then patch again")

    def attend(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        cache: Any | None,
        kwargs: dict[str, Any],
        output_attentions: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Our layer on ``x`` (B, S, E) -> (y (B, S, E), weights (B, H, S, Sk) or None).

        Without a cache, the layer's own call. With an HF cache (generation), the layer's
        steps around ``cache.update``: :meth:`~multihead.MultiHeadAttention.project`,
        ``split``, ``rotate``, HF's cache, ``attend``, ``output``. With
        :class:`multihead.hf.KVCacheAdapter` (our KVCache in HF's ``Cache`` API) a call
        without mask at the cache's own positions runs our layer's fused step where it
        applies (:func:`multihead.interop.hf_cache.own_step`). Weights are computed when
        asked for (:meth:`wants_weights`) and returned for HF's ``output_attentions``.
        """
        layer = self.mh
        want = self.wants_weights(output_attentions, kwargs)
        mask = bool_mask(attention_mask, x.shape[1] if cache is None else None)
        at = positions if layer.rope is not None else None
        if self.packing is not None:  # the real tokens of a padded batch, one text per sequence
            return layer(x, positions=self.packing, packed=True), None
        if cache is None:
            result = layer(x, mask=mask, positions=at, return_weights=want)
            return result if isinstance(result, tuple) else (result, None)
        if hf_cache.is_adapter(cache) and not want:  # our own cached call (fused when it can) where HF's allows
            y = hf_cache.own_step(layer, self.layer_idx, cache, x, mask, positions)
            if y is not None:
                return y, None
        q, k, v = layer.split(*layer.project(x))  # (B, H, S, D), (B, Hkv, S, D) ×2
        q, k = layer.rotate(q, k, at)
        # The HF cache stores (B, Hkv, Sk, D) keys after RoPE, as our KVCache does.
        k, v = self._from_cache(*cache.update(*self._to_cache(k, v), self.layer_idx, kwargs=kwargs))  # (B, Hkv, Sk, D)
        mask, n = written_keys(mask, q.shape[2], k.shape[2], layer.causal)
        heads, weights = layer.attend(q, k[:, :, :n], v[:, :, :n], mask=mask, return_weights=want, cached=True)
        return layer.output(heads), weights  # (B, S, E)

    def wants_weights(self, output_attentions: bool | None, kwargs: dict[str, Any]) -> bool:
        """Whether this call must return the attention weights: ``output_attentions`` given to
        the module (transformers 4), or transformers 5 collecting the outputs this wrapper
        records (``attentions``, ``cross_attentions``: :func:`patch` installs HF's recording
        hooks on the wrapper, as they were on the original module)."""
        if output_attentions or kwargs.get("output_attentions"):
            return True
        if not self.records:
            return False
        collecting = hf_recording()
        return collecting is not None and any(key in collecting for key in self.records)

    def _to_cache(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V (B, Hkv, S, D) as the HF class stores them in its cache (as they are, but for Falcon's
        new architecture, which caches them repeated for every query head)."""
        return k, v

    def _from_cache(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's K/V back as the layer's (B, Hkv, Sk, D) (the inverse of :meth:`_to_cache`)."""
        return k, v


def _head_counts(layer: nn.Module) -> tuple[int | None, int | None]:
    """(H, Hkv) of a converted layer (latent attention has no Hkv: None)."""
    return getattr(layer, "num_heads", None), getattr(layer, "num_kv_heads", None)


def _hf_cache(cache: Any | None, kwargs: dict[str, Any]) -> Any | None:
    """The HF cache, under its v5 name ``cache`` or the older ``past_key_values``/``past_key_value``."""
    for old in ("past_key_values", "past_key_value"):
        cache = cache if cache is not None else kwargs.pop(old, None)
    return cache


def _self_attention_cache(cache: Any | None) -> Any | None:
    """A decoder self-attention's part of HF's cache: an ``EncoderDecoderCache``'s ``self_attention_cache``
    (a decoder with cross-attention layers, GPT-2's and BERT's, holds one), else the cache itself."""
    return cache.self_attention_cache if cache is not None and hasattr(cache, "self_attention_cache") else cache


def _positions(x: torch.Tensor, position_ids: torch.Tensor | None, cache: Any | None, layer_idx: int | None):
    if position_ids is not None:
        return position_ids
    past = cache.get_seq_length(layer_idx) if cache is not None else 0
    return torch.arange(past, past + x.shape[1], device=x.device)  # (S,)


class _LlamaWrapper(PatchedAttention):
    """Llama-style classes: ``forward(hidden_states, position_embeddings, attention_mask, cache)``.

    HF's cos/sin are ignored: our RoPE, built from the same config, computes them from the
    positions. A dropout after o_proj (Starcoder2's ``residual_dropout``) is applied too.
    """

    def __init__(self, original: nn.Module, mh: MultiHeadAttention) -> None:
        super().__init__(original, mh)
        key = hf_registry.require_spec(original).resid_dropout
        self.resid_dropout = float(getattr(original, key)) if key else 0.0

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None,
                attention_mask: torch.Tensor | None = None, cache: Any | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = _hf_cache(cache, kwargs)
        positions = _positions(hidden_states, kwargs.get("position_ids"), cache, self.layer_idx)
        y, weights = self.attend(hidden_states, attention_mask, positions, cache, kwargs)
        return F.dropout(y, self.resid_dropout, self.training), weights


class _MRopeWrapper(PatchedAttention):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL text attention: ``forward(hidden_states, attention_mask,
    position_ids, cache, position_embeddings, **kwargs)``, called by keyword (Qwen3-VL's class orders
    them otherwise; its decoder layer passes them by keyword too).

    RoPE at the text model's (3, B, S) M-RoPE positions (:mod:`multihead.interop.hf_mrope` reads
    them; ``position_ids`` here is the text row HF's mask was built from). Where the three rows are
    equal (text tokens, decoding after an image) M-RoPE is plain RoPE at row 0: the layer's call,
    its in-place cache and fused step, at those positions. Where they differ (image or video
    tokens) the layer's steps run with the three rows: project, split, rotate, HF's cache or none,
    attend, output.
    """

    mrope_record: hf_mrope.PositionsRecord | None  # set by patch (hf_mrope.link), in __dict__

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: Any | None = None,
                position_embeddings: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = _hf_cache(cache, kwargs)
        record = self.__dict__.get("mrope_record")
        owner = type(self.original).__name__
        if record is None:
            raise ValueError(f"a patched {owner} outside a text model with a rotary_emb cannot see its M-RoPE "
                             "positions (3, B, S): patch the model that holds it")
        rows = record.positions_for(position_embeddings, owner)  # (3, B, S)
        if record.same:
            return self.attend(hidden_states, attention_mask, rows[0], cache, kwargs)
        return self._attend_rows(hidden_states, attention_mask, rows, cache, kwargs)

    def _attend_rows(self, x: torch.Tensor, attention_mask: torch.Tensor | None, rows: torch.Tensor,
                     cache: Any | None, kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's steps with RoPE at three different position rows (3, B, S): x (B, S, E) ->
        (y (B, S, E), weights (B, H, S, Sk) or None)."""
        layer = self.mh
        want = self.wants_weights(None, kwargs)
        mask = bool_mask(attention_mask, x.shape[1] if cache is None else None)
        q, k, v = layer.split(*layer.project(x))  # (B, H, S, D), (B, Hkv, S, D) ×2
        q, k = layer.rotate(q, k, rows)  # M-RoPE: each frequency slot at its section's row
        if cache is None:
            heads, weights = layer.attend(q, k, v, mask=mask, return_weights=want)
        else:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)  # (B, Hkv, Sk, D), in place on ours
            mask, n = written_keys(mask, q.shape[2], k.shape[2], layer.causal)
            heads, weights = layer.attend(q, k[:, :, :n], v[:, :, :n], mask=mask, return_weights=want, cached=True)
        return layer.output(heads), weights  # (B, S, E)


class _ViTWrapper(PatchedAttention):
    """ViT-style classes: ``forward(hidden_states, attention_mask=None, **kwargs)``, no positions."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.attend(hidden_states, attention_mask, None, None, kwargs)


class _GPT2Wrapper(PatchedAttention):
    def __init__(self, original: nn.Module, mh: MultiHeadAttention) -> None:
        super().__init__(original, mh)
        hf: Any = original  # transformers' module: its attributes are not typed here
        self.resid_dropout = float(hf.resid_dropout.p)

    def forward(self, hidden_states: torch.Tensor, cache: Any | None = None,
                attention_mask: torch.Tensor | None = None, encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None, output_attentions: bool | None = False,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if encoder_hidden_states is not None:
            raise ValueError("encoder_hidden_states given to a patched GPT-2 self-attention: cross-attention "
                             "is not supported")
        cache = _self_attention_cache(_hf_cache(cache, kwargs))
        y, weights = self.attend(hidden_states, attention_mask, None, cache, kwargs, output_attentions)
        return F.dropout(y, self.resid_dropout, self.training), weights


class _BertWrapper(PatchedAttention):
    """BertAttention = self-attention + ``output`` (dense = W_o, dropout, LayerNorm(y + x))."""

    def __init__(self, original: nn.Module, mh: MultiHeadAttention) -> None:
        super().__init__(original, mh)
        hf: Any = original  # transformers' module: its attributes are not typed here
        self.LayerNorm = hf.output.LayerNorm  # shared, not copied: not part of attention
        self.hidden_dropout = float(hf.output.dropout.p)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None, cache: Any | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if encoder_hidden_states is not None:
            raise ValueError("encoder_hidden_states given to a patched BERT self-attention: cross-attention "
                             "is not supported")
        cache = _self_attention_cache(_hf_cache(cache, kwargs))
        y, weights = self.attend(hidden_states, attention_mask, None, cache, kwargs)
        y = F.dropout(y, self.hidden_dropout, self.training)
        return self.LayerNorm(y + hidden_states), weights


class _Recorder(nn.Module):
    """``(y, weights) -> (y, weights)``: where transformers' recording hooks read a wrapper's weights
    when the wrapper itself returns the output alone (their hooks take a non-tuple output whole)."""

    def forward(self, y: torch.Tensor, weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return y, weights


class _BertEncoderWrapper(_BertWrapper):
    """BERT's attention in its encoder-only form (LayoutLM and its copies):
    ``forward(hidden_states, attention_mask=None, **kwargs) -> LayerNorm(y + x)`` (B, S, E) alone."""

    def __init__(self, original: nn.Module, mh: MultiHeadAttention) -> None:
        super().__init__(original, mh)
        self.recorder = _Recorder()

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,  # type: ignore[override]
                **kwargs: Any) -> torch.Tensor:
        return self.recorder(*super().forward(hidden_states, attention_mask, **kwargs))[0]


# ---- fused query_key_value families: GPT-NeoX (Pythia), Falcon, BLOOM ----------------------------------
class _GPTNeoXWrapper(PatchedAttention):
    """``forward(hidden_states, attention_mask, layer_past=None, position_embeddings=None, **kwargs)``;
    GPTNeoXLayer passes ``position_ids`` among the kwargs. HF's cos/sin are ignored (our RoPE)."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                layer_past: Any | None = None, position_embeddings: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = _hf_cache(layer_past, kwargs)
        positions = _positions(hidden_states, kwargs.get("position_ids"), cache, self.layer_idx)
        return self.attend(hidden_states, attention_mask, positions, cache, kwargs)


class _FalconWrapper(PatchedAttention):
    """``forward(hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
    use_cache=False, output_attentions=False, position_embeddings=None, **kwargs)``, RoPE only."""

    def __init__(self, original: nn.Module, mh: MultiHeadAttention) -> None:
        super().__init__(original, mh)
        self.cache_every_head = bool(getattr(original, "new_decoder_architecture", False))

    def forward(self, hidden_states: torch.Tensor, alibi: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                layer_past: Any | None = None, use_cache: bool = False, output_attentions: bool = False,
                position_embeddings: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if alibi is not None:
            raise ValueError("alibi given to a patched FalconAttention: Falcon's ALiBi is not supported")
        cache = _hf_cache(layer_past, kwargs)
        positions = _positions(hidden_states, position_ids, cache, self.layer_idx)
        return self.attend(hidden_states, attention_mask, positions, cache, kwargs, output_attentions)

    def _to_cache(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.cache_every_head:
            return k, v
        group = self.mh.num_heads // self.mh.num_kv_heads  # HF broadcasts K/V to every query head first
        return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, S, D)

    def _from_cache(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.cache_every_head:
            return k, v
        group = self.mh.num_heads // self.mh.num_kv_heads  # each K/V head is held `group` times in a row
        return k[:, ::group], v[:, ::group]  # (B, Hkv, Sk, D), views


class _BloomWrapper(PatchedAttention):
    """``forward(hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
    output_attentions=False, **kwargs)`` -> ``residual + dropout(dense(attention))``.

    BloomModel's ``alibi`` (B·H, 1, Sk) is ``slope_h · position``, where a key's position counts
    the unmasked keys before it (``cumsum(attention_mask) - 1``); our ALiBi counts key indices.
    With a mask, the keys of each row are therefore reordered, unmasked ones first (in order):
    a key's index is then its position, and our bias differs from BLOOM's by a per-row constant,
    which the softmax ignores. So masks with holes (generation after right padding) stay exact.
    """

    def __init__(self, original: nn.Module, mh: MultiHeadAttention) -> None:
        super().__init__(original, mh)
        hf: Any = original  # transformers' module: its attributes are not typed here
        self.hidden_dropout = float(hf.hidden_dropout)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor, alibi: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, layer_past: Any | None = None, use_cache: bool = False,
                output_attentions: bool = False, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = _hf_cache(layer_past, kwargs)
        y, weights = self.attend(hidden_states, attention_mask, None, cache, kwargs, output_attentions)
        return residual + F.dropout(y, self.hidden_dropout, self.training), weights

    def attend(self, x: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor | None,
               cache: Any | None, kwargs: dict[str, Any], output_attentions: bool | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        mask = bool_mask(attention_mask, x.shape[1] if cache is None else None)
        if mask is None or not _has_holes(mask):  # key indices are BLOOM's positions, or off by a row's constant
            return super().attend(x, attention_mask, positions, cache, kwargs, output_attentions)
        layer = self.mh
        if layer.watch is not None:
            # The steps report the keys in the order they are attended: reordered here.
            raise ValueError("multihead.heads.capture of a patched BloomAttention (or a trace of it) with masked "
                             "keys between unmasked ones is not supported (BLOOM's ALiBi positions skip them)")
        want = self.wants_weights(output_attentions, kwargs)
        q, k, v = layer.split(*layer.project(x))  # (B, H, S, D), (B, Hkv, S, D) ×2
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)  # (B, Hkv, Sk, D)
            mask = mask[..., :k.shape[2]]
        k, v, mask, order = _unmasked_keys_first(k, v, mask)
        # HF's mask holds the causal rule; after reordering only the mask can state it.
        heads, weights = layer.attend(q, k, v, mask=mask, structure=Structure(), return_weights=want,
                                      cached=cache is not None)
        if weights is not None:  # back to the keys' own order
            weights = torch.zeros_like(weights).scatter_(3, order[:, None, None, :].expand_as(weights), weights)
        return layer.output(heads), weights  # (B, S, E)


def _has_holes(mask: torch.Tensor) -> bool:
    """Whether some row of ``mask`` (B|1, 1|H, Sq, Sk) has, for its last query, masked keys
    between unmasked ones (reads one bool back to the host)."""
    seen = mask[..., -1, :]  # (B|1, 1|H, Sk)
    count = seen.sum(-1)
    first = seen.int().argmax(-1)
    last = seen.shape[-1] - 1 - seen.flip(-1).int().argmax(-1)
    return bool(((count > 0) & (count != last - first + 1)).any())


def _unmasked_keys_first(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reorder each row's keys (B, Hkv, Sk, D) and mask (B|1, 1|H, Sq, Sk): the keys the last
    query may attend (under a causal mask, every unmasked key) first, in order, then the rest.
    Also returns the order (B, Sk): reordered key j is key ``order[b, j]``."""
    mask = mask.expand(k.shape[0], -1, -1, -1)  # (B, 1|H, Sq, Sk)
    order = torch.sort((~mask[:, 0, -1, :]).to(torch.int8), dim=-1, stable=True).indices  # (B, Sk)
    keys = order[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
    cols = order[:, None, None, :].expand(-1, mask.shape[1], mask.shape[2], -1)
    return k.gather(2, keys), v.gather(2, keys), mask.gather(3, cols), order


# ---- CLIP / DistilBERT, OPT, BART / mBART / Whisper (issue #15 item 8) -------------------------------
class _ClipWrapper(PatchedAttention):
    """``forward(hidden_states, attention_mask=None, **kwargs)`` whose keywords reach HF's kernel
    (CLIP, DistilBERT).

    CLIP's text encoder passes ``is_causal=True`` to a module whose ``is_causal`` is False:
    HF's kernels obey it only where no mask is given (``sdpa`` with a causal mask skipped; a
    given mask already holds causality, and ``eager`` always gets one), and so does this.
    """

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = hidden_states.shape[1]
        if attention_mask is None and kwargs.get("is_causal") and not self.mh.causal and s > 1:
            attention_mask = torch.ones(s, s, dtype=torch.bool, device=hidden_states.device).tril()[None, None]
        elif kwargs.get("is_causal") is False and self.mh.causal:
            raise ValueError(f"is_causal=False given to a patched causal {type(self.original).__name__}: "
                             "not supported")
        return self.attend(hidden_states, attention_mask, None, None, kwargs)


class _OptWrapper(PatchedAttention):
    """OPT: ``forward(hidden_states, cache=None, attention_mask=None, output_attentions=False, **kwargs)``."""

    def forward(self, hidden_states: torch.Tensor, cache: Any | None = None,
                attention_mask: torch.Tensor | None = None, output_attentions: bool = False,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = _hf_cache(cache, kwargs)
        return self.attend(hidden_states, attention_mask, None, cache, kwargs, output_attentions)


class _Seq2SeqWrapper(PatchedAttention):
    """BART (and its copies), mBART, Whisper: ``forward(hidden_states, key_value_states=None, cache=None,
    attention_mask=None, **kwargs)``.

    Self-attention without ``key_value_states`` (the encoder's, bidirectional; the
    decoder's, causal through ``self_attention_cache``); cross-attention with them: keys and
    values are projected from the encoder output once and stored in
    ``cross_attention_cache``, then read back at every later step (``is_updated``), exactly
    as the HF classes do, so that generation continues on HF's cache.
    """

    def forward(self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,
                cache: Any | None = None, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        from transformers.cache_utils import EncoderDecoderCache

        cache = _hf_cache(cache, kwargs)
        output_attentions = kwargs.pop("output_attentions", None)
        if key_value_states is None:
            if isinstance(cache, EncoderDecoderCache):
                cache = cache.self_attention_cache
            return self.attend(hidden_states, attention_mask, None, cache, kwargs, output_attentions)
        if key_value_states.shape[0] != hidden_states.shape[0]:
            raise ValueError(f"key_value_states must have the batch size of hidden_states "
                             f"({hidden_states.shape[0]}), got shape {list(key_value_states.shape)}")
        want = self.wants_weights(output_attentions, kwargs)
        return self._cross(hidden_states, key_value_states, bool_mask(attention_mask), cache, kwargs, want)

    def _cross(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None, cache: Any,
               kwargs: dict[str, Any], want: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, S, E) attends to context (B, Sk, E); mask bool (B|1, 1, S, Sk) or None
        -> (y (B, S, E), weights (B, H, S, Sk) or None)."""
        from transformers.cache_utils import EncoderDecoderCache

        layer, idx = self.mh, self.layer_idx
        if cache is None:
            result = layer(x, context, mask=mask, return_weights=want)
            return result if isinstance(result, tuple) else (result, None)
        if idx is None:
            raise ValueError(f"a patched {type(self.original).__name__} without layer_idx cannot use a cache")
        store, updated = cache, False
        if isinstance(cache, EncoderDecoderCache):
            store, updated = cache.cross_attention_cache, bool(cache.is_updated.get(idx))
        # Once the encoder's keys and values are cached, no context token is projected again.
        q, k, v = layer.split(*layer.project(x, context[:, :0] if updated else context))  # (B, H, S, D), ...
        if updated:  # the encoder's keys and values, projected at the first step
            k, v = store.layers[idx].keys, store.layers[idx].values  # (B, Hkv, Sk, D)
        else:
            k, v = store.update(k, v, idx, kwargs=kwargs)
            if isinstance(cache, EncoderDecoderCache):
                cache.is_updated[idx] = True
        heads, weights = layer.attend(q, k, v, mask=mask, return_weights=want, cached=True)  # (B, H, S, D)
        return layer.output(heads), weights  # (B, S, E)


# ---- DeepSeek-V2/V3: multi-head latent attention (issue #15) ---------------------------------
class _LatentWrapper(PatchedAttention):
    """DeepSeek's latent attention on :class:`~multihead.MultiHeadLatentAttention` (``self.mh``).

    ``forward(hidden_states, *, position_embeddings, attention_mask, cache, position_ids)``:
    V3's parameters, keyword-only because V2 orders them differently (both decoder layers
    pass them by keyword). HF's cos/sin are ignored: our RoPE, built from the same config,
    computes them from ``position_ids``. Without a cache the keys and values of every head
    are decompressed, as transformers computes them. With HF's cache the layer writes what
    transformers' class writes, the normalised latent (B, 1, S, r) and the rotated shared
    key (B, 1, S, dr) (in our RoPE pairing: only this layer reads them), and the heads
    attend through the absorbed up-projections: nothing held is decompressed.
    """

    def __init__(self, original: nn.Module, mla: MultiHeadLatentAttention) -> None:
        layer: Any = mla  # the base types self.mh as MultiHeadAttention; here it is latent
        super().__init__(original, layer)

    @property
    def latent(self) -> MultiHeadLatentAttention:
        layer: Any = self.mh
        return layer

    def _synced_original(self) -> nn.Module:
        weight = self.latent.o_proj.weight
        original = self.original.to(device=weight.device, dtype=weight.dtype).train(self.training)
        with torch.no_grad():
            original.load_state_dict(self.latent.state_dict())  # the same names (from_hf checked them)
        return original

    def forward(self, hidden_states: torch.Tensor, *, position_embeddings: Any = None,
                attention_mask: torch.Tensor | None = None, cache: Any | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer = self.latent
        if self.wants_weights(None, kwargs):
            raise ValueError(f"a patched {type(self.original).__name__} (multi-head latent attention) returns no "
                             "attention weights: output_attentions and multihead.heads.capture are not supported "
                             "for it")
        cache = _hf_cache(cache, kwargs)
        positions = _positions(hidden_states, kwargs.get("position_ids"), cache, self.layer_idx)
        q_nope, q_rot, entries = layer.project(hidden_states, positions)  # entries (B, S, r + dr)
        if cache is None:
            mask = bool_mask(attention_mask, hidden_states.shape[1])
            return layer.output(layer.attend_decompressed(q_nope, q_rot, entries, mask)), None
        r = layer.kv_lora_rank
        latent, k_rot = cache.update(entries[:, None, :, :r], entries[:, None, :, r:], self.layer_idx,
                                     kwargs=kwargs)  # (B, 1, Sk, r), (B, 1, Sk, dr)
        held = torch.cat((latent, k_rot), dim=-1)[:, 0]  # (B, Sk, r + dr)
        mask, n = written_keys(bool_mask(attention_mask), hidden_states.shape[1], held.shape[1], True)
        return layer.output(layer.attend_absorbed(q_nope, q_rot, held[:, :n], mask)), None
# ---- end DeepSeek ------------------------------------------------------------------------------


# ---- Llama 4 text attention: chunked attention and temperature tuning -----------------------------------
class _Llama4Wrapper(_LlamaWrapper):
    """Llama 4's text attention: Llama's call, plus what its class and model add to attention.

    * Chunks (``config.layer_types[layer_idx] == "chunked_attention"``): queries attend causally
      inside chunks of ``attention_chunk_size`` tokens. HF's mask holds them wherever they cut
      (``create_chunked_causal_mask``, chunks counted from each row's first real token); where HF
      gives no mask (every key of the call in one chunk, no padding) they are built here from the
      cache positions, so a direct call is chunked too.
    * Temperature tuning (no-RoPE layers with ``attn_temperature_tuning``): q (B, H, S, D) times
      ``log1p(floor((p + 1) / floor_scale)) · attn_scale + 1`` at the cache positions p (the cache's
      length + 0 .. S-1, the same row for the whole batch), as the class computes it.

    On :class:`multihead.hf.KVCacheAdapter` the fused decoding step is taken where neither changes
    anything (every position of the call in the first chunk and below ``floor_scale - 1``), else the
    layer's steps around ``cache.update``.
    """

    def __init__(self, original: nn.Module, mh: MultiHeadAttention) -> None:
        super().__init__(original, mh)
        hf: Any = original  # transformers' module: its attributes are not typed here
        self.chunk = hf_registry.llama4_chunk(hf, hf.config)
        self.temperature = hf_registry.llama4_temperature(hf, hf.config)

    def attend(self, x: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor | None,
               cache: Any | None, kwargs: dict[str, Any], output_attentions: bool | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Our layer's steps on ``x`` (B, S, E) -> (y (B, S, E), weights (B, H, S, Sk) or None)."""
        layer, s = self.mh, x.shape[1]
        want = self.wants_weights(output_attentions, kwargs)
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0  # as the class reads it
        mask = bool_mask(attention_mask, s if cache is None else None)
        if mask is None and hf_cache.is_adapter(cache) and not want and self._plain(past, s):
            y = hf_cache.own_step(layer, self.layer_idx, cache, x, None, positions)
            if y is not None:
                return y, None
        q, k, v = layer.split(*layer.project(x))  # (B, H, S, D), (B, Hkv, S, D) ×2
        q, k = layer.rotate(q, k, positions if layer.rope is not None else None)
        if self.temperature is not None:
            q = self._tuned(q, past)
            if layer.watch is not None:  # what attention reads, where a rotated q is reported (capture's q)
                layer.watch.observe("Q_rot", q)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)  # (B, Hkv, Sk, D)
        mask, n = written_keys(mask, s, k.shape[2], layer.causal)
        if mask is None and self.chunk is not None:
            mask = self._chunks(past, s, n, x.device)
        heads, weights = layer.attend(q, k[:, :, :n], v[:, :, :n], mask=mask, return_weights=want,
                                      cached=cache is not None)
        return layer.output(heads), weights  # (B, S, E)

    def _plain(self, past: Any, s: int) -> bool:
        """Whether the chunks and the temperature change nothing for positions ``past .. past+S-1``."""
        if not isinstance(past, int):
            return False  # traced: the adapter's own static path
        if self.chunk is not None and past + s > self.chunk:
            return False
        if self.temperature is None:
            return True
        last = torch.tensor(float(past + s - 1), dtype=torch.float32)  # the class's float32 arithmetic
        return bool(torch.floor((last + 1.0) / self.temperature[0]) == 0)

    def _tuned(self, q: torch.Tensor, past: Any) -> torch.Tensor:
        """q (B, H, S, D) scaled per position, as Llama4TextAttention computes it."""
        floor, scale = self.temperature or (1.0, 0.0)
        positions = torch.arange(q.shape[2], device=q.device) + past  # (S,) the cache's, for every row
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor)) * scale + 1.0  # (S,)
        return (q * scales[:, None]).to(q.dtype)  # (B, H, S, D)

    def _chunks(self, past: Any, s: int, n: int, device: torch.device) -> torch.Tensor:
        """(S, n) bool: causal inside chunks, queries at cache positions ``past + i``, the n keys the
        last ``n`` positions up to the last query (HF's chunked mask without padding)."""
        chunk = self.chunk or 1
        q_pos = torch.arange(s, device=device)[:, None] + past  # (S, 1)
        k_pos = torch.arange(n, device=device)[None, :] + (past + s - n)  # (1, n)
        return (k_pos <= q_pos) & (torch.div(k_pos, chunk, rounding_mode="floor")
                                   == torch.div(q_pos, chunk, rounding_mode="floor"))  # (S, n)


_WRAPPERS = {"bert": _BertWrapper, "bert-encoder": _BertEncoderWrapper, "llama4": _Llama4Wrapper,
             "gpt2": _GPT2Wrapper, "llama": _LlamaWrapper, "vit": _ViTWrapper,
             "gpt_neox": _GPTNeoXWrapper, "falcon": _FalconWrapper, "bloom": _BloomWrapper,
             "clip": _ClipWrapper, "opt": _OptWrapper, "bart": _Seq2SeqWrapper,
             "mrope": _MRopeWrapper}


_ATTENTION_NAME = re.compile(r"Attention|Attn|SelfAttn", re.IGNORECASE)


def attention_modules(model: nn.Module, *, include_patched: bool = False) -> list[tuple[str, nn.Module]]:
    """Top-most attention modules (supported or not; wrappers too if asked), in model order.

    A registered class is always a candidate; any other module whose class name says
    attention, or whose forward dispatches through transformers' ``AttentionInterface``, is one
    (for the kernel route, or to be refused by name) unless a registered class sits inside it, or
    its class is in :data:`~multihead.interop.hf_registry.LEFT_ALONE` (it holds only torch's
    own ``nn.MultiheadAttention``: left as it is, with everything inside it).
    """
    found: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{prefix}.") for prefix in taken):
            continue  # inside an attention module already taken (BertAttention.self, a wrapper's mh)
        if hf_registry.qualified_name(module) in hf_registry.LEFT_ALONE:
            taken.append(name)  # outside the patch's scope, its torch MHA too
        elif isinstance(module, PatchedAttention):
            taken.append(name)
            if include_patched:
                found.append((name, module))
        elif isinstance(module, (MultiHeadAttention, MultiHeadLatentAttention)):
            taken.append(name)  # ours already
        elif hf_registry.spec_of(module) is not None or (
                (_ATTENTION_NAME.search(type(module).__name__) or hf_routes.dispatches(module))
                and not _holds_registered(module)):
            taken.append(name)
            found.append((name, module))
    return found


def _holds_registered(module: nn.Module) -> bool:
    return any(hf_registry.spec_of(m) is not None or isinstance(m, PatchedAttention)
               for _, m in module.named_modules() if m is not module)


def _wrap(module: nn.Module, overrides: dict[str, Any]) -> PatchedAttention:
    """The wrapper for one candidate; ValueError naming the class and the reason otherwise."""
    spec = hf_registry.require_spec(module)
    if spec.call is None:
        raise ValueError(f"{spec.name} is converted with multihead.MultiHeadAttention.from_hf but not patched "
                         "alone; patch the model that holds its parent attention module")
    if spec.layout == "latent":  # DeepSeek (issue #15)
        return _LatentWrapper(module, MultiHeadLatentAttention.from_hf(module, **overrides))
    return _WRAPPERS[spec.call](module, convert(module, **overrides))  # the layer its wrapper completes


#: What a module on the kernel route runs (:attr:`Route.why`).
_ON_KERNEL = "HF's module, the multihead kernel through AttentionInterface"


def _wrapper_route(name: str, original: nn.Module) -> Route:
    """The route of a module ``original`` that a registered wrapper takes (or took)."""
    spec = hf_registry.require_spec(original)
    return Route(name, type(original).__name__, hf_routes.WRAPPER, f"registered: {spec.name}")


def _decide(name: str, module: nn.Module, overrides: dict[str, Any],
            kernel: bool) -> tuple[Route, PatchedAttention | None]:
    """The best exact route for one candidate: its registered wrapper, else (``kernel``) the kernel
    through AttentionInterface, else refused with both reasons."""
    cls = type(module).__name__
    try:
        wrapper = _wrap(module, overrides)
    except ValueError as e:
        not_wrapped = str(e)
    else:
        return _wrapper_route(name, module), wrapper
    if not kernel:
        return Route(name, cls, hf_routes.REFUSED, not_wrapped), None
    why_not_kernel = hf_routes.kernel_refusal(module)
    if why_not_kernel is None:
        if hf_registry.spec_of(module) is None:
            not_wrapped = f"{cls} is not a registered class"
        return Route(name, cls, hf_routes.KERNEL, f"{_ON_KERNEL} (no wrapper: {not_wrapped})"), None
    return Route(name, cls, hf_routes.REFUSED, f"{not_wrapped}; the kernel route: {why_not_kernel}"), None


def routes(model: nn.Module, *, kernel: bool = True) -> list[Route]:
    """How :func:`patch` handles (or handled) each attention module of ``model``, in model order;
    nothing is changed.

    On a model not patched yet, each module's :class:`~multihead.interop.hf_routes.Route` is what
    :func:`patch` would do; on a patched one, a wrapper reads ``"wrapper"``, a module running the
    kernel ``"kernel"``, and a module left as it was ``"refused"`` with the reason.

    Raises:
        TypeError: ``model`` is not an nn.Module.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = []
    for name, module in attention_modules(model, include_patched=True):
        if isinstance(module, PatchedAttention):
            found.append(_wrapper_route(name, module.original))
        elif hf_routes.routed(module):
            found.append(Route(name, type(module).__name__, hf_routes.KERNEL, _ON_KERNEL))
        else:
            found.append(_decide(name, module, {}, kernel)[0])
    return found


@overload
def patch(model: nn.Module, *, strict: bool = ..., backend: str | None = ..., kernel: bool = ...,
          report: Literal[False] = ...) -> nn.Module: ...


@overload
def patch(model: nn.Module, *, strict: bool = ..., backend: str | None = ..., kernel: bool = ...,
          report: Literal[True]) -> list[Route]: ...


def patch(model: nn.Module, *, strict: bool = True, backend: str | None = None, kernel: bool = True,
          report: bool = False) -> nn.Module | list[Route]:
    """Run every attention module of ``model`` on multihead, in place, each by the best exact route.

    Exact or refused, per module (:func:`routes` lists the decision and its reason):

    * ``"wrapper"``: its class is in :data:`multihead.interop.hf_registry.REGISTRY` and its
      description covers it (see :func:`multihead.interop.hf_registry.why_not`): the module is
      replaced by a wrapper around a converted :class:`~multihead.MultiHeadAttention` (our
      projections, RoPE, in-place cache, fused decoding step, packing and head capture);
    * ``"kernel"`` (``kernel=True``): otherwise, where the module dispatches through
      transformers' ``AttentionInterface`` and transformers lets its model run ``"sdpa"``: HF's
      module stays, and multihead's kernel computes its softmax(QKᵀ)V
      (:mod:`multihead.interop.hf_routes`); a keyword argument the kernel does not implement is
      refused by name when the module runs;
    * ``"refused"``: neither, with both reasons.

    Args:
        model: a transformers model (e.g. BertModel, GPT2Model, LlamaForCausalLM).
        strict: raise on an attention module that cannot be converted exactly; False leaves
            such modules as they are, with one warning that lists them and why.
        backend: multihead backend for the converted layers and the kernel (default: the library's).
        kernel: allow the kernel route (False: registered wrappers only).
        report: return :func:`routes` of the patched model instead of the model.

    Returns:
        ``model`` (patched in place; weights are copied, mode and dtype kept), or with
        ``report=True`` each attention module's :class:`~multihead.interop.hf_routes.Route`.
        Patching a model that is already patched, with nothing left to patch, changes nothing
        and warns so.

    Raises:
        TypeError: ``model`` is not an nn.Module.
        ValueError: no supported attention module found, or (``strict``) one that is not
            supported, naming it and why; the model is left unchanged then.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    overrides = {} if backend is None else {"backend": backend}
    candidates = attention_modules(model)
    if any(name == "" for name, _ in candidates):
        raise ValueError(f"model is itself an attention module ({type(model).__name__}): patch the model that "
                         "contains it, or convert it with multihead.MultiHeadAttention.from_hf")
    plan: list[tuple[str, PatchedAttention]] = []
    to_kernel: list[nn.Module] = []
    skipped: list[str] = []
    for name, module in candidates:
        if hf_routes.routed(module):
            continue  # on the kernel route already
        decided, wrapper = _decide(name, module, overrides, kernel)
        if wrapper is not None:
            plan.append((name, wrapper))
        elif decided.route == hf_routes.KERNEL:
            to_kernel.append(module)
        elif strict:
            raise ValueError(f"cannot patch {name} ({decided.cls}): {decided.why}; "
                             "pass strict=False to leave it unpatched")
        else:
            skipped.append(f"{name} ({decided.why})")
    already = is_patched(model)
    if not plan and not to_kernel and not already:
        why = f": {'; '.join(skipped[:3])}" if skipped else ""
        raise ValueError(f"model {type(model).__name__} has no supported attention module to patch{why}")
    if skipped:
        warnings.warn(f"multihead.hf.patch left {len(skipped)} attention module(s) unpatched: "
                      + "; ".join(skipped), stacklevel=2)
    if not plan and not to_kernel:
        warnings.warn(f"model {type(model).__name__} is already patched; nothing left to patch, "
                      "nothing changed", stacklevel=2)
    for name, wrapper in plan:  # only now, so that a failure above leaves the model untouched
        set_submodule(model, name, wrapper)
        _record_like_the_original(model, name, wrapper)
    hf_mrope.link(model, [(name, w) for name, w in plan if isinstance(w, _MRopeWrapper)])
    hf_routes.route(model, to_kernel, backend)
    return routes(model) if report else model


def unpatch(model: nn.Module) -> nn.Module:
    """Put the original HF modules back (the same objects :func:`patch` removed).

    The originals follow the mode (train/eval), dtype and device the model was given
    while patched. Weights changed while patched are *not* copied back; use
    :func:`multihead.interop.to_hf` on ``wrapper.mh`` and ``wrapper.original`` for that. Modules
    on the kernel route get their configs' attention implementation back.

    Returns:
        ``model``.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, PatchedAttention):
            original = module.original
            # The original sat outside the module tree while patched: bring it to the
            # mode, dtype and device the model was moved to meanwhile.
            weight = module.mh.o_proj.weight  # every layer class has o_proj (latent ones may lack q_proj)
            original.to(device=weight.device, dtype=weight.dtype).train(module.training)
            set_submodule(model, name, original)
            _restore_recording(model, name, module)
            hf_mrope.unlink(module)
    hf_routes.restore(model)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether any module of ``model`` is a :class:`PatchedAttention` or runs the multihead kernel
    through the kernel route."""
    return any(isinstance(m, PatchedAttention) or hf_routes.dispatches_here(m) for m in model.modules())


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted ``name`` inside ``model`` (replacing what is there)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


# ---- output_attentions: transformers 5 records weights with hooks on the attention classes ---------
def _record_like_the_original(model: nn.Module, name: str, wrapper: PatchedAttention) -> None:
    """Install on ``wrapper`` the recording hooks transformers would install on the module it
    replaced (``_can_record_outputs`` of the nearest ``PreTrainedModel``: ``attentions`` and
    ``cross_attentions`` at output index 1, matched by class or class name and layer name),
    so ``output_attentions=True`` collects the wrapper's weights; ``wrapper.records`` names them."""
    found = _recorded_parts(model, name, wrapper.original)
    if not found:
        return
    from transformers.utils.output_capturing import install_output_capuring_hook

    owner = _owner_model(model, name)
    installed = bool(getattr(owner, "_output_capturing_hooks_installed", False))
    wrapper.records = tuple(dict.fromkeys(key for key, _, _, _ in found))
    wrapper.__dict__["_recorders_were_installed"] = installed
    # A rule matching by module name (Informer's "self_attn") matches the wrapper at that name too:
    # transformers hooks it itself when it installs its hooks, later; only a rule by class is ours.
    keys = {key for key, _, _, by_name in found if installed or not by_name}
    target = getattr(wrapper, "recorder", wrapper)  # the module that returns (y, weights)
    for key in sorted(keys):
        install_output_capuring_hook(target, key, 1)


def _restore_recording(model: nn.Module, name: str, wrapper: PatchedAttention) -> None:
    """After :func:`unpatch`: transformers installs its recording hooks once per model; if that
    happened while patched, the original modules never got theirs: install them now."""
    owner = _owner_model(model, name)
    if wrapper.__dict__.get("_recorders_were_installed", True) or not getattr(
            owner, "_output_capturing_hooks_installed", False):
        return
    from transformers.utils.output_capturing import install_output_capuring_hook

    for key, sub, index, _ in _recorded_parts(model, name, wrapper.original):
        install_output_capuring_hook(wrapper.original.get_submodule(sub), key, index)


def _owner_model(model: nn.Module, name: str) -> nn.Module | None:
    """The nearest transformers ``PreTrainedModel`` holding the module at ``name`` (its recording
    rules apply there), or None."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    owner = None
    parts = name.split(".")
    for depth in range(len(parts)):
        candidate = model.get_submodule(".".join(parts[:depth])) if depth else model
        if isinstance(candidate, PreTrainedModel):
            owner = candidate
    return owner


def _recorded_parts(model: nn.Module, name: str, original: nn.Module) -> list[tuple[str, str, int, bool]]:
    """(key, submodule name inside ``original``, output index, matched by module name alone) for
    each weights recorder of the owner model that matches ``original`` or one of its submodules
    (BERT records ``.self``)."""
    owner = _owner_model(model, name)
    rules = getattr(type(owner), "_can_record_outputs", None) if owner is not None else None
    if not rules:
        return []
    found = []
    for key, entries in rules.items():
        if "hidden_states" in key:
            continue  # the layers' outputs, never an attention module's weights
        for entry in entries if isinstance(entries, list) else [entries]:
            target, index, layer_name, class_name = _recorder_fields(entry)
            for sub, module in original.named_modules():
                module_name = f".{name}" + (f".{sub}" if sub else "")
                by_class = target is not None and isinstance(module, target)
                by_name = class_name is not None and module_name.endswith(class_name)
                if ((by_class or by_name)
                        and (layer_name is None or f".{layer_name.strip('.')}." in module_name + ".")):
                    found.append((key, sub, index, by_name and not by_class and not sub))
                    break
    return found


def _recorder_fields(entry: Any) -> tuple[type | None, int, str | None, str | None]:
    """(target class, output index, layer name, class name) of one ``_can_record_outputs`` entry:
    an ``OutputRecorder``, a class, or a class name (transformers' own reading of them)."""
    if isinstance(entry, str):
        return None, 1, None, entry
    if isinstance(entry, type):
        return entry, 1, None, None
    return (getattr(entry, "target_class", None), int(getattr(entry, "index", 1)), getattr(entry, "layer_name", None),
            getattr(entry, "class_name", None))
