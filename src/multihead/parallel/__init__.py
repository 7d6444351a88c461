"""multihead across processes: heads and sequences sharded over ``torch.distributed``.

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads, D head_dim,
P ranks in the group.

Everything takes a ``ProcessGroup`` or a 1-D ``DeviceMesh`` (None = the default group)
from the caller; multihead never calls ``init_process_group``. The same code runs with
gloo on CPUs, NCCL on GPUs, one machine or many (torchrun).

* Head (tensor) parallelism: :func:`shard_heads` (Megatron's split of heads, one
  all-reduce after ``o_proj``), or torch's ``parallelize_module`` with
  :func:`tensor_parallel_plan`.
* Context (sequence) parallelism: :func:`ring_attention` (K/V around a ring, log-sum-exp
  merge, any mask) and :func:`ulysses_attention` (all-to-all between sequence and head
  sharding); :func:`shard_sequence` / :func:`unshard_sequence` cut and gather in the
  "contiguous", "zigzag" or "striped" layout; :func:`context_parallel` wraps a layer, with
  a sequence-sharded KV cache for decoding.

Refusals (sizes that cannot shard, shapes that differ across ranks) are raised on every
rank with the same message, before any data moves: never a hang, never a silent error.
"""

from .heads import HeadParallelAttention, shard_heads, tensor_parallel_plan
from .layout import LAYOUTS, shard_positions, shard_sequence, shard_sizes, unshard_sequence
from .ring import RingWork, ring_attention, ring_work
from .ulysses import ulysses_attention
from .context import ContextParallelAttention, ShardedKVCache, context_parallel

__all__ = [
    "shard_heads",
    "HeadParallelAttention",
    "tensor_parallel_plan",
    "ring_attention",
    "ring_work",
    "RingWork",
    "ulysses_attention",
    "shard_sequence",
    "unshard_sequence",
    "shard_positions",
    "shard_sizes",
    "LAYOUTS",
    "context_parallel",
    "ContextParallelAttention",
    "ShardedKVCache",
]
