"""The wrappers of the Hugging Face families whose attention call is their own.

Notation: B batch, S tokens (queries), Sk keys, E embed_dim, H query heads, Hkv key/value
heads, D head_dim.

Each class below is a :class:`~multihead.interop.hf_wrappers.PatchedAttention` that takes one
family's forward signature and returns what that family's module returns: GPT-2 and BERT (and
BERT's encoder-only form), the fused ``query_key_value`` families (GPT-NeoX, Falcon, BLOOM), the
``out_proj`` families (CLIP and DistilBERT, OPT, BART and its copies, mBART, Whisper, with their
cross-attention on HF's ``EncoderDecoderCache``) and DeepSeek's multi-head latent attention.
:data:`WRAPPERS` maps a registry entry's ``call`` to its wrapper class.

This module imports transformers lazily: ``import multihead`` never imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..latent import MultiHeadLatentAttention
from ..masks import Structure
from ..module import MultiHeadAttention
from .hf_kernel import bool_mask, written_keys
from .hf_structure import attend_structure, exceeds, hides_keys
from .hf_wrappers import PatchedAttention, cache_argument, call_positions, self_attention_cache

__all__ = ["LatentWrapper", "WRAPPERS"]


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
        cache = self_attention_cache(cache_argument(cache, kwargs))
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
        cache = self_attention_cache(cache_argument(cache, kwargs))
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
        cache = cache_argument(layer_past, kwargs)
        positions = call_positions(hidden_states, kwargs.get("position_ids"), cache, self.layer_idx)
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
        cache = cache_argument(layer_past, kwargs)
        positions = call_positions(hidden_states, position_ids, cache, self.layer_idx)
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
        cache = cache_argument(layer_past, kwargs)
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


# ---- CLIP / DistilBERT, OPT, BART / mBART / Whisper -------------------------------
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
        cache = cache_argument(cache, kwargs)
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

        cache = cache_argument(cache, kwargs)
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


# ---- DeepSeek-V2/V3: multi-head latent attention ---------------------------------
class LatentWrapper(PatchedAttention):
    """DeepSeek's latent attention on :class:`~multihead.MultiHeadLatentAttention` (``self.mh``).

    ``forward(hidden_states, *, position_embeddings, attention_mask, cache, position_ids)``:
    V3's parameters, keyword-only because V2 orders them differently (both decoder layers
    pass them by keyword). HF's cos/sin are ignored: our RoPE, built from the same config,
    computes them from ``position_ids``. Without a cache the keys and values of every head
    are decompressed, as transformers computes them. With HF's cache the layer writes what
    transformers' class writes, the normalised latent (B, 1, S, r) and the rotated shared
    key (B, 1, S, dr) (in our RoPE pairing: only this layer reads them), and the heads
    attend through the absorbed up-projections: nothing held is decompressed. A call it refuses
    (weights asked for, HF's mask letting a query see a later key) is refused before HF's cache
    holds any of its entries.
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
        cache = cache_argument(cache, kwargs)
        positions = call_positions(hidden_states, kwargs.get("position_ids"), cache, self.layer_idx)
        q_nope, q_rot, entries = layer.project(hidden_states, positions)  # entries (B, S, r + dr)
        if cache is None:
            mask = bool_mask(attention_mask, hidden_states.shape[1])
            self._check_causal(attention_mask, mask, hidden_states.shape[1])
            return layer.output(layer.attend_decompressed(q_nope, q_rot, entries, mask)), None
        # Refused before HF's cache holds the call's entries: HF's mask covers the keys the update
        # returns (DynamicCache: past + S; StaticCache: its capacity, the whole buffer returned).
        given = bool_mask(attention_mask)  # (B|1, 1|H, S, Sk') or None
        self._check_causal(attention_mask, given, hidden_states.shape[1])
        r = layer.kv_lora_rank
        latent, k_rot = cache.update(entries[:, None, :, :r], entries[:, None, :, r:], self.layer_idx,
                                     kwargs=kwargs)  # (B, 1, Sk, r), (B, 1, Sk, dr)
        held = torch.cat((latent, k_rot), dim=-1)[:, 0]  # (B, Sk, r + dr)
        mask, n = written_keys(given, hidden_states.shape[1], held.shape[1], True)
        if mask is not None and given is not None and mask.shape[-1] != given.shape[-1]:
            # Only where HF's mask is wider than the keys returned (Sk' > Sk): its queries align
            # bottom-right on Sk, known after the update alone, so the cut mask is checked there too.
            self._check_causal(attention_mask, mask, hidden_states.shape[1])
        return layer.output(layer.attend_absorbed(q_nope, q_rot, held[:, :n], mask)), None

    def _check_causal(self, attention_mask: torch.Tensor | None, mask: torch.Tensor | None, sq: int) -> None:
        """Refuse, by name, HF's mask ``mask`` (B|1, 1|H, S, Sk) where it lets a query see a later key:
        the latent layer always applies its causal rule (:func:`~multihead.interop.hf_structure.attend_structure`)."""
        causal = Structure(causal=True)
        if mask is None or not hides_keys(causal, sq, mask.shape[-1]):
            return
        why = (f"a patched {type(self.original).__name__} (multi-head latent attention) always attends causally, "
               "and HF's attention_mask lets a query attend to later keys (bidirectional tokens, as Gemma 3's "
               "images are): not supported; run the model unpatched or with a causal mask")
        if torch.compiler.is_compiling():  # traced: a device assertion, no value read back
            torch._assert_async(~exceeds(mask, causal, sq), why)
        elif attend_structure(causal, attention_mask, mask, sq) != causal:
            raise ValueError(why)
# ---- end DeepSeek ------------------------------------------------------------------------------


#: The wrapper class of each ``call`` of :data:`multihead.interop.hf_registry.REGISTRY` this module
#: holds (DeepSeek's ``"latent"`` is built by :func:`multihead.hf.patch` around its latent layer).
WRAPPERS: Mapping[str, type[PatchedAttention]] = {
    "gpt2": _GPT2Wrapper, "bert": _BertWrapper, "bert-encoder": _BertEncoderWrapper,
    "gpt_neox": _GPTNeoXWrapper, "falcon": _FalconWrapper, "bloom": _BloomWrapper,
    "clip": _ClipWrapper, "opt": _OptWrapper, "bart": _Seq2SeqWrapper}
