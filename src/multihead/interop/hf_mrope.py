"""Where a patched Qwen-VL text attention finds its M-RoPE positions (3, B, S).

Notation: B batch, S tokens, D head_dim.

Qwen2-VL's text model (and Qwen2.5-VL's) computes its positions once per call, (3, B, S) rows
for time, height and width (:mod:`multihead.mrope`), and hands each decoder layer only the
cos/sin (B, S, D) its rotary embedding made of them; the layer's ``position_ids`` is the text
row for packing, or None. The wrapper needs the positions themselves (the in-place cache and
the fused decoding step take positions, and a key must be rotated exactly as HF's), so
:func:`link` records them where the text model's ``rotary_emb`` takes them, with a forward hook
that also keeps the cos it returned. A layer call then gets the positions only when the cos
it was handed *is* that recorded tensor: the positions that made its cos/sin. Called with
other cos/sin (the layer on its own, or cos/sin changed on the way), the wrapper cannot know
the positions and refuses by name; it never falls back to text positions.

:func:`unlink` removes the hooks (:func:`multihead.hf.unpatch` calls it).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["PositionsRecord", "link", "unlink"]


class PositionsRecord:
    """The last positions a text model's rotary embedding took, and the cos it returned.

    ``rows``: (3, B, S) int positions; ``same``: whether the three rows are equal (text only:
    M-RoPE is then plain RoPE at row 0), read back once per model call, not per layer.
    """

    def __init__(self, rotary: nn.Module) -> None:
        self.name = type(rotary).__name__
        self.rows: torch.Tensor | None = None
        self.same = True
        self._cos: weakref.ref[torch.Tensor] | None = None  # weak: the model's activations are not kept
        self.handle = rotary.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        positions = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if (not isinstance(positions, torch.Tensor) or positions.dim() not in (2, 3) or not isinstance(output, tuple)
                or not output):
            self.rows, self._cos = None, None  # nothing a layer may use (it refuses)
            return
        rows = positions.expand(3, -1, -1) if positions.dim() == 3 else positions[None].expand(3, -1, -1)
        self.rows = rows  # (3, B, S): as the rotary embedding broadcasts them
        self.same = bool((rows == rows[:1]).all()) if rows.device.type != "meta" else True
        self._cos = weakref.ref(output[0])

    def positions_for(self, position_embeddings: Any, owner: str) -> torch.Tensor:
        """(3, B, S) positions that made ``position_embeddings`` (HF's (cos, sin)).

        Raises:
            ValueError: ``position_embeddings`` were not the last ones the rotary embedding
                returned (or none were recorded), naming ``owner``.
        """
        cos = position_embeddings[0] if isinstance(position_embeddings, (tuple, list)) and position_embeddings else None
        held = self._cos() if self._cos is not None else None
        if cos is None or held is None or cos is not held or self.rows is None:
            raise ValueError(
                f"a patched {owner} needs the M-RoPE positions (3, B, S) its text model's {self.name} took; "
                "position_embeddings given to it are not the ones that call returned (the layer called on its own, "
                "or cos/sin changed on the way): call the whole text model, or unpatch")
        return self.rows


def link(model: nn.Module, wrappers: list[tuple[str, nn.Module]]) -> None:
    """Give each wrapper at its dotted name in ``model`` the :class:`PositionsRecord` of the nearest
    enclosing module's ``rotary_emb`` (one record, one hook, per rotary embedding); a wrapper
    with none enclosing gets None and refuses when called (it cannot see the positions)."""
    records: dict[int, PositionsRecord] = {}
    for name, wrapper in wrappers:
        rotary = _enclosing_rotary(model, name)
        if rotary is not None and id(rotary) not in records:
            records[id(rotary)] = PositionsRecord(rotary)
        wrapper.__dict__["mrope_record"] = None if rotary is None else records[id(rotary)]


def unlink(wrapper: nn.Module) -> None:
    """Remove the hook of ``wrapper``'s record (every wrapper sharing it then stops receiving)."""
    record = wrapper.__dict__.pop("mrope_record", None)
    if record is not None:
        record.handle.remove()


def _enclosing_rotary(model: nn.Module, name: str) -> nn.Module | None:
    """The ``rotary_emb`` child of the innermost module on ``name``'s path that has one."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        owner = model.get_submodule(".".join(parts[:depth])) if depth else model
        rotary = getattr(owner, "rotary_emb", None)
        if isinstance(rotary, nn.Module):
            return rotary
    return None
