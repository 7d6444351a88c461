"""All-to-all context parallelism (DeepSpeed-Ulysses): trade sequence shards for head shards.

Notation: B batch, H query heads, Hkv key/value heads, S tokens, P ranks, S_r tokens of
rank r, D head dim (Dv values).

    q (B, H, S_r, D) on each rank
      -> all_to_all    (B, H/P, S, D): this rank's heads, every token
      -> attention     the plain single-process core, full sequence, global positions
      -> all_to_all    (B, H, S_r, Dv): back to this rank's tokens

The attention itself is :func:`multihead.attention` on the same numbers as one process
(tokens are put back in position order first), so the result equals it to rounding of
the same operations. K/V heads: split when ``Hkv % P == 0``; when ``P % Hkv == 0`` each
rank receives the one K/V head its query heads read (sent by every rank, no K/V head
ever split). Anything else is refused, as is H not divisible by P. The key mask (B, S_r)
is all-gathered (a bool per token).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..functional import attention
from ..masks import key_padding_mask
from ._comm import agree, resolve_group, world_and_rank
from .layout import shard_positions
from .ring import _check_local, _check_table

__all__ = ["ulysses_attention", "check_ulysses_heads"]


def check_ulysses_heads(num_heads: int, num_kv_heads: int, world_size: int) -> None:
    """Raise ``ValueError`` unless H and Hkv can be scattered over ``world_size`` ranks."""
    if num_heads % world_size:
        raise ValueError(f"ulysses_attention needs the number of query heads ({num_heads}) divisible by the "
                         f"world size ({world_size}); use ring_attention, which has no such limit")
    if num_kv_heads % world_size and world_size % num_kv_heads:
        raise ValueError(f"ulysses_attention needs the number of K/V heads ({num_kv_heads}) to divide or be "
                         f"divisible by the world size ({world_size}), so no query group straddles ranks; "
                         "use ring_attention, which has no such limit")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: object = None,
                      causal: bool = False, window: int | None = None, key_mask: torch.Tensor | None = None,
                      scale: float | None = None, layout: str = "contiguous") -> torch.Tensor:
    """Attention over a sequence sharded across ``group``, by all-to-all (DeepSpeed-Ulysses).

    Same shard convention and result as :func:`ring_attention`. Differentiable.

    Args:
        q: (B, H, S_r, D); k, v: (B, Hkv, S_r, D), (B, Hkv, S_r, Dv), this rank's tokens in
            ``layout`` order.
        group, causal, window, key_mask, scale, layout: as for :func:`ring_attention`.

    Returns:
        (B, H, S_r, Dv), this rank's shard of the output.

    Raises:
        ValueError: H not divisible by P, Hkv neither divisible by P nor dividing it (both
            decided before any communication, on every rank alike); and every refusal of
            :func:`ring_attention`.
        NotImplementedError: the group's backend has no all-to-all (never emulated).
    """
    g = resolve_group(group)
    p, _ = world_and_rank(g)
    error, meta = _check_local(q, k, v, key_mask, causal, window, scale, layout)
    if error is None:
        check_ulysses_heads(q.shape[1], k.shape[1], p)
    if p == 1:
        if error is not None:
            raise ValueError(error)
        mask = None if key_mask is None else key_padding_mask(key_mask)
        return attention(q, k, v, causal=causal, window=window, mask=mask, scale=scale)
    table = agree(g, meta, error, lambda t: _check_table(t, layout))
    sizes = [row[-1] for row in table]
    seq_len = sum(sizes)
    order = torch.cat([shard_positions(seq_len, p, r, layout) for r in range(p)]).to(q.device)  # rank order -> pos
    natural = torch.argsort(order)  # position -> index in rank order
    kv_index = _kv_heads_to_send(q.shape[1], k.shape[1], p, k.device)
    if kv_index is not None:  # P % Hkv == 0: rank j gets the K/V head its query heads read
        k, v = k.index_select(1, kv_index), v.index_select(1, kv_index)  # (B, P, S_r, D)
    qs, ks, vs = (_SeqToHeads.apply(t, sizes, g).index_select(2, natural) for t in (q, k, v))  # (B, h, S, D)
    mask = None
    if key_mask is not None:
        mask = key_padding_mask(_gather_key_mask(key_mask, sizes, g).index_select(1, natural))
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = attention(qs, ks, vs, causal=causal, window=window, mask=mask, scale=sc)  # (B, H/P, S, Dv)
    return _HeadsToSeq.apply(out.index_select(2, order), sizes, g)  # (B, H, S_r, Dv)


def _kv_heads_to_send(h: int, hkv: int, p: int, device: torch.device) -> torch.Tensor | None:
    """For Hkv < P: the K/V head for each destination rank (``j // (P / Hkv)``), else None."""
    if hkv % p == 0:
        return None
    return torch.arange(p, device=device) // (p // hkv)


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> None:
    try:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
    except (RuntimeError, NotImplementedError) as exc:
        if "all_to_all" in str(exc) or "alltoall" in str(exc).lower() or "not supported" in str(exc).lower():
            raise NotImplementedError(
                f"the {dist.get_backend(group)!r} backend has no all_to_all_single, which ulysses_attention "
                "needs; use ring_attention (point-to-point only)") from exc
        raise


def _seq_to_heads(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """(B, Hx, S_r, D) -> (B, Hx/P, S, D) with the tokens in rank order."""
    p = len(sizes)
    b, hx, s, d = x.shape
    h = hx // p
    send = x.reshape(b, p, h, s, d).transpose(0, 1).contiguous()  # (P, B, h, S_r, D): block j to rank j
    recv = x.new_empty(b * h * sum(sizes) * d)
    _all_to_all(recv, send.reshape(-1), [b * h * n * d for n in sizes], [b * h * s * d] * p, group)
    parts = recv.split([b * h * n * d for n in sizes])
    return torch.cat([t.view(b, h, n, d) for t, n in zip(parts, sizes)], dim=2)  # (B, h, S, D)


def _heads_to_seq(y: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """(B, h, S, D) in rank order -> (B, h·P, S_r, D): the inverse of :func:`_seq_to_heads`."""
    p, r = len(sizes), dist.get_rank(group)
    b, h, _, d = y.shape
    s = sizes[r]
    send = torch.cat([t.reshape(-1) for t in y.split(sizes, dim=2)])  # rank i's tokens, in order
    recv = y.new_empty(p * b * h * s * d)
    _all_to_all(recv, send, [b * h * s * d] * p, [b * h * n * d for n in sizes], group)
    return recv.view(p, b, h, s, d).transpose(0, 1).reshape(b, p * h, s, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.sizes, ctx.group = sizes, group
        return _seq_to_heads(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _heads_to_seq(grad.contiguous(), ctx.sizes, ctx.group), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.sizes, ctx.group = sizes, group
        return _heads_to_seq(y, sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _seq_to_heads(grad.contiguous(), ctx.sizes, ctx.group), None, None


def _gather_key_mask(key_mask: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """(B, S_r) bool on each rank -> (B, S) in rank order (one all-gather of bytes)."""
    b, longest = key_mask.shape[0], max(sizes)
    padded = key_mask.new_zeros((b, longest), dtype=torch.uint8)
    padded[:, :key_mask.shape[1]] = key_mask.to(torch.uint8)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([t[:, :n] for t, n in zip(parts, sizes)], dim=1).bool()
