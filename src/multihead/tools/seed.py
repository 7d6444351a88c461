"""The seed's worked example (section 7) in numbers, and the bounds of ``multihead explain``'s
``--seq``: constants the command line reads before it imports torch.
"""

from __future__ import annotations

__all__ = ["SEED_EMBED_DIM", "SEED_NUM_HEADS", "SEED_SEQ_LEN", "SEED_MAX_SEQ_LEN", "MAX_SEQ_LEN", "max_seq_len"]

SEED_EMBED_DIM = 768
SEED_NUM_HEADS = 12
SEED_SEQ_LEN = 1024
#: The most tokens the seed's example runs with. It computes for real, with the float64
#: reference beside it, in O(S²) memory: 4096 tokens take about 3 GB and under a minute.
SEED_MAX_SEQ_LEN = 4096
#: The most tokens a config is explained at (meta tensors: shapes only, nothing computed).
MAX_SEQ_LEN = 1 << 20


def max_seq_len(config: object | None) -> int:
    """The bound on ``seq_len``: :data:`SEED_MAX_SEQ_LEN` for the seed's example (``config``
    None), :data:`MAX_SEQ_LEN` for a config. The one place the command's ``--seq`` is bounded."""
    return SEED_MAX_SEQ_LEN if config is None else MAX_SEQ_LEN
