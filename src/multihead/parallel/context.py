"""A layer run context-parallel: each rank holds a shard of the tokens, and a sharded KV cache.

Notation: B batch, S tokens, S_r this rank's tokens, E embed_dim, H query heads, Hkv
key/value heads, D head_dim, P ranks, Sn new tokens of a decoding step, C cache slots
per rank.

    x (B, S_r, E) this rank's tokens (layout order)
      -> layer.project, layer.split  per token: local (QK-norm included)
      -> layer.rotate                RoPE at each token's global position
      -> ring_attention | ulysses_attention   (partial results merged by log-sum-exp)
      -> layer.output                per token: local          -> (B, S_r, E)

Every step but the attention is the layer's own (:meth:`MultiHeadAttention.project`, ...),
and every mask comes from the layer's :attr:`~MultiHeadAttention.structure`; the attention
is the ring's or Ulysses', since it needs each block's log-sum-exp, which
:meth:`MultiHeadAttention.attend` does not return.

Parameters are shared, not sharded: each rank's parameter gradients are its tokens'
share; sum them over the group (what DDP/FSDP over the data × context ranks do).

Decoding with :meth:`ContextParallelAttention.new_cache`: the prompt is prefilled from
every rank's shard (each rank caches its own tokens' K/V: 1/P of the cache). Each new
token is given to every rank (replicated), goes into the cache of the rank holding the
fewest tokens, and its query attends on every rank to that rank's slice; the P partial
(out, lse) merge by log-sum-exp after one all-gather.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .._checks import check_int, check_tensor
from ..functional import attention
from ..masks import key_padding_mask
from ..module import MultiHeadAttention
from ._comm import agree, resolve_group, world_and_rank
from ._lse import block_attention, merge_into, work_dtype
from .layout import _dtype_code, _rows, check_layout, check_sizes, shard_positions
from .ring import _RingAttention, _Spec
from .ulysses import check_ulysses_heads, ulysses_attention

__all__ = ["context_parallel", "ContextParallelAttention", "ShardedKVCache"]

METHODS = ("ring", "ulysses")


class ShardedKVCache:
    """This rank's slice of a sequence's K/V cache (from :meth:`ContextParallelAttention.new_cache`).

    Attributes:
        k, v: (B, Hkv, C, D) buffers, C = ceil(max_len / P) slots.
        positions: (C,) int64 global position of each slot (-1 = empty).
        valid: (B, C) bool, False for padding tokens of the prompt.
        counts: tokens held by every rank (known on every rank without communication).
        length: tokens in the whole sequence so far.
    """

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, world_size: int,
                 rank: int, *, dtype: torch.dtype, device: torch.device) -> None:
        check_int("batch_size", batch_size)
        check_int("max_len", max_len, maximum=1 << 31)
        self.max_len, self.world_size, self.rank = max_len, world_size, rank
        # ceil(max_len / P) is enough: prefill shards hold at most ceil(S/P) tokens in every layout, and
        # each decoded token goes to the rank holding the fewest.
        capacity = -(-max_len // world_size)
        self.k = torch.zeros(batch_size, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.positions = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.counts = [0] * world_size
        self.length = 0
        self.held = 0  # slots of this rank in use

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's K and V buffers (about 1/P of a single-process cache)."""
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        """Forget every token."""
        self.positions.fill_(-1)
        self.valid.zero_()
        self.counts = [0] * self.world_size
        self.length = 0
        self.held = 0

    def _write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Append (B, Hkv, n, D) K/V at global ``positions`` (n,) to this rank's slice."""
        start, n = self.held, k.shape[2]
        self.k[:, :, start:start + n] = k.detach()
        self.v[:, :, start:start + n] = v.detach()
        self.positions[start:start + n] = positions
        self.valid[:, start:start + n] = valid
        self.held += n

    def _owner(self) -> int:
        """The rank that caches the next decoded tokens: the one holding the fewest."""
        return min(range(self.world_size), key=lambda r: (self.counts[r], r))


class ContextParallelAttention(nn.Module):
    """``layer`` run on this rank's shard of the tokens (see :func:`context_parallel`)."""

    def __init__(self, layer: MultiHeadAttention, group: object = None, *, layout: str = "zigzag",
                 method: str = "ring") -> None:
        super().__init__()
        if not isinstance(layer, MultiHeadAttention):
            raise TypeError(f"layer must be a multihead.MultiHeadAttention, got {type(layer).__name__}")
        if not layer.batch_first:  # its x and y are (S, B, E): the shards would read them as (B, S, E)
            raise ValueError("context_parallel takes (B, S, E) inputs; the layer was built batch_first=False (from a "
                             "seq-first nn.MultiheadAttention): transpose x to (B, S, E) and build the layer "
                             "batch_first=True")
        check_layout(layout)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if layer.kdim != layer.embed_dim:
            raise ValueError("context_parallel runs self-attention; the layer attends to a context (kdim != embed_dim)")
        features = [name for name, value in (("softcap", layer.softcap), ("alibi", layer.alibi_slopes),
                                             ("sinks", layer.sinks)) if value is not None]
        if features:
            raise ValueError(f"context_parallel does not run the layer's {', '.join(features)}: the ring, Ulysses "
                             "and sharded-cache attention compute plain softmax(QKᵀ)V")
        self.layer = layer
        self.group = resolve_group(group)
        self.world_size, self.rank = world_and_rank(self.group)
        if method == "ulysses":
            check_ulysses_heads(layer.num_heads, layer.num_kv_heads, self.world_size)
        self.layout, self.method = layout, method

    def new_cache(self, batch_size: int, max_len: int) -> ShardedKVCache:
        """A sequence-sharded KV cache: this rank's ~max_len / P slots (see :class:`ShardedKVCache`)."""
        w = self.layer.q_proj.weight
        return ShardedKVCache(batch_size, max_len, self.layer.num_kv_heads, self.layer.head_dim, self.world_size,
                              self.rank, dtype=w.dtype, device=w.device)

    def forward(self, x: torch.Tensor, *, key_mask: torch.Tensor | None = None,
                cache: ShardedKVCache | None = None) -> torch.Tensor:
        """Run the layer on this rank's tokens, or decode with a sharded cache.

        Args:
            x: (B, S_r, E) this rank's tokens in ``layout`` order (:func:`shard_sequence`);
                with a cache that already holds the prompt, (B, Sn, E) new tokens, the same
                on every rank.
            key_mask: (B, S_r) bool, this rank's shard of the padding mask (True = real
                token); not with decoding steps.
            cache: from :meth:`new_cache`; empty = prefill (x is the prompt's shard).

        Returns:
            (B, S_r, E) this rank's outputs; decoding: (B, Sn, E) on every rank.

        Raises:
            ValueError: on every rank, with one message, before any data moves or any cache
                changes: bad shapes on any rank, shards that are not the layout's, ranks that
                disagree (B, E, dtype, key_mask, prefill or decoding step, the tokens cached, a
                decoding step's Sn: one all-gather of a few int64), dropout in training (no
                dropout across shards).
        """
        layer = self.layer
        if layer.training and layer.dropout > 0:
            raise ValueError("context_parallel does not run attention dropout: call layer.eval() or set "
                             "layer.dropout = 0")
        if layer.watch is not None:
            raise ValueError("multihead.heads.capture and multihead.trace do not record a context-parallel layer "
                             "(its attention runs across ranks, outside the layer's attend step); capture the "
                             "layer itself on one process")
        if self.world_size == 1 and cache is None:
            return layer(x, key_mask=key_mask)  # nothing is sharded: the layer itself
        step = _step_of(cache)
        error = _check_cache(cache, x) or (_check_tokens(x, key_mask, layer) if step != DECODE else
                                           _check_new_tokens(x, key_mask, cache, layer))  # type: ignore[arg-type]
        table = agree(self.group, [0] * (len(_META) + 1) if error else _meta(step, x, key_mask, cache), error,
                      lambda t: _check_same(t, self.layout))
        if step == DECODE:
            return self._decode(x, cache)  # type: ignore[arg-type]
        sizes = [row[-1] for row in table]
        seq_len = sum(sizes)
        positions = shard_positions(seq_len, self.world_size, self.rank, self.layout, x.device)  # (S_r,)
        q, k, v = layer.split(*layer.project(x))  # (B, H, S_r, D), (B, Hkv, S_r, D) ×2
        # At global positions, and the whole prompt's length as the bound on every rank (a
        # length-dependent RoPE scaling then rotates as the single-process layer does).
        q, k = layer.rotate(q, k, positions, bound=seq_len)
        if cache is not None:
            cache._write(k, v, positions, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
                         if key_mask is None else key_mask)
            cache.counts, cache.length = list(sizes), seq_len  # (the prefill wrote held = S_r)
        heads = self._attend(q, k, v, key_mask, sizes)  # (B, H, S_r, D)
        return layer.output(heads)  # (B, S_r, E)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                sizes: list[int]) -> torch.Tensor:
        """The prompt's attention over every rank's shard: (B, H, S_r, D)."""
        layer, structure = self.layer, self.layer.structure
        if self.method == "ulysses":
            return ulysses_attention(q, k, v, group=self.group, causal=structure.causal, window=structure.window,
                                     key_mask=key_mask, scale=layer.scale, layout=self.layout)
        if self.world_size == 1:
            mask = None if key_mask is None else key_padding_mask(key_mask)
            return attention(q, k, v, causal=structure.causal, window=structure.window, mask=mask, scale=layer.scale)
        spec = _Spec(self.group, self.world_size, self.rank, tuple(sizes), self.layout, structure.causal,
                     structure.window, layer.scale)  # the shapes were agreed above: no second exchange
        km = None if key_mask is None else key_mask.to(torch.uint8)
        return _RingAttention.apply(q, k, v, km, spec)

    @torch.no_grad()
    def _decode(self, x: torch.Tensor, cache: ShardedKVCache) -> torch.Tensor:
        """New tokens (B, Sn, E), the same on every rank, against the sharded cache (checked and
        agreed across the ranks by :meth:`forward`)."""
        layer = self.layer
        b, sn, e = x.shape
        positions = cache.length + torch.arange(sn, device=x.device)  # (Sn,)
        q, k, v = layer.split(*layer.project(x))  # (B, H, Sn, D), (B, Hkv, Sn, D) ×2
        q, k = layer.rotate(q, k, positions, bound=cache.length + sn)
        mine = []
        for i in range(sn):  # token by token to the rank holding the fewest (known on every rank)
            owner = cache._owner()
            cache.counts[owner] += 1
            if owner == cache.rank:
                mine.append(i)
        if mine:
            idx = torch.tensor(mine, device=x.device)
            cache._write(k[:, :, idx], v[:, :, idx], positions[idx], torch.ones(b, len(mine), dtype=torch.bool,
                                                                                 device=x.device))
        cache.length += sn
        used = cache.held
        # The layer's own rule on global positions (a non-causal layer's new queries see their
        # chunk's later tokens), and the prompt's padding; every used slot holds a token.
        allowed = layer.structure.allows(positions[:, None], cache.positions[None, :used])  # (Sn, C_used)
        mask = allowed[None, None] & cache.valid[:, None, None, :used]  # (B, 1, Sn, C_used)
        out, lse = block_attention(q, cache.k[:, :, :used], cache.v[:, :, :used], causal=False, window=None,
                                   mask=mask, scale=layer.scale)
        merged = _merge_across(out, lse, self.group, self.world_size)  # (B, H, Sn, D)
        return layer.output(merged.to(x.dtype))  # (B, Sn, E)


def _merge_across(out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup, world_size: int) -> torch.Tensor:
    """Merge every rank's partial (out, lse) by log-sum-exp: one all-gather of both, packed."""
    work = work_dtype(out.dtype)
    packed = torch.cat((out.to(work), lse.to(work).unsqueeze(-1)), dim=-1).contiguous()  # (B, H, Sn, D + 1)
    parts = [torch.empty_like(packed) for _ in range(world_size)]
    dist.all_gather(parts, packed, group=group)
    acc = torch.zeros_like(out, dtype=work)
    acc_lse = torch.full(lse.shape, -math.inf, dtype=work, device=out.device)
    for part in parts:
        merge_into(acc, acc_lse, part[..., :-1], part[..., -1])
    return acc


def _check_tokens(x: object, key_mask: object, layer: MultiHeadAttention) -> str | None:
    """This rank's refusal of its tokens, as a message (raised on every rank by :func:`agree`)."""
    try:
        x = check_tensor("x", x, ndim=3)
        if x.shape[-1] != layer.embed_dim:
            raise ValueError(f"x must have last dim {layer.embed_dim} in [B, S_r, E], got {list(x.shape)}")
        if x.dtype != layer.q_proj.weight.dtype:
            raise TypeError(f"x must have dtype {layer.q_proj.weight.dtype} like the layer, got {x.dtype}")
        if key_mask is not None:
            key_mask = check_tensor("key_mask", key_mask, ndim=2)
            if key_mask.dtype != torch.bool or tuple(key_mask.shape) != tuple(x.shape[:2]):
                raise ValueError(f"key_mask must be bool [B, S_r] = {list(x.shape[:2])}, got "
                                 f"{key_mask.dtype} {list(key_mask.shape)}")
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


#: A call's kind, agreed by the ranks: a prefill without cache, a prefill into an empty cache, a decoding step.
PREFILL, PREFILL_CACHE, DECODE = 0, 1, 2
#: What the ranks agree on before any data moves (the last entry: S_r, or a decoding step's Sn).
_META = ("step (0 prefill, 1 prefill into a cache, 2 decoding)", "B", "E", "dtype", "key_mask",
         "cache max_len", "cached tokens")


def _step_of(cache: ShardedKVCache | None) -> int:
    if cache is None:
        return PREFILL
    return DECODE if isinstance(cache, ShardedKVCache) and cache.length > 0 else PREFILL_CACHE


def _meta(step: int, x: torch.Tensor, key_mask: torch.Tensor | None, cache: ShardedKVCache | None) -> list[int]:
    """This rank's call as the integers every rank compares (:data:`_META`, then S_r or Sn)."""
    held = [0, 0] if cache is None else [cache.max_len, cache.length]
    return [step, x.shape[0], x.shape[2], _dtype_code(x.dtype), int(key_mask is not None), *held, x.shape[1]]


def _check_cache(cache: object, x: object) -> str | None:
    """This rank's refusal of its cache (the type; a prompt's batch against the cache's), as a message."""
    if cache is not None and not isinstance(cache, ShardedKVCache):
        return f"TypeError: cache must come from ContextParallelAttention.new_cache, got {type(cache).__name__}"
    if isinstance(cache, ShardedKVCache) and cache.length == 0 and isinstance(x, torch.Tensor) and x.dim() == 3 \
            and x.shape[0] != cache.k.shape[0]:
        return f"ValueError: cache holds batch {cache.k.shape[0]}; the prompt has batch {x.shape[0]}"
    return None


def _check_new_tokens(x: object, key_mask: object, cache: ShardedKVCache, layer: MultiHeadAttention) -> str | None:
    """This rank's refusal of a decoding step's new tokens (B, Sn, E), as a message."""
    try:
        x = check_tensor("x", x, ndim=3)
        b, sn, e = x.shape
        if (b, e) != (cache.k.shape[0], layer.embed_dim):
            raise ValueError(f"x must have shape [B, Sn, E] = [{cache.k.shape[0]}, Sn, {layer.embed_dim}], "
                             f"got {list(x.shape)}")
        if x.dtype != cache.k.dtype:
            raise TypeError(f"x must have dtype {cache.k.dtype} like the cache, got {x.dtype}")
        if key_mask is not None:
            raise ValueError("key_mask is for the prompt: a decoding step's new tokens are all real")
        if cache.length + sn > cache.max_len:
            raise ValueError(f"cache overflow: {cache.length} tokens cached, {sn} more exceed max_len={cache.max_len}")
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _check_same(table: list[list[int]], layout: str) -> str | None:
    """The refusal every rank derives from every rank's :func:`_meta` (one message on every rank)."""
    head = [row[:-1] for row in table]
    if any(row != head[0] for row in head):
        return f"the ranks disagree on ({', '.join(_META)}): {_rows(head)}"
    step, b, max_len, held = table[0][0], table[0][1], table[0][5], table[0][6]
    sizes = [row[-1] for row in table]
    if step == DECODE:
        if any(n != sizes[0] for n in sizes):
            return (f"the ranks' decoding steps have different numbers of new tokens Sn {sizes}: every rank must "
                    "be given the same new tokens (B, Sn, E)")
        return None
    message = check_sizes(sizes, layout)
    if message is None and step == PREFILL_CACHE and sum(sizes) > max_len:
        message = (f"cache holds {held} tokens of max_len {max_len}; the prompt has batch {b} and {sum(sizes)} "
                   "tokens: prefill an empty cache (cache.reset()) of max_len >= the prompt's length")
    return message


def context_parallel(layer: MultiHeadAttention, group: object = None, *, layout: str = "zigzag",
                     method: str = "ring") -> ContextParallelAttention:
    """Wrap ``layer`` to run on this rank's shard of the sequence (parameters shared, not copied).

    Args:
        layer: a self-attention :class:`multihead.MultiHeadAttention` (any H/Hkv, RoPE,
            causal, window).
        group: ProcessGroup, 1-D DeviceMesh or None (the default group).
        layout: "contiguous", "zigzag" (default) or "striped"; the tokens each rank passes.
        method: "ring" (:func:`ring_attention`, any head counts) or "ulysses"
            (:func:`ulysses_attention`, H and Hkv must split over the ranks).

    Returns:
        a module: ``cp(x_local, key_mask=km_local) -> y_local`` and ``cp.new_cache(B, max_len)``.

    Raises:
        ValueError: bad layout or method; ulysses with heads that cannot split (on every rank).
    """
    return ContextParallelAttention(layer, group, layout=layout, method=method)
