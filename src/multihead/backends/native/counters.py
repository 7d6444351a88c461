"""A KV cache's counters after one token per row, in one C call (the writer
:meth:`multihead.KVCache.commit` calls). Never builds the library: before it is loaded, the
caller writes the counters with torch operations. Nothing happens at import time.

Notation: B batch (rows), C cache capacity.
"""

from __future__ import annotations

import torch

from . import loader, ops

__all__ = ["advance_counters"]


def advance_counters(lengths: torch.Tensor, slot_pos: torch.Tensor) -> bool:
    """A cache's counters after one token per row, in one C call: ``slot_pos[b, L_b] = L_b``, then
    ``lengths[b] = L_b + 1`` for every row b (``L_b = lengths[b]``), as
    :meth:`multihead.KVCache.commit` (which calls this) would with two torch
    operations, whose dispatch, with the caches cold after a decoding step's kernel, costs about
    4× this call (110 vs 25 µs measured, the commit alone).

    Args:
        lengths: (B,) int64; slot_pos: (B, C) int64, unit stride along C; CPU.

    Returns:
        True when written; False (nothing written, the caller writes) where the library is not
        loaded yet (this never builds it), or a tracer, a dispatch mode or the profiler must
        see the writes (:func:`.ops.direct`), or the tensors are not plain int64 CPU tensors of
        that layout.

    Raises:
        ValueError: a row's length is outside [0, C) (nothing is written).
    """
    fn = loader.counter_writer
    if fn is None or not ops.direct(lengths, slot_pos):
        return False
    if not (lengths.is_cpu and slot_pos.is_cpu and lengths.dtype == slot_pos.dtype == torch.int64
            and lengths.dim() == 1 and slot_pos.dim() == 2 and lengths.shape[0] == slot_pos.shape[0]
            and lengths.stride(0) == 1 and slot_pos.stride(1) == 1):
        return False
    if fn(lengths.data_ptr(), slot_pos.data_ptr(), slot_pos.shape[0], slot_pos.stride(0), slot_pos.shape[1]) != 0:
        raise ValueError(f"lengths must lie in [0, {slot_pos.shape[1]}) (the cache's capacity) to advance, "
                         f"got {lengths.tolist()}")
    return True
