"""Multimodal RoPE (M-RoPE): each frequency reads one of three position rows.

Notation: B batch, H heads, S tokens, D head dim, R rotary dims (R <= D, even), P = R/2
frequency slots.

Qwen2-VL's text model gives every token three positions, (3, B, S): temporal, height and
width. Text tokens hold the same value in all three rows; the tokens of an image or a video
hold their grid coordinates. Frequency slot p (p = 0 .. P-1, angle ``position · inv_freq[p]``)
takes its position from the row ``slot_rows[p]``; the rotation itself is :class:`~multihead.RoPE`'s
(rotate-half pairs (p, p + P) for Qwen's checkpoints). The ``sections`` (three counts summing to
P, ``rope_parameters["mrope_section"]``) assign slots to rows in one of two layouts:

* ``"chunked"`` (Qwen2-VL, Qwen2.5-VL): the first ``sections[0]`` slots read row 0, the next
  ``sections[1]`` row 1, the last ``sections[2]`` row 2, e.g. [16, 24, 24] for D = 128.
* ``"interleaved"`` (Qwen3-VL): slot p reads row ``p mod 3`` while p < 3 · sections[row] for
  rows 1 and 2, row 0 otherwise, e.g. [24, 20, 20]: T H W T H W ... then T to the end.

Where the three rows are equal (every text token, and decoding after an image), each slot reads
the same position: M-RoPE is plain RoPE at row 0, bit for bit. :meth:`MRoPE.rotate` therefore
takes (S,) or (B, S) positions as :class:`~multihead.RoPE` does, and (3, B, S) positions for the
sectioned rotation. :class:`~multihead.MultiHeadAttention`'s ``forward`` (and its cache and fused
decoding step) takes the former; the latter go through the layer's steps
(``layer.rotate(q, k, positions)``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from ._checks import check_int, check_tensor
from .rope import ROPE_TABLE_POSITIONS, RoPE, apply_rotary
from .rope_scaling import RopeScaling

__all__ = ["MRoPE", "MROPE_LAYOUTS", "slot_rows"]

#: How ``sections`` assign frequency slots to position rows (see the module docstring).
MROPE_LAYOUTS = ("chunked", "interleaved")


def slot_rows(sections: Sequence[int], layout: str, slots: int) -> torch.Tensor:
    """(P,) int64: the position row (0, 1 or 2) each of the P = ``slots`` frequency slots reads.

    Raises:
        ValueError: ``layout`` not in :data:`MROPE_LAYOUTS`, ``sections`` not three ints >= 0
            summing to ``slots``, naming the argument with the expected and actual values.
        TypeError: ``sections`` not a sequence of ints.
    """
    if layout not in MROPE_LAYOUTS:
        raise ValueError(f"layout must be one of {list(MROPE_LAYOUTS)}, got {layout!r}")
    if isinstance(sections, (str, bytes)) or not isinstance(sections, Sequence):
        raise TypeError(f"sections must be a list of 3 ints, got {type(sections).__name__} {sections!r}")
    if len(sections) != 3 or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sections):
        raise ValueError(f"sections must be 3 ints >= 0 (temporal, height, width), got {list(sections)!r}")
    if sum(sections) != slots:
        raise ValueError(f"sections must sum to rotary_dim / 2 = {slots} frequency slots, got {list(sections)} "
                         f"(sum {sum(sections)})")
    if layout == "chunked":
        rows = [row for row, count in enumerate(sections) for _ in range(count)]
    else:  # Qwen3-VL: H at slots 1, 4, ... < 3·sections[1]; W at 2, 5, ... < 3·sections[2]; T elsewhere
        rows = [p % 3 if p % 3 and p < 3 * sections[p % 3] else 0 for p in range(slots)]
    return torch.tensor(rows, dtype=torch.int64)  # (P,), computed by value (also under a meta device)


class MRoPE(RoPE):
    """Rotary position embedding whose frequency slots read three position rows (M-RoPE).

    Args:
        head_dim: D.
        base: θ (``rope_theta``).
        sections: three slot counts (temporal, height, width) summing to R/2
            (``mrope_section``).
        layout: ``"chunked"`` (Qwen2-VL, Qwen2.5-VL) or ``"interleaved"`` (Qwen3-VL).
        interleaved, rotary_dim, max_positions, scaling: as :class:`~multihead.RoPE`.

    Raises:
        ValueError, TypeError: as :class:`~multihead.RoPE`, and as :func:`slot_rows` for
            ``sections`` and ``layout``.
    """

    rows: torch.Tensor

    def __init__(self, head_dim: int, base: float = 10000.0, *, sections: Sequence[int], layout: str = "chunked",
                 interleaved: bool = False, rotary_dim: int | None = None, max_positions: int = 4096,
                 scaling: RopeScaling | None = None) -> None:
        self.sections, self.layout = sections, layout  # read by _tables, which slot_rows checks them for
        super().__init__(head_dim, base, interleaved=interleaved, rotary_dim=rotary_dim, max_positions=max_positions,
                         scaling=scaling)  # its tables, and rows (P,): see _tables
        self.sections = tuple(sections)

    DERIVED = (*RoPE.DERIVED, "rows")

    def _tables(self) -> dict[str, torch.Tensor]:
        """RoPE's tables, and rows (P,) int64: the position row each frequency slot reads."""
        return {**super()._tables(), "rows": slot_rows(self.sections, self.layout, self.rotary_dim // 2)}

    @classmethod
    def from_sections(cls, head_dim: int, base: float, *, sections: Sequence[int], layout: str = "chunked",
                      max_positions: int | None = None, scaling: RopeScaling | None = None) -> MRoPE:
        """The M-RoPE a model's facts describe, its table sized by :meth:`RoPE.from_facts`' rule
        (the trained context length, capped at :data:`~multihead.rope.ROPE_TABLE_POSITIONS`)."""
        if max_positions is not None:
            check_int("max_positions", max_positions, maximum=sys.maxsize)
        positions = min(max_positions or ROPE_TABLE_POSITIONS, ROPE_TABLE_POSITIONS)
        return cls(head_dim, base, sections=sections, layout=layout, max_positions=positions, scaling=scaling)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sections={list(self.sections)}, layout={self.layout!r}"

    def rotate(self, tensors: tuple[torch.Tensor, ...], positions: torch.Tensor | None = None, *,
               bound: int | None = None) -> tuple[torch.Tensor, ...]:
        """Rotate several tensors (q and k) at the same positions.

        Args:
            tensors: each (B, H, S, D), same B, S and dtype (H may differ: GQA).
            positions: (3, B|1, S) integer positions, one row per section (temporal, height,
                width); or (S,) / (B, S), every row the same (plain RoPE, see the module
                docstring); default 0 .. S-1.
            bound: known exclusive upper bound of ``positions`` (see :meth:`RoPE.tables`).

        Returns:
            the rotated tensors, in order.

        Raises:
            ValueError, TypeError: a tensor not (B, H, S, D) with this head dim, positions of
                another shape or not integers, naming them.
        """
        if positions is None or positions.dim() != 3:
            return super().rotate(tensors, positions, bound=bound)
        for i, t in enumerate(tensors):
            check_tensor(f"tensors[{i}]", t, ndim=4)
            if t.shape[-1] != self.head_dim:
                raise ValueError(f"tensors[{i}] must have head dim {self.head_dim} in [B, H, S, D], "
                                 f"got shape {list(t.shape)}")
        b, _, s, _ = tensors[0].shape
        check_row_positions(positions, b, s)
        cos3, sin3 = self.tables(positions, tensors[0].dtype, bound=bound)  # (3, B|1, S, P) each
        cos, sin = self.pick(cos3), self.pick(sin3)  # (B|1, S, P)
        return tuple(apply_rotary(t, cos[:, None], sin[:, None], interleaved=self.interleaved) for t in tensors)

    def pick(self, table: torch.Tensor) -> torch.Tensor:
        """(3, B, S, P) -> (B, S, P): slot p of each token from row ``rows[p]``."""
        index = self.rows.to(table.device).expand(1, *table.shape[1:])  # (1, B, S, P)
        return table.gather(0, index)[0]


def check_row_positions(positions: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """M-RoPE positions must be an integer tensor of shape (3, B, S) or (3, 1, S)."""
    positions = check_tensor("positions", positions, ndim=3)
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"positions must be an integer tensor, got dtype {positions.dtype}")
    if positions.shape[0] != 3 or positions.shape[1] not in (1, batch) or positions.shape[2] != seq:
        raise ValueError(f"positions must have shape [3, B, S] = [3, {batch}, {seq}] (temporal, height, width), "
                         f"got {list(positions.shape)}")
    return positions
