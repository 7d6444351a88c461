"""The wrappers :func:`multihead.hf.patch` puts in place of Hugging Face attention modules.

Notation: B batch, S tokens (queries), Sk keys, E embed_dim, H query heads, Hkv key/value
heads, D head_dim.

:class:`PatchedAttention` is what every wrapper is: a converted
:class:`~multihead.MultiHeadAttention` (``self.mh``) wearing the HF module's forward signature,
its state dict the original's, its :meth:`~PatchedAttention.attend` the layer's steps with or
without HF's cache. This module holds it, the helpers every wrapper reads its call with, and the
families on Llama's call (Llama and the classes described with ``call="llama"``, M-RoPE, Llama 4)
and ViT's; :mod:`multihead.interop.hf_wrappers_other` holds the families with calls of their own.
:data:`WRAPPERS` maps a registry entry's ``call`` to its wrapper class.

This module imports transformers lazily: ``import multihead`` never imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..module import MultiHeadAttention
from . import hf_cache, hf_mrope, hf_registry
from .hf_kernel import bool_mask, hf_recording, written_keys
from .hf_structure import attend_structure
from .hf_weights import to_hf

__all__ = ["PatchedAttention", "MRopeWrapper", "WRAPPERS", "cache_argument", "self_attention_cache",
           "call_positions"]


class PatchedAttention(nn.Module):
    """A :class:`MultiHeadAttention` wearing an HF attention module's forward signature.

    ``self.mh`` is the converted layer; the original HF module is kept outside the module
    tree (not in ``parameters()``) for :func:`multihead.hf.unpatch`. Subclasses adapt one family's call
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
        #: transformers' output keys recorded from this module (``attentions``...): see :func:`multihead.hf.patch`
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
            structure = attend_structure(layer.structure, attention_mask, mask, x.shape[1])
            if structure == layer.structure:
                result = layer(x, mask=mask, positions=at, return_weights=want)
                return result if isinstance(result, tuple) else (result, None)
            # HF's mask allows what the layer's rule hides (an image's tokens both ways): the mask alone
            q, k, v = layer.split(*layer.project(x))  # (B, H, S, D), (B, Hkv, S, D) ×2
            q, k = layer.rotate(q, k, at)
            heads, weights = layer.attend(q, k, v, mask=mask, structure=structure, return_weights=want)
            return layer.output(heads), weights  # (B, S, E)
        if hf_cache.is_adapter(cache) and not want:  # our own cached call (fused when it can) where HF's allows
            y = hf_cache.own_step(layer, self.layer_idx, cache, x, mask, positions, attention_mask)
            if y is not None:
                return y, None
        q, k, v = layer.split(*layer.project(x))  # (B, H, S, D), (B, Hkv, S, D) ×2
        q, k = layer.rotate(q, k, at)
        # The HF cache stores (B, Hkv, Sk, D) keys after RoPE, as our KVCache does.
        k, v = self._from_cache(*cache.update(*self._to_cache(k, v), self.layer_idx, kwargs=kwargs))  # (B, Hkv, Sk, D)
        mask, n = written_keys(mask, q.shape[2], k.shape[2], layer.causal)
        structure = attend_structure(layer.structure, attention_mask, mask, q.shape[2])
        heads, weights = layer.attend(q, k[:, :, :n], v[:, :, :n], mask=mask, structure=structure,
                                      return_weights=want, cached=True)
        return layer.output(heads), weights  # (B, S, E)

    def wants_weights(self, output_attentions: bool | None, kwargs: dict[str, Any]) -> bool:
        """Whether this call must return the attention weights: ``output_attentions`` given to
        the module (transformers 4), or transformers 5 collecting the outputs this wrapper
        records (``attentions``, ``cross_attentions``: :func:`multihead.hf.patch` installs HF's recording
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


def cache_argument(cache: Any | None, kwargs: dict[str, Any]) -> Any | None:
    """The HF cache, under its v5 name ``cache`` or the older ``past_key_values``/``past_key_value``."""
    for old in ("past_key_values", "past_key_value"):
        cache = cache if cache is not None else kwargs.pop(old, None)
    return cache


def self_attention_cache(cache: Any | None) -> Any | None:
    """A decoder self-attention's part of HF's cache: an ``EncoderDecoderCache``'s ``self_attention_cache``
    (a decoder with cross-attention layers, GPT-2's and BERT's, holds one), else the cache itself."""
    return cache.self_attention_cache if cache is not None and hasattr(cache, "self_attention_cache") else cache


def call_positions(x: torch.Tensor, position_ids: torch.Tensor | None, cache: Any | None,
                   layer_idx: int | None) -> torch.Tensor:
    """The RoPE positions of a call on x (B, S, E): HF's ``position_ids`` (B, S) where given, else
    (S,) from the cache's length at ``layer_idx`` (0 without a cache)."""
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
        cache = cache_argument(cache, kwargs)
        positions = call_positions(hidden_states, kwargs.get("position_ids"), cache, self.layer_idx)
        y, weights = self.attend(hidden_states, attention_mask, positions, cache, kwargs)
        return F.dropout(y, self.resid_dropout, self.training), weights


class MRopeWrapper(PatchedAttention):
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
        cache = cache_argument(cache, kwargs)
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
            structure = attend_structure(layer.structure, attention_mask, mask, q.shape[2])
            heads, weights = layer.attend(q, k, v, mask=mask, structure=structure, return_weights=want)
        else:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)  # (B, Hkv, Sk, D), in place on ours
            mask, n = written_keys(mask, q.shape[2], k.shape[2], layer.causal)
            structure = attend_structure(layer.structure, attention_mask, mask, q.shape[2])
            heads, weights = layer.attend(q, k[:, :, :n], v[:, :, :n], mask=mask, structure=structure,
                                          return_weights=want, cached=True)
        return layer.output(heads), weights  # (B, S, E)


class _ViTWrapper(PatchedAttention):
    """ViT-style classes: ``forward(hidden_states, attention_mask=None, **kwargs)``, no positions."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.attend(hidden_states, attention_mask, None, None, kwargs)


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
        structure = attend_structure(layer.structure, attention_mask, mask, s)
        if mask is None and self.chunk is not None:
            mask = self._chunks(past, s, n, x.device)
        heads, weights = layer.attend(q, k[:, :, :n], v[:, :, :n], mask=mask, structure=structure,
                                      return_weights=want, cached=cache is not None)
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


#: The wrapper class of each ``call`` of :data:`multihead.interop.hf_registry.REGISTRY` this module holds.
WRAPPERS: Mapping[str, type[PatchedAttention]] = {"llama": _LlamaWrapper, "llama4": _Llama4Wrapper,
                                                  "mrope": MRopeWrapper, "vit": _ViTWrapper}
