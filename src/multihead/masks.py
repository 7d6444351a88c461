"""Attention masks, in one polarity: ``True`` = may attend.

Notation: B batch, H query heads, Sq queries, Sk keys.

This is the convention of ``torch.nn.functional.scaled_dot_product_attention``.
``torch.nn.MultiheadAttention`` uses the OPPOSITE one (``True`` = ignore) for both
``attn_mask`` and ``key_padding_mask``; convert such masks with :func:`from_torch_mha`.
Hugging Face's 2-D ``attention_mask`` (1 = real token, 0 = padding) is already in our
polarity once cast to bool; pass it as ``key_mask``.

Causal masks are aligned **bottom-right**: the last query sees the last key, which is
what decoding with a cache needs. With Sq=2, Sk=5 (``1`` = may attend)::

    1 1 1 1 0
    1 1 1 1 1

``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` aligns top-left
instead (the first query sees the first key); the two agree when Sq == Sk.

A query row with no allowed key outputs zeros (never NaN) on every path of multihead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_int, check_tensor
from ._memo import derived

__all__ = [
    "Structure",
    "causal_mask",
    "sliding_window_mask",
    "key_padding_mask",
    "from_torch_mha",
    "full_mask",
    "from_additive",
    "to_additive",
    "segment_mask",
    "check_cu_seqlens",
    "segment_bounds",
    "packed_cu_seqlens",
    "packed_bounds",
    "cu_seqlens_from_positions",
    "segments_from_positions",
]


@dataclass(frozen=True)
class Structure:
    """The one structural rule: which key positions a query position may see.

    With ``rel = key_position - query_position``, a key is visible when

    * ``causal``: ``rel <= 0`` (no future key);
    * ``window`` (w): ``rel > -w`` (the ``w - 1`` keys before it, and itself), and,
      without ``causal``, also ``rel < w`` (symmetric);

    and always when neither is set. Every path derives its masking from this class: the
    dense mask (:meth:`dense`, :meth:`allows` on explicit positions, as a KV cache
    has them), the per-row span (:meth:`span`) and a block's key range
    (:meth:`key_range`); the C++ kernels mirror :meth:`span` in ``common.h``'s
    ``span()``, the only other copy. Positions are absolute; a problem with Sq queries
    and Sk keys aligns them **bottom-right** (query i sits at ``i + Sk - Sq``).
    """

    causal: bool = False
    window: int | None = None

    @property
    def trivial(self) -> bool:
        """True when every key is visible (no causal, no window)."""
        return not self.causal and self.window is None

    def allows(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool, broadcast of ``q_pos`` and ``k_pos``: key at k_pos visible from q_pos.

        Args:
            q_pos: query positions, e.g. (Sq, 1) or (B, Sn, 1).
            k_pos: key positions, e.g. (1, Sk) or (B, 1, Sk).
        """
        rel = k_pos - q_pos
        ok = rel <= 0 if self.causal else torch.ones_like(rel, dtype=torch.bool)
        if self.window is not None:
            ok = ok & (rel > -self.window)
            if not self.causal:
                ok = ok & (rel < self.window)
        return ok

    def span(self, q_pos: int, sk: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` of ``0 .. sk-1`` visible from query position ``q_pos`` (may be empty)."""
        lo, hi = 0, sk
        if self.causal:
            hi = min(hi, q_pos + 1)
        if self.window is not None:
            lo = max(lo, q_pos - self.window + 1)
            if not self.causal:
                hi = min(hi, q_pos + self.window)
        return lo, max(lo, hi)

    def key_range(self, p0: int, p1: int, sk: int) -> tuple[int, int]:
        """The hull ``[lo, hi)`` of the spans of query positions ``p0 .. p1-1`` (empty: lo == hi)."""
        lo, _ = self.span(p0, sk)
        _, hi = self.span(p1 - 1, sk)
        return (lo, hi) if hi > lo else (lo, lo)

    def dense(self, sq: int, sk: int, device: torch.device | str | None = None) -> torch.Tensor:
        """(Sq, Sk) bool, bottom-right aligned: query i at position ``i + sk - sq``."""
        rows = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)  # (Sq, 1)
        cols = torch.arange(sk, device=device).unsqueeze(0)  # (1, Sk)
        return self.allows(rows, cols)  # (Sq, Sk)


def causal_mask(sq: int, sk: int | None = None, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Bottom-right aligned causal mask.

    Args:
        sq: number of queries.
        sk: number of keys (default ``sq``); query i sits at position ``i + sk - sq``.
        device: where to build it.

    Returns:
        bool (Sq, Sk), True where key j <= the query's position.
    """
    sk = sq if sk is None else sk
    check_int("sq", sq)
    check_int("sk", sk)
    return Structure(causal=True).dense(sq, sk, device)


def sliding_window_mask(
    sq: int, sk: int | None = None, *, window: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Causal sliding-window mask (Mistral's convention), bottom-right aligned.

    Each query attends to itself and the ``window - 1`` keys before it.

    Returns:
        bool (Sq, Sk).
    """
    sk = sq if sk is None else sk
    check_int("sq", sq)
    check_int("sk", sk)
    check_int("window", window)
    return Structure(causal=True, window=window).dense(sq, sk, device)


def key_padding_mask(key_mask: torch.Tensor) -> torch.Tensor:
    """Turn a (B, Sk) key mask (True = real token) into a (B, 1, 1, Sk) attention mask."""
    check_tensor("key_mask", key_mask, ndim=2)
    if key_mask.dtype != torch.bool:
        raise TypeError(f"key_mask must be a bool tensor (True = real token), got dtype {key_mask.dtype}")
    return key_mask[:, None, None, :]  # (B, 1, 1, Sk)


def from_torch_mha(mask: torch.Tensor) -> torch.Tensor:
    """Convert a ``torch.nn.MultiheadAttention`` mask to multihead's polarity.

    ``nn.MultiheadAttention`` reads a bool mask as True = *ignore*, and a float mask as
    an additive bias where ``-inf`` blocks a position.

    Returns:
        bool tensor of the same shape, True = may attend.

    Raises:
        ValueError: a float mask holds finite non-zero values (a bias, not a mask).
    """
    check_tensor("mask", mask)
    if mask.dtype == torch.bool:
        return ~mask
    return from_additive(mask)


def from_additive(mask: torch.Tensor) -> torch.Tensor:
    """Convert an additive float mask (0 = attend, -inf or a huge negative = block) to bool.

    Values at or below half of the dtype's lowest finite number count as blocked, which
    covers both ``-inf`` and Hugging Face's ``torch.finfo(dtype).min``.

    Raises:
        TypeError: ``mask`` is not floating point.
        ValueError: it contains values that are neither 0 nor blocking, i.e. a real
            bias such as ALiBi that a boolean mask cannot express.
    """
    check_tensor("mask", mask)
    if not mask.is_floating_point():
        raise TypeError(f"mask must be a floating-point additive mask, got dtype {mask.dtype}")
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    if bool(((mask != 0) & ~blocked).any()):
        raise ValueError(
            "mask holds finite non-zero values: it is an additive bias, not a mask; "
            "only 0 (attend) and -inf/finfo.min (blocked) convert to a bool mask"
        )
    return ~blocked


def to_additive(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Convert a bool mask (True = may attend) to an additive one (0 or -inf)."""
    check_tensor("mask", mask)
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill(~mask, float("-inf"))


def full_mask(
    mask: torch.Tensor | None,
    causal: bool,
    window: int | None,
    sq: int,
    sk: int,
    device: torch.device | str | None,
) -> torch.Tensor | None:
    """The caller's mask and-ed with the :class:`Structure` (bottom-right aligned).

    Args:
        mask: bool broadcastable to (B, H, Sq, Sk), True = may attend, or None.
        causal, window: the structure.

    Returns:
        bool mask broadcastable to (B, H, Sq, Sk), or None when nothing is masked.
    """
    structure = Structure(causal, window)
    if structure.trivial:
        return mask
    dense = structure.dense(sq, sk, device)  # (Sq, Sk)
    return dense if mask is None else mask & dense


def check_cu_seqlens(cu_seqlens: object, seq: int, batch: int | None = None) -> torch.Tensor:
    """``cu_seqlens`` checked: (N+1,) or (B, N+1) integer cumulative lengths rising from 0 to ``seq``.

    Args:
        batch: B, when known: a 2-D ``cu_seqlens`` must then have 1 or B rows.

    Raises:
        TypeError: not an integer tensor.
        ValueError: not 1-D or 2-D, not 1 or B rows, not starting at 0, decreasing, or not
            ending at S (one read back to the host to check).
    """
    cu = check_tensor("cu_seqlens", cu_seqlens, ndim=(1, 2))
    if batch is not None and cu.dim() == 2 and cu.shape[0] not in (1, batch):
        raise ValueError(f"cu_seqlens must be (N+1,) or (B={batch}, N+1), got {list(cu.shape)}")
    if cu.dtype.is_floating_point or cu.dtype == torch.bool or cu.is_complex():
        raise TypeError(f"cu_seqlens must be an integer tensor, got dtype {cu.dtype}")
    for values in (cu.tolist() if cu.dim() == 2 else [cu.tolist()]):
        if not values or values[0] != 0 or values[-1] != seq or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to S={seq} (cumulative lengths), got {values[:8]}"
                             f"{'...' if len(values) > 8 else ''}")
    return cu


def _segment_ids(cu: torch.Tensor, seq: int) -> torch.Tensor:
    """(B|1, S): the sequence of each token (the last of equal bounds: empty ones hold none)."""
    rows = cu if cu.dim() == 2 else cu[None]  # (B|1, N+1)
    tokens = torch.arange(seq, device=cu.device).expand(rows.shape[0], seq).contiguous()
    return torch.searchsorted(rows[:, 1:].contiguous(), tokens, right=True)


def segment_mask(cu_seqlens: object, seq: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(B|1, 1, S, S) bool: token t may attend to token u only inside its own packed sequence.

    Args:
        cu_seqlens: (N+1,) integer cumulative lengths ``0 = c_0 <= c_1 <= ... <= c_N = S``
            (flash-attn's varlen layout); sequence n holds tokens ``c_n .. c_{n+1} - 1``; or
            (B, N+1), one packing per batch row.
        seq: S.

    Raises:
        TypeError, ValueError: see :func:`check_cu_seqlens`.
    """
    cu = check_cu_seqlens(cu_seqlens, seq)
    ids = _segment_ids(cu, seq)  # (B|1, S): each token's sequence
    same = ids[:, :, None] == ids[:, None, :]  # (B|1, S, S)
    return same[:, None].to(device if device is not None else cu.device)


def segment_bounds(cu_seqlens: torch.Tensor, seq: int) -> torch.Tensor:
    """(B|1, 2, S) int64: ``[start, end)`` of the packed sequence holding each token (the
    native kernel's form of ``cu_seqlens``, checked by :func:`check_cu_seqlens` first)."""
    rows = (cu_seqlens if cu_seqlens.dim() == 2 else cu_seqlens[None]).long()  # (B|1, N+1)
    ids = _segment_ids(rows, seq)  # (B|1, S)
    return torch.stack((rows.gather(1, ids), rows.gather(1, ids + 1)), dim=1).contiguous()


#: Up to this many tokens, the cumulative lengths of a CPU tensor's packed positions are worked
#: out on the host: a few µs of Python where the torch path's half-dozen calls cost more (a padded
#: batch of 46 tokens: 38 µs -> 18 µs).
HOST_BOUNDS_MAX = 1024


def cu_seqlens_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """(B, S+1) int64 cumulative lengths of the packed sequences of (B, S) or (S,) positions
    restarting where a sequence begins (as :func:`segments_from_positions`), each row padded
    with empty sequences at S; no read back to the host except for CPU tensors of at most
    :data:`HOST_BOUNDS_MAX` tokens (worked out there: fewer torch calls)."""
    pos = positions if positions.dim() == 2 else positions[None]  # (B, S)
    b, s = pos.shape
    if pos.device.type == "cpu" and s <= HOST_BOUNDS_MAX and not torch.compiler.is_compiling():
        rows = []
        for row in pos.tolist():
            begins = [i for i in range(s) if i == 0 or row[i] != row[i - 1] + 1]
            rows.append(begins + [s] * (s + 1 - len(begins)))
        return torch.tensor(rows, dtype=torch.int64)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    index = torch.arange(s, device=pos.device).expand(b, s)
    firsts = torch.where(starts, index, s).sort(dim=1).values  # (B, S): each row's starts, then S
    return torch.cat((firsts, torch.full((b, 1), s, dtype=firsts.dtype, device=pos.device)), dim=1)


def packed_cu_seqlens(positions: torch.Tensor) -> torch.Tensor:
    """:func:`cu_seqlens_from_positions`, made once per positions tensor while it is unchanged
    (:func:`multihead._memo.derived`): every layer of a packed model call reads the same one."""
    return derived(positions, "cu_seqlens", cu_seqlens_from_positions)


def packed_bounds(cu_seqlens: object, seq: int, batch: int | None = None) -> torch.Tensor:
    """:func:`segment_bounds` (B|1, 2, S), after :func:`check_cu_seqlens` where ``batch`` is
    given, each made once per ``cu_seqlens`` tensor while it is unchanged: the native kernel's
    packed sequences, read back to the host and checked once per model call, not once per layer.

    Raises:
        TypeError, ValueError: see :func:`check_cu_seqlens`.
    """
    cu = check_tensor("cu_seqlens", cu_seqlens)
    if batch is not None:
        derived(cu, ("checked", seq, batch), lambda c: check_cu_seqlens(c, seq, batch=batch))
    return derived(cu, ("bounds", seq), lambda c: segment_bounds(c, seq))


def segments_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S) bool from (B, S) or (S,) positions that restart where a packed sequence begins.

    A token starts a new sequence where its position is not the previous one's plus one
    (Hugging Face packs sequences without padding this way, each from position 0).
    """
    pos = positions if positions.dim() == 2 else positions[None]  # (B, S)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    ids = starts.long().cumsum(dim=1)  # (B, S): sequence number of each token
    return (ids[:, :, None] == ids[:, None, :])[:, None]  # (B, 1, S, S)
