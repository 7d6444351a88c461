"""Rotary position embedding (RoPE), applied per head after the split, to q and k only.

Notation: B batch, H heads, S tokens, D head dim, R rotary dims (R <= D, even).

Pair p (p = 0 .. R/2 - 1) rotates by the angle ``position · base^(-2p/R)``. Which two
coordinates of a head form pair p is the *pairing*, and checkpoints disagree on it:

* ``"half"`` (rotate-half; the default): pair p is (p, p + R/2). Hugging Face
  Llama/Mistral/Qwen/Gemma/GPT-NeoX checkpoints.
* ``"interleaved"``: pair p is (2p, 2p + 1). The RoFormer paper, Meta's original Llama
  code, GPT-J.

Both give the same attention when the q and k projection rows are permuted
accordingly: :func:`interleaved_to_half` and :func:`half_to_interleaved` do that to
weights (what Hugging Face's Llama conversion script does). With a partial rotary
(R < D, GPT-NeoX's ``rotary_pct``), dims R..D-1 pass through unchanged.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ._checks import check_float, check_int, check_tensor
from .rope_scaling import RopeScaling, rope_frequencies

__all__ = ["RoPE", "ROPE_TABLE_POSITIONS", "interleaved_to_half", "half_to_interleaved"]

#: The longest cos/sin table :meth:`RoPE.from_facts` precomputes; later positions are computed
#: on the fly (same formula, same numbers), so a 128k-token model does not hold 128k rows per layer.
ROPE_TABLE_POSITIONS = 8192


class RoPE(nn.Module):
    """Rotary position embedding with tables computed once.

    Args:
        head_dim: D, the width of one head.
        base: the frequency base (``rope_theta``), e.g. 10000 or 500000.
        interleaved: pairing; False = rotate-half (HF), True = interleaved (Meta/GPT-J).
        rotary_dim: R, how many leading dims rotate (default all of D); even.
        max_positions: size of the precomputed cos/sin table; positions beyond it are
            computed on the fly (same formula, same numbers).
        scaling: a :class:`~multihead.rope_scaling.RopeScaling` (linear, dynamic, llama3,
            yarn, longrope); its inverse frequencies and attention factor (which multiplies
            cos and sin) are transformers' bit for bit. Default: plain RoPE.

    Raises:
        ValueError: odd head_dim or rotary_dim, rotary_dim > head_dim, base <= 0, or a
            ``scaling`` that does not fit rotary_dim (longrope factors not R/2 long, dynamic
            with R < 4: :meth:`RopeScaling.check_rotary_dim`), at construction.
        TypeError: ``scaling`` not a RopeScaling.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    inv_freq: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        *,
        interleaved: bool = False,
        rotary_dim: int | None = None,
        max_positions: int = 4096,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        check_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE (it rotates pairs), got {head_dim}")
        rotary_dim = head_dim if rotary_dim is None else check_int("rotary_dim", rotary_dim)
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be even and <= head_dim={head_dim}, got {rotary_dim}")
        self.base = check_float("base", base, low=0.0, high=float("inf"), low_inclusive=False, high_inclusive=False)
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.interleaved = bool(interleaved)
        self.max_positions = check_int("max_positions", max_positions, maximum=1 << 24)
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise TypeError(f"scaling must be a multihead.RopeScaling or None, got {type(scaling).__name__}")
        self.scaling = scaling
        self.attention_factor = rope_frequencies(rotary_dim, self.base, scaling)[1]
        for name, table in self._tables().items():  # on the default device (meta under torch.device("meta"))
            self.register_buffer(name, table, persistent=False)  # inv_freq (R/2,); cos, sin (P, R/2)

    #: The buffers computed from the settings: none is in the state dict.
    DERIVED: tuple[str, ...] = ("inv_freq", "cos", "sin")

    def _tables(self) -> dict[str, torch.Tensor]:
        """The :data:`DERIVED` buffers, computed anew: inv_freq (R/2,), cos and sin (P, R/2), float32.
        Same float32 formulas as Hugging Face's rope init functions, so the tables match bitwise."""
        inv_freq = rope_frequencies(self.rotary_dim, self.base, self.scaling)[0]
        angles = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq  # (P, R/2)
        return {"inv_freq": inv_freq, "cos": self._scaled(angles.cos()), "sin": self._scaled(angles.sin())}

    @classmethod
    def from_facts(
        cls,
        head_dim: int,
        base: float,
        *,
        interleaved: bool = False,
        rotary_dim: int | None = None,
        max_positions: int | None = None,
        scaling: RopeScaling | None = None,
    ) -> RoPE:
        """The RoPE a model's facts describe (a config, a converted module), its table sized by rule.

        The one rule for the table length: ``min(max_positions or ROPE_TABLE_POSITIONS,
        ROPE_TABLE_POSITIONS)`` rows, i.e. the trained context length, capped at
        :data:`ROPE_TABLE_POSITIONS`; positions past the table give the same numbers.

        Args:
            head_dim: D.
            base: the frequency base (``rope_theta``).
            interleaved: pairing; False = rotate-half (HF), True = interleaved (Meta/GPT-J).
            rotary_dim: R (default all of D).
            max_positions: the model's trained context length, or None when it is not known.
            scaling: a :class:`~multihead.rope_scaling.RopeScaling`, or None for plain RoPE.

        Raises:
            ValueError, TypeError: as :class:`RoPE`, and ``max_positions`` not an int >= 1.
        """
        if max_positions is not None:
            check_int("max_positions", max_positions, maximum=sys.maxsize)
        positions = min(max_positions or ROPE_TABLE_POSITIONS, ROPE_TABLE_POSITIONS)
        return cls(head_dim, base, interleaved=interleaved, rotary_dim=rotary_dim, max_positions=positions,
                   scaling=scaling)

    def _scaled(self, t: torch.Tensor) -> torch.Tensor:
        """cos or sin times the attention factor (yarn, longrope), as transformers applies it."""
        return t if self.attention_factor == 1.0 else t * self.attention_factor

    @property
    def table_limit(self) -> int:
        """Lengths up to which the precomputed table holds: ``max_positions``, or less where
        the frequencies change with the length (dynamic past M, longrope past M_orig)."""
        s = self.scaling
        if s is None or not s.length_dependent:
            return self.max_positions
        edge = s.max_positions if s.rope_type == "dynamic" else s.original_max_positions
        if edge is None:  # RopeScaling refuses a length-dependent type without its edge
            raise ValueError(f"rope_type={s.rope_type!r} needs its length edge, got None")
        return min(self.max_positions, edge)

    def inv_freq_for(self, length: int) -> torch.Tensor:
        """(R/2,) float32 inverse frequencies for a call covering positions < ``length``."""
        if self.scaling is None or not self.scaling.length_dependent:
            return self.inv_freq
        return rope_frequencies(self.rotary_dim, self.base, self.scaling, seq_len=length)[0].to(self.inv_freq.device)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # ``layer.half()`` / ``.to(torch.bfloat16)`` convert every float buffer; the tables
        # must stay float32 (rounding them to bf16 shifts angles), so only their device moves.
        # Tables on the meta device (a model built under torch.device("meta")) have no values to
        # move: given memory (``to_empty``), they are computed again, as no state dict holds them.
        tables = {name: self._buffers[name] for name in self.DERIVED}
        super()._apply(fn, recurse)
        if any(t.is_meta for t in tables.values()) and not self._buffers[self.DERIVED[0]].is_meta:
            with torch.device("cpu"):
                tables = self._tables()
        for name, table in tables.items():
            self._buffers[name] = table.to(device=self._buffers[name].device)
        return self

    @property
    def pairing(self) -> str:
        """``"interleaved"`` or ``"half"``."""
        return "interleaved" if self.interleaved else "half"

    def extra_repr(self) -> str:
        scaled = "" if self.scaling is None else f", rope_type={self.scaling.rope_type!r}"
        return (f"head_dim={self.head_dim}, base={self.base}, pairing={self.pairing!r}, "
                f"rotary_dim={self.rotary_dim}{scaled}")

    def tables(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32, *,
               bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin shaped like ``positions`` + (R/2,): float32, or float64 for ``dtype=float64``.

        float32 is Hugging Face's table, bit for bit. A float32 angle is off by about
        ``position · 1e-7``, so float64 inputs get angles computed in float64: a float64
        layer then matches the float64 reference to rounding, not to float32's ~1e-8.

        Args:
            positions: integer positions, any shape.
            dtype: the dtype of the tensor to rotate.
            bound: a known upper bound (exclusive) of ``positions``, all >= 0; when given
                nothing is read back from the device to choose the table or the formula.
        """
        # meta: shapes only; compiled: a read-back would break the graph (tables are then read by formula).
        if (bound is None and positions.numel() and positions.device.type != "meta"
                and not torch.compiler.is_compiling()):
            low, high = torch.aminmax(positions)
            bound = int(high) + 1 if int(low) >= 0 else None  # one read back, only for caller-given positions
        if self.scaling is not None and self.scaling.length_dependent and bound is None:
            raise ValueError("positions must be >= 0 for a length-dependent RoPE scaling "
                             f"({self.scaling.rope_type!r}: its frequencies depend on the largest position)")
        if dtype == torch.float64:
            if self.scaling is None:
                exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64, device=positions.device)
                inv_freq = 1.0 / (self.base ** (exponents / self.rotary_dim))  # (R/2,)
            else:  # the scaled frequencies are defined in float32; only the angles widen
                # bound is None only for a length-independent scaling (refused above otherwise)
                inv_freq = self.inv_freq_for(bound or 0).to(device=positions.device, dtype=torch.float64)
            angles = positions.to(torch.float64)[..., None] * inv_freq
            return self._scaled(angles.cos()), self._scaled(angles.sin())
        if bound is not None and bound <= self.table_limit:
            return self.cos[positions], self.sin[positions]
        angles = positions.to(torch.float32)[..., None] * self.inv_freq_for(bound or 0)
        return self._scaled(angles.cos()), self._scaled(angles.sin())

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x``.

        Args:
            x: (B, H, S, D) queries or keys, split into heads.
            positions: (S,) or (B, S) integer positions; default 0 .. S-1.

        Returns:
            (B, H, S, D), same dtype as ``x`` (the rotation is computed in float32 or wider,
            float64 tables for float64 ``x``).
        """
        check_tensor("x", x, ndim=4)
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"x must have head dim {self.head_dim} in [B, H, S, D], got shape {list(x.shape)}")
        return self.rotate((x,), positions)[0]

    def rotate(self, tensors: tuple[torch.Tensor, ...], positions: torch.Tensor | None = None, *,
               bound: int | None = None) -> tuple[torch.Tensor, ...]:
        """Rotate several tensors (q and k) at the same positions, with one table lookup.

        Args:
            tensors: each (B, H, S, D), same B, S and dtype (H may differ: GQA).
            positions: (S,) or (B, S); default 0 .. S-1.
            bound: known exclusive upper bound of ``positions`` (see :meth:`tables`).

        Returns:
            the rotated tensors, in order.
        """
        for i, t in enumerate(tensors):
            check_tensor(f"tensors[{i}]", t, ndim=4)
            if t.shape[-1] != self.head_dim:
                raise ValueError(f"tensors[{i}] must have head dim {self.head_dim} in [B, H, S, D], "
                                 f"got shape {list(t.shape)}")
        x = tensors[0]
        b, _, s, _ = x.shape
        if positions is None:
            positions, bound = torch.arange(s, device=x.device), s
        else:
            positions = check_positions(positions, b, s)
        cos, sin = self.tables(positions, x.dtype, bound=bound)  # (S, R/2) or (B, S, R/2)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, S, R/2)
        return tuple(apply_rotary(t, cos, sin, interleaved=self.interleaved) for t in tensors)


def check_positions(positions: object, batch: int, seq: int) -> torch.Tensor:
    """Positions must be an integer tensor of shape (S,) or (B, S)."""
    positions = check_tensor("positions", positions, ndim=(1, 2))
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"positions must be an integer tensor, got dtype {positions.dtype}")
    if positions.shape[-1] != seq or (positions.dim() == 2 and positions.shape[0] not in (1, batch)):
        raise ValueError(f"positions must have shape [S] = [{seq}] or [B, S] = [{batch}, {seq}], "
                         f"got {list(positions.shape)}")
    return positions


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """Rotate the first R = 2·cos.shape[-1] dims of x's last axis by (cos, sin).

    Args:
        x: (..., S, D).
        cos, sin: broadcastable to (..., S, R/2), float32.
    """
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    work = torch.promote_types(x.dtype, torch.float32)
    rot = rot.to(work)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]  # (..., S, R/2) each
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    cos, sin = cos.to(work), sin.to(work)
    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin
    if interleaved:
        y = torch.stack((y1, y2), dim=-1).flatten(-2)  # (..., S, R): pairs back side by side
    else:
        y = torch.cat((y1, y2), dim=-1)
    y = y.to(x.dtype)
    return y if rest.shape[-1] == 0 else torch.cat((y, rest), dim=-1)


def interleaved_to_half(weight: torch.Tensor, num_heads: int, rotary_dim: int | None = None) -> torch.Tensor:
    """Permute q or k projection rows from the interleaved pairing to rotate-half.

    A layer with interleaved RoPE and weight ``W`` computes the same attention as a layer
    with rotate-half RoPE and ``interleaved_to_half(W)`` (for both q_proj and k_proj).
    This is the permutation of Hugging Face's Llama conversion script.

    Args:
        weight: (H·D, E) weight or (H·D,) bias, rows grouped by head.
        num_heads: H.
        rotary_dim: R (default D); rows R..D-1 of each head stay in place.

    Returns:
        a new tensor of the same shape.
    """
    return _permute_pairs(weight, num_heads, rotary_dim, to_half=True)


def half_to_interleaved(weight: torch.Tensor, num_heads: int, rotary_dim: int | None = None) -> torch.Tensor:
    """Inverse of :func:`interleaved_to_half`."""
    return _permute_pairs(weight, num_heads, rotary_dim, to_half=False)


def _permute_pairs(weight: torch.Tensor, num_heads: int, rotary_dim: int | None, *, to_half: bool) -> torch.Tensor:
    check_tensor("weight", weight, ndim=(1, 2))
    check_int("num_heads", num_heads)
    rows = weight.shape[0]
    if rows % num_heads:
        raise ValueError(f"weight must have a multiple of num_heads={num_heads} rows, got {rows}")
    d = rows // num_heads
    r = d if rotary_dim is None else check_int("rotary_dim", rotary_dim)
    if r % 2 or r > d:
        raise ValueError(f"rotary_dim must be even and <= head dim {d}, got {r}")
    w = weight.reshape(num_heads, d, *weight.shape[1:])  # (H, D, ...)
    rot, rest = w[:, :r], w[:, r:]
    tail = rot.shape[2:]
    if to_half:
        rot = rot.reshape(num_heads, r // 2, 2, *tail).transpose(1, 2)  # (H, 2, R/2, ...)
    else:
        rot = rot.reshape(num_heads, 2, r // 2, *tail).transpose(1, 2)  # (H, R/2, 2, ...)
    rot = rot.reshape(num_heads, r, *tail)
    return torch.cat((rot, rest), dim=1).reshape(weight.shape).contiguous()
