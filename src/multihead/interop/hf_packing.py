"""Padding that costs nothing: a patched BERT-family encoder run on its real tokens only.

Notation: B batch, S tokens (padded), N real tokens in the batch, E embed_dim.

An embedding job pads every batch to its longest text. Everything in a BERT encoder layer
but attention works token by token (the projections, the MLP, the LayerNorms), and the
attention of a padded batch only ever mixes a text's own real tokens. So the real tokens of
the whole batch can run as one packed row (1, N, E), each text a sequence of its own: the
projections and the MLP compute N rows instead of B·S, and the attention computes each
text's own square (``packed=True``, the native kernel's packed sequences) instead of S × S
per row. The encoder's output is scattered back to (B, S, E); its padding rows are zeros
(Hugging Face fills them with values computed from the real tokens, which the pooling masks
out). Real tokens are equal to the padded run's within rounding.

    handle = mh.hf.pack_padding(mh.hf.patch(model))   # a BERT, RoBERTa, XLM-R, ELECTRA model
    model(**tokenizer(texts, padding=True, return_tensors="pt"))
    handle.remove()                                   # back to padded batches

Refused by name (before anything runs): a model without a BERT-family encoder, an encoder
whose attention is not patched, calls asking for the layers' hidden states or attention
weights (which would be packed), cross-attention, a cache, a watched layer (``mh.trace``,
``mh.heads.capture``: their records would be packed too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..masks import packed_bounds, packed_cu_seqlens
from .hf_wrappers import PatchedAttention

__all__ = ["pack_padding", "packable", "PackedPadding", "ENCODER_CLASSES"]

#: The encoders whose layers are BERT's (attention + token-wise MLP), by class name.
ENCODER_CLASSES = ("BertEncoder", "RobertaEncoder", "XLMRobertaEncoder", "ElectraEncoder")
#: Keywords that ask for what packing would change the shape of.
_REFUSED = ("output_hidden_states", "output_attentions", "encoder_hidden_states", "cache", "past_key_values")


class PackedPadding:
    """The hooks that pack one encoder's padded batches (:func:`pack_padding`); ``remove()``
    takes them off."""

    def __init__(self, base: nn.Module, encoder: nn.Module, wrappers: list[PatchedAttention]) -> None:
        self.base, self.encoder, self.wrappers = base, encoder, wrappers
        self.real: torch.Tensor | None = None  # (B, S) bool of the call in progress
        self.shape: tuple[int, int, int] | None = None  # (B, S, E) of the call being packed
        self.handles = [
            base.register_forward_pre_hook(self._model_call, with_kwargs=True),
            encoder.register_forward_pre_hook(self._pack, with_kwargs=True),
            encoder.register_forward_hook(self._unpack, always_call=True),
        ]

    def remove(self) -> None:
        """Take the hooks off: the model runs padded batches again."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self._clear()

    def _model_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The model's call: remember its (B, S) mask, refuse what packing would change."""
        asked = [k for k in _REFUSED if kwargs.get(k) not in (None, False)]
        config = getattr(module, "config", None)
        for flag in ("output_hidden_states", "output_attentions"):
            if getattr(config, flag, False) and flag not in kwargs:
                asked.append(f"config.{flag}")
        if asked:
            raise ValueError(f"pack_padding: a packed encoder cannot give {', '.join(asked)} (they would hold packed "
                             "rows); call handle.remove() first, or leave them out")
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        self.real = None if mask is None else mask.bool()

    def _pack(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """(B, S, E) hidden states -> (1, N, E) real tokens, each text one packed sequence."""
        real, self.real = self.real, None
        x = args[0]  # (B, S, E): the encoders of ENCODER_CLASSES take it first
        if real is None or bool(real.all()) or real.shape != x.shape[:2]:
            return None  # nothing padded (or not the model's own mask): the batch runs as it is
        watched = [w for w in self.wrappers if w.mh.watch is not None]
        if watched:
            raise ValueError("pack_padding: a layer is watched (multihead.trace or multihead.heads.capture), whose "
                             "records would be packed rows; call handle.remove() first")
        positions = (real.cumsum(dim=1) - 1)[real].unsqueeze(0)  # (1, N): 0.. per text, restarting at each
        # the packed structure, made once per model call as Hugging Face makes its mask once (every
        # layer then finds it: multihead._memo.derived)
        packed_bounds(packed_cu_seqlens(positions), positions.shape[1], 1)
        for wrapper in self.wrappers:
            wrapper.packing = positions
        self.shape, self.real = tuple(x.shape), real  # type: ignore[assignment]
        packed = x[real].unsqueeze(0)  # (1, N, E)
        args = (packed, *((None,) if len(args) > 1 else ()), *args[2:])  # HF's 4-D mask: not needed now
        if "attention_mask" in kwargs:
            kwargs = {**kwargs, "attention_mask": None}
        return args, kwargs

    def _unpack(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """(1, N, E) -> (B, S, E) with zeros on padding; the wrappers forget the packing."""
        real, shape = self.real, self.shape
        self._clear()
        if real is None or shape is None or output is None:
            return output
        hidden = output[0]  # (1, N, E)
        full = hidden.new_zeros(shape)  # (B, S, E)
        full[real] = hidden[0]
        output["last_hidden_state"] = full
        return output

    def _clear(self) -> None:
        self.real, self.shape = None, None
        for wrapper in self.wrappers:
            wrapper.packing = None


def packable(model: nn.Module) -> bool:
    """Whether ``model`` holds a BERT-family encoder (:data:`ENCODER_CLASSES`) that
    :func:`pack_padding` takes once its attention is patched."""
    return any(type(m).__name__ in ENCODER_CLASSES for m in model.modules())


def pack_padding(model: nn.Module) -> PackedPadding:
    """Run ``model``'s padded batches packed: only the real tokens go through the encoder.

    Args:
        model: a transformers BERT-family model (BertModel, RobertaModel, XLMRobertaModel,
            ElectraModel, or a model holding one, e.g. ...ForSequenceClassification) whose
            attention is patched by :func:`multihead.hf.patch`.

    Returns:
        the :class:`PackedPadding` hooks; ``remove()`` restores padded batches.

    Raises:
        TypeError: ``model`` is not an nn.Module.
        ValueError: no BERT-family encoder, or one whose self-attention is not patched (named).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = [(name, m) for name, m in model.named_modules() if type(m).__name__ in ENCODER_CLASSES]
    if len(found) != 1:
        raise ValueError(f"pack_padding: expected one BERT-family encoder ({', '.join(ENCODER_CLASSES)}) in "
                         f"{type(model).__name__}, found {len(found)}")
    name, encoder = found[0]
    base = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    wrappers = []
    for i, layer in enumerate(getattr(encoder, "layer", ())):
        attention = getattr(layer, "attention", None)
        if not isinstance(attention, PatchedAttention):
            raise ValueError(f"pack_padding: {name}.layer.{i}.attention is {type(attention).__name__}, not patched: "
                             "call multihead.hf.patch(model) first")
        if getattr(layer, "crossattention", None) is not None:
            raise ValueError(f"pack_padding: {name}.layer.{i} has cross-attention, which packing does not carry")
        wrappers.append(attention)
    if not wrappers:
        raise ValueError(f"pack_padding: {name} has no layers")
    return PackedPadding(base, encoder, wrappers)
