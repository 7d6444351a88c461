from .layout import LAYOUTS, shard_positions, shard_sequence, shard_sizes, unshard_sequence
from .ring import RingWork, ring_attention, ring_work
