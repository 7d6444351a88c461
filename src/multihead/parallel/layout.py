"""How a sequence is cut into per-rank shards: contiguous, zigzag and striped.

Notation: S tokens of the full sequence, P world size, r rank, B batch.

Shards may be uneven (S need not divide by P or 2P); no token is ever dropped or
padded away, and every rank knows every rank's global positions from (S, P, layout)::

    S = 8, P = 2        positions held by rank 0        rank 1
    contiguous          0 1 2 3                         4 5 6 7
    zigzag (2P chunks)  0 1 | 6 7   (chunks 0 and 3)    2 3 | 4 5   (chunks 1 and 2)
    striped (t mod P)   0 2 4 6                         1 3 5 7

With causal attention a contiguous rank r sees r+1 of the P key shards (rank P-1 does
P times the work of rank 0); zigzag pairs an early chunk with a late one so every rank
does the same work (Megatron's and ring-flash-attention's layout); striped interleaves
tokens (Striped Attention, Brandon et al. 2023).

A *run* is an arithmetic progression of positions ``start, start+stride, ...`` (count
terms) held contiguously in a shard: contiguous shards are one run, zigzag shards two,
striped shards one run of stride P. The ring plans its blocks per pair of runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_int, check_tensor

__all__ = ["LAYOUTS", "Run", "shard_runs", "shard_sizes", "shard_positions", "shard_sequence",
           "unshard_sequence", "check_layout"]

LAYOUTS = ("contiguous", "zigzag", "striped")


@dataclass(frozen=True)
class Run:
    """Positions ``start + stride·i`` for i < count, held at ``offset .. offset+count-1`` of a shard."""

    start: int
    count: int
    stride: int
    offset: int

    @property
    def last(self) -> int:
        return self.start + self.stride * (self.count - 1)

    def positions(self, device: torch.device | str | None = None) -> torch.Tensor:
        return self.start + self.stride * torch.arange(self.count, device=device)


def check_layout(layout: object) -> str:
    """Return ``layout`` if it names a layout, else raise ``ValueError`` listing them."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


def _chunk_bounds(seq_len: int, parts: int) -> list[tuple[int, int]]:
    """(start, count) of ``parts`` near-equal chunks, the first ``seq_len % parts`` one longer."""
    base, extra = divmod(seq_len, parts)
    bounds, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        bounds.append((start, n))
        start += n
    return bounds


def shard_runs(seq_len: int, world_size: int, rank: int, layout: str) -> list[Run]:
    """The runs of positions rank ``rank`` holds, in shard order (empty runs left out)."""
    check_layout(layout)
    if layout == "striped":
        count = len(range(rank, seq_len, world_size))
        return [Run(rank, count, world_size, 0)] if count else []
    if layout == "contiguous":
        chunks = [_chunk_bounds(seq_len, world_size)[rank]]
    else:
        bounds = _chunk_bounds(seq_len, 2 * world_size)
        chunks = [bounds[rank], bounds[2 * world_size - 1 - rank]]
    runs, offset = [], 0
    for start, count in chunks:
        if count:
            runs.append(Run(start, count, 1, offset))
            offset += count
    return runs


def shard_sizes(seq_len: int, world_size: int, layout: str) -> list[int]:
    """Tokens held by each rank."""
    return [sum(run.count for run in shard_runs(seq_len, world_size, r, layout)) for r in range(world_size)]


def shard_positions(seq_len: int, world_size: int, rank: int, layout: str,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """(S_r,) int64 global positions of rank ``rank``'s tokens, in shard order.

    Use them for RoPE (``layer.rope.rotate((q, k), positions)``) on the rank's shard.
    """
    runs = shard_runs(seq_len, world_size, rank, layout)
    if not runs:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.cat([run.positions(device) for run in runs])


def shard_sequence(x: torch.Tensor, *, group: object = None, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full tensor (every rank holds the full ``x``; no communication).

    Args:
        x: the full tensor, with the sequence (length S) along ``dim``, e.g. (B, S, E)
            with ``dim=1`` or (B, H, S, D) with ``dim=2``.
        group: ProcessGroup, 1-D DeviceMesh or None (the default group).
        layout: "contiguous", "zigzag" or "striped".
        dim: the sequence dimension.

    Returns:
        x's tokens at :func:`shard_positions` along ``dim`` (a copy).

    Raises:
        ValueError: S < P (a rank would hold no token), a bad layout or dim. Decided
            from sizes every rank shares, so every rank raises alike.
    """
    from ._comm import resolve_group, world_and_rank

    check_tensor("x", x)
    check_layout(layout)
    dim = _check_dim(dim, x.dim())
    p, r = world_and_rank(resolve_group(group))
    seq_len = x.shape[dim]
    check_shardable(seq_len, p)
    return x.index_select(dim, shard_positions(seq_len, p, r, layout, x.device))


def check_shardable(seq_len: int, world_size: int) -> None:
    """Every rank must hold at least one token."""
    if seq_len < world_size:
        raise ValueError(f"the sequence ({seq_len} tokens) is shorter than the world size ({world_size}): "
                         "every rank must hold at least one token")


def _check_dim(dim: object, ndim: int) -> int:
    check_int("dim", dim, minimum=-ndim, maximum=ndim - 1)
    return int(dim) % ndim  # type: ignore[call-overload]


def unshard_sequence(x_local: torch.Tensor, *, group: object = None, layout: str = "zigzag",
                     dim: int = 1) -> torch.Tensor:
    """Gather every rank's shard back into the full tensor, in position order (on every rank).

    Args:
        x_local: this rank's shard, the sequence along ``dim``; other dims equal on every rank.
        group, layout: as given to :func:`shard_sequence`.
        dim: the sequence dimension.

    Returns:
        the full tensor, S = the sum of the shards' lengths along ``dim``.

    Raises:
        ValueError: on every rank, if the ranks' other dims, dtypes or shard lengths do not
            fit ``layout`` (found by a small metadata exchange before the data moves).
    """
    import torch.distributed as dist

    from ._comm import agree, resolve_group, world_and_rank

    check_tensor("x_local", x_local)
    check_layout(layout)
    dim = _check_dim(dim, x_local.dim())
    g = resolve_group(group)
    p, _ = world_and_rank(g)
    shape = list(x_local.shape)
    meta = [x_local.dim(), dim, _dtype_code(x_local.dtype), *shape[:dim], *shape[dim + 1:], shape[dim]]

    def check(table: list[list[int]]) -> str | None:
        if any(row[:-1] != table[0][:-1] for row in table):
            return f"unshard_sequence: the ranks' shards differ outside dim {dim} or in dtype: " + _rows(table)
        return check_sizes([row[-1] for row in table], layout)

    table = agree(g, meta, None, check)
    sizes = [row[-1] for row in table]
    seq_len = sum(sizes)
    longest = max(sizes)
    pad = list(shape)
    pad[dim] = longest
    padded = x_local.new_zeros(pad)
    padded.narrow(dim, 0, shape[dim]).copy_(x_local)
    gathered = [torch.empty_like(padded) for _ in range(p)]
    dist.all_gather(gathered, padded.contiguous(), group=g)
    pieces = [t.narrow(dim, 0, n) for t, n in zip(gathered, sizes)]
    order = torch.cat([shard_positions(seq_len, p, r, layout) for r in range(p)])  # shard order -> position
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len)
    return torch.cat(pieces, dim=dim).index_select(dim, inverse.to(x_local.device))


def check_sizes(sizes: list[int], layout: str) -> str | None:
    """The message refusing per-rank lengths that are not ``layout``'s shards of their sum."""
    seq_len, p = sum(sizes), len(sizes)
    if seq_len < p or min(sizes) == 0:
        return (f"the sequence ({seq_len} tokens, shards {sizes}) is shorter than the world size ({p}) "
                "or a rank holds no token: every rank must hold at least one")
    expected = shard_sizes(seq_len, p, layout)
    if sizes != expected:
        return (f"the ranks' shard lengths {sizes} are not the {layout!r} layout of {seq_len} tokens "
                f"over {p} ranks, which is {expected} (use multihead.parallel.shard_sequence)")
    return None


_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int64, torch.int32,
           torch.uint8, torch.int8, torch.int16)


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _rows(table: list[list[int]]) -> str:
    return "; ".join(f"rank {r}: {row}" for r, row in enumerate(table))
