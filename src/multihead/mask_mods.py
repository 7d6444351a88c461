"""Built-in mask_mods, and their combinations (FlexAttention's ``and_masks`` / ``or_masks``).

Notation: B batch, H query heads, Sq queries, Sk keys.

Each is a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (**True = may attend**) evaluated on
the broadcast index tensors of :mod:`multihead.block_mask`, where ``q_idx`` is the
query's position on the key axis, **bottom-right aligned** as everywhere in multihead
(query row i at ``i + Sk - Sq``). FlexAttention's ``q_idx`` is the row index
(top-left); the two agree when Sq == Sk. Causal and sliding-window masks are
:class:`multihead.masks.Structure`'s rule (``Structure.allows`` on the positions), so
they equal ``Structure.dense`` for every Sq, Sk; they carry it as their ``structure``
attribute, from which :meth:`multihead.BlockMask.from_mask_mod` classifies their tiles
without evaluating every pair (:meth:`multihead.BlockMask.from_structure`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_int, check_tensor
from .block_mask import MaskMod
from .masks import Structure

__all__ = ["StructureMaskMod", "AndMasks", "causal_mask_mod", "sliding_window_mask_mod", "document_mask_mod",
           "prefix_lm_mask_mod", "and_masks", "or_masks"]

_CAUSAL = Structure(causal=True)


@dataclass(frozen=True)
class StructureMaskMod:
    """A :class:`~multihead.masks.Structure` as a mask_mod: ``structure.allows(q_idx, kv_idx)``.

    Attributes:
        structure: the rule (causal and/or a window), read by
            :meth:`multihead.BlockMask.from_mask_mod` to classify tiles from its spans.
    """

    structure: Structure

    def __call__(self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """bool, the broadcast of ``q_idx`` (query positions) and ``kv_idx`` (b, h unused)."""
        return self.structure.allows(q_idx, kv_idx)


#: Causal: key ``kv_idx`` visible from query position ``q_idx`` when ``kv_idx <= q_idx``
#: (``Structure(causal=True)``; bottom-right aligned, the decoding convention).
causal_mask_mod = StructureMaskMod(_CAUSAL)


def sliding_window_mask_mod(window: int, *, causal: bool = True) -> StructureMaskMod:
    """A sliding window of ``window`` keys (``Structure(causal, window)``): with ``causal``
    (Mistral's convention) each query sees itself and the ``window - 1`` keys before it;
    without, keys closer than ``window`` positions on either side. Bottom-right aligned.

    Raises:
        TypeError, ValueError: ``window`` not an int >= 1.
    """
    return StructureMaskMod(Structure(causal=causal, window=check_int("window", window)))


def document_mask_mod(document_ids: torch.Tensor) -> MaskMod:
    """Packed documents: a query sees only keys of its own document (FlexAttention's
    document masking). Combine with :func:`causal_mask_mod` by :func:`and_masks`.

    Args:
        document_ids: (Sk,) or (B, Sk) integer: the document of each key position (a query
            at position p belongs to ``document_ids[..., p]``: self-attention, or a cache of
            Sk positions; needs Sq <= Sk).

    Raises:
        TypeError: not an integer tensor. ValueError: not 1-D or 2-D; when evaluated, a query
            position below 0 (Sq > Sk), which would read ``document_ids`` from its end.
    """
    ids = check_tensor("document_ids", document_ids, ndim=(1, 2))
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise TypeError(f"document_ids must be an integer tensor, got dtype {ids.dtype}")
    rows = ids[None] if ids.dim() == 1 else ids  # (B|1, Sk)

    def document(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        if q_idx.numel() and int(q_idx.min()) < 0:
            raise ValueError(f"document_mask_mod needs query positions >= 0 (Sq <= Sk: query i sits at "
                             f"i + Sk - Sq), got {int(q_idx.min())}")
        per_b = b if rows.shape[0] > 1 else torch.zeros_like(b)  # (B|1, 1, 1, 1)
        return rows[per_b, q_idx] == rows[per_b, kv_idx]
    return document


def prefix_lm_mask_mod(prefix_length: int | torch.Tensor) -> MaskMod:
    """Prefix-LM (PaliGemma, T5's prefix LM): every query sees the first ``prefix_length``
    key positions (bidirectional prefix), and the keys up to its own position (causal).

    Args:
        prefix_length: an int, or (B,) integer tensor: one prefix length per batch row.

    Raises:
        TypeError, ValueError: not a non-negative int or a (B,) integer tensor.
    """
    if isinstance(prefix_length, torch.Tensor):
        lengths = check_tensor("prefix_length", prefix_length, ndim=1)
        if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise TypeError(f"prefix_length must be an int or an integer tensor (B,), got dtype {lengths.dtype}")

        def prefix_lm(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return (kv_idx < lengths[b]) | _CAUSAL.allows(q_idx, kv_idx)
        return prefix_lm
    n = check_int("prefix_length", prefix_length, minimum=0)

    def prefix_lm_fixed(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx < n) | _CAUSAL.allows(q_idx, kv_idx)
    return prefix_lm_fixed


def _check_mods(name: str, mods: tuple[MaskMod, ...]) -> None:
    if not mods:
        raise ValueError(f"{name} needs at least one mask_mod, got none")
    for i, mod in enumerate(mods):
        if not callable(mod):
            raise TypeError(f"{name}'s mask_mod {i} must be callable, got {type(mod).__name__}")


@dataclass(frozen=True)
class AndMasks:
    """The intersection of ``mask_mods``, as a mask_mod (:func:`and_masks`).

    Attributes:
        mask_mods: the parts.
        within: the intersection of the parts' structures (causal and/or windows), which it never
            exceeds: :meth:`multihead.BlockMask.from_mask_mod` evaluates it only on the key blocks
            that structure reaches; None without such a part.
    """

    mask_mods: tuple[MaskMod, ...]
    within: Structure | None

    def __call__(self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """bool: every part allows the pair (the broadcast of the parts' results)."""
        result = self.mask_mods[0](b, h, q_idx, kv_idx)
        for mod in self.mask_mods[1:]:
            result = result & mod(b, h, q_idx, kv_idx)
        return result


def _structures(mod: object) -> list[Structure]:
    """The structures ``mod`` is (``structure``) or lies within (``within``)."""
    found = [getattr(mod, name, None) for name in ("structure", "within")]
    return [s for s in found if isinstance(s, Structure)]


def and_masks(*mask_mods: MaskMod) -> StructureMaskMod | AndMasks:
    """The mask_mod allowing a pair where every one of ``mask_mods`` does (intersection).

    Causal and window parts intersect as one :class:`~multihead.masks.Structure` (causal if any
    is, the narrowest window): parts that are all structures give that structure's mask_mod
    (:class:`StructureMaskMod`), others an :class:`AndMasks` within it.

    Raises:
        ValueError: no mask_mod. TypeError: one is not callable.
    """
    _check_mods("and_masks", mask_mods)
    parts = [s for mod in mask_mods for s in _structures(mod)]
    windows = [s.window for s in parts if s.window is not None]
    within = Structure(any(s.causal for s in parts), min(windows) if windows else None) if parts else None
    if within is not None and all(isinstance(mod, StructureMaskMod) for mod in mask_mods):
        return StructureMaskMod(within)
    return AndMasks(tuple(mask_mods), within)


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """The mask_mod allowing a pair where any one of ``mask_mods`` does (union).

    Raises:
        ValueError: no mask_mod. TypeError: one is not callable.
    """
    _check_mods("or_masks", mask_mods)

    def either(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        result = mask_mods[0](b, h, q_idx, kv_idx)
        for mod in mask_mods[1:]:
            result = result | mod(b, h, q_idx, kv_idx)
        return result
    return either
