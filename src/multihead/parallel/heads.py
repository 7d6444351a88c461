"""Head (tensor) parallelism: each rank owns a slice of the heads (Megatron's split).

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads,
G = H // Hkv, D head_dim, P ranks, r this rank, H_r = H / P heads per rank.

    x (B, S, E), the same on every rank
      -> q_proj, k_proj, v_proj     column-parallel: this rank's heads' rows only
      -> attention                  H_r query heads, their K/V heads (GQA groups kept)
      -> o_proj                     row-parallel: this rank's heads' columns, no bias
      -> all_reduce (sum)           one collective; then o_proj's bias, added once

K/V heads: with ``Hkv % P == 0`` each rank holds Hkv / P of them; with ``P % Hkv == 0``
(Hkv < P, e.g. MQA) each K/V head is replicated on the P / Hkv ranks whose query heads
read it (vLLM's way), and the gradients of the replicas are summed so that every
replica holds the full layer's gradient. Any other split would put a query group across
ranks and is refused.

In the backward, dx is summed over the ranks (one all-reduce: Megatron's "f"), so every
rank's x.grad is the full layer's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..module import MultiHeadAttention
from ._comm import agree, resolve_group, world_and_rank
from .layout import _dtype_code, _rows

__all__ = ["shard_heads", "HeadParallelAttention", "tensor_parallel_plan", "check_head_split"]


def check_head_split(num_heads: int, num_kv_heads: int, world_size: int) -> str:
    """How K/V heads split over ``world_size`` ranks: "shard" or "replicate".

    Raises:
        ValueError: H not divisible by P, or Hkv neither divisible by P nor dividing it
            (a query group would straddle two ranks).
    """
    if num_heads % world_size:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by the world size ({world_size}) "
                         "for head parallelism")
    if num_kv_heads % world_size == 0:
        return "shard"
    if world_size % num_kv_heads == 0:
        return "replicate"
    raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide or be divisible by the world size "
                     f"({world_size}) for head parallelism: otherwise the query heads that share a K/V head "
                     f"(groups of {num_heads // num_kv_heads}) would straddle ranks")


class _CopyToRanks(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient in backward (Megatron's "f")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward (Megatron's "g")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class HeadParallelAttention(nn.Module):
    """This rank's heads of a :class:`multihead.MultiHeadAttention` (see :func:`shard_heads`).

    Attributes:
        local: a ``MultiHeadAttention`` with H_r query heads and this rank's K/V heads, its
            o_proj without bias (q/k/v/o weights are slices of the full layer's).
        o_bias: the full layer's o_proj bias (added once, after the all-reduce), or None.
        num_heads, num_kv_heads: the full layer's H and Hkv.
        kv_mode: "shard" or "replicate" (see the module docstring).
    """

    def __init__(self, layer: MultiHeadAttention, group: object = None) -> None:
        super().__init__()
        if not isinstance(layer, MultiHeadAttention):
            raise TypeError(f"layer must be a multihead.MultiHeadAttention, got {type(layer).__name__}")
        if not layer.batch_first:  # its x and y are (S, B, E): the shards would read them as (B, S, E)
            raise ValueError("shard_heads takes (B, S, E) inputs; the layer was built batch_first=False (from a "
                             "seq-first nn.MultiheadAttention): transpose x to (B, S, E) and build the layer "
                             "batch_first=True")
        if layer.per_head_extras or layer.softcap is not None or layer.qk_norm is not None:
            raise ValueError(f"shard_heads does not carry QK-norm, soft-capping or per-head state "
                             f"{layer.per_head_extras} yet; got a layer with them")
        self.group = resolve_group(group)
        p, r = world_and_rank(self.group)
        self.world_size, self.rank = p, r
        self.kv_mode = check_head_split(layer.num_heads, layer.num_kv_heads, p)
        self.num_heads, self.num_kv_heads, self.head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        weight = layer.q_proj.weight
        has_o_bias = layer.o_proj.bias is not None
        self.local = MultiHeadAttention(
            layer.embed_dim, layer.num_heads // p, num_kv_heads=self._local_kv_heads(), head_dim=layer.head_dim,
            bias=layer.q_proj.bias is not None, o_bias=has_o_bias and p == 1, causal=layer.causal, rope=layer.rope,
            dropout=layer.dropout, scale=layer.scale, window=layer.window, kdim=layer.kdim, vdim=layer.vdim,
            backend=layer.backend, device=weight.device, dtype=weight.dtype,
        )
        # With one rank nothing is reduced: the bias stays inside o_proj (bit-identical to the layer).
        self.o_bias = nn.Parameter(torch.empty_like(layer.o_proj.bias)) if has_o_bias and p > 1 else None
        self.load_full_state_dict(layer.state_dict())
        if self.kv_mode == "replicate" and p > 1:
            for proj in (self.local.k_proj, self.local.v_proj):
                for param in proj.parameters():
                    param.register_hook(self._sum_replicas)

    def _local_kv_heads(self) -> int:
        return self.num_kv_heads // self.world_size if self.kv_mode == "shard" else 1

    def _rows(self, kind: str) -> slice:
        """Rows of the full q (``kind="q"``) or k/v projection this rank holds."""
        d = self.head_dim
        if kind == "q":
            h = self.num_heads // self.world_size
            return slice(self.rank * h * d, (self.rank + 1) * h * d)
        if self.kv_mode == "shard":
            h = self.num_kv_heads // self.world_size
            return slice(self.rank * h * d, (self.rank + 1) * h * d)
        head = self._kv_head()
        return slice(head * d, (head + 1) * d)

    def _kv_head(self) -> int:
        """The one K/V head a rank holds when they are replicated (P / Hkv ranks per head)."""
        return self.rank // (self.world_size // self.num_kv_heads)

    def _sum_replicas(self, grad: torch.Tensor) -> torch.Tensor:
        """Sum a replicated K/V parameter's gradient over the ranks sharing its head."""
        slots = grad.new_zeros((self.num_kv_heads, *grad.shape))
        slots[self._kv_head()] = grad
        dist.all_reduce(slots, group=self.group)
        return slots[self._kv_head()]

    # -- state dicts of the full layer --------------------------------------------------
    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load this rank's slices from a full layer's state dict (``layer.state_dict()``)."""
        q, kv = self._rows("q"), self._rows("kv")
        local = self.local
        for name, proj, rows in (("q_proj", local.q_proj, q), ("k_proj", local.k_proj, kv),
                                 ("v_proj", local.v_proj, kv)):
            proj.weight.copy_(state[f"{name}.weight"][rows])
            if proj.bias is not None:
                proj.bias.copy_(state[f"{name}.bias"][rows])
        local.o_proj.weight.copy_(state["o_proj.weight"][:, q])
        if local.o_proj.bias is not None:
            local.o_proj.bias.copy_(state["o_proj.bias"])
        if self.o_bias is not None:
            self.o_bias.copy_(state["o_proj.bias"])

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full layer's state dict, gathered from every rank (call it on every rank)."""
        local = self.local
        out: dict[str, torch.Tensor] = {}
        for name, proj in (("q_proj", local.q_proj), ("k_proj", local.k_proj), ("v_proj", local.v_proj)):
            for kind, t in (("weight", proj.weight), ("bias", proj.bias)):
                if t is None:
                    continue
                full = self._gather(t, dim=0)
                if name != "q_proj" and self.kv_mode == "replicate":
                    per = self.world_size // self.num_kv_heads
                    full = torch.cat(full.chunk(self.world_size, dim=0)[::per], dim=0)
                out[f"{name}.{kind}"] = full
        out["o_proj.weight"] = self._gather(local.o_proj.weight, dim=1)
        bias = self.o_bias if self.o_bias is not None else local.o_proj.bias
        if bias is not None:
            out["o_proj.bias"] = bias.detach().clone()
        return out

    def _gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.detach().contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    # -- running ------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int, **kwargs: object):  # type: ignore[no-untyped-def]
        """A :class:`multihead.KVCache` for this rank's K/V heads (1/P of the layer's when sharded)."""
        return self.local.new_cache(batch_size, max_len, **kwargs)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                cache: object = None, return_weights: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The full layer's output on every rank, computed from this rank's heads.

        Args:
            x: (B, S, E), the same on every rank; context, key_mask, positions, cache as in
                :meth:`multihead.MultiHeadAttention.forward` (the cache from :meth:`new_cache`).
            mask: bool broadcastable to (B, H, S, Sk) over the *full* H heads (sliced here).
            return_weights: also return this rank's heads' weights (B, H_r, S, Sk).

        Returns:
            y (B, S, E), equal on every rank (or ``(y, weights)``).

        Raises:
            ValueError: on every rank with one message (:class:`~multihead.parallel.ParallelError`),
                before anything is computed, communicated or cached, if one rank's call fails the
                layer's checks, or the ranks' calls differ in B, S, Sk, dtype, the arguments given,
                the tokens their caches hold or autograd (one all-gather of a few int64).
        """
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == self.num_heads \
                and self.world_size > 1:
            h = self.num_heads // self.world_size
            mask = mask[:, self.rank * h:(self.rank + 1) * h]
        if self.world_size > 1:
            self._agree(x, context, mask, key_mask, positions, cache)
        if self.world_size > 1 and torch.is_grad_enabled():
            x = _CopyToRanks.apply(x, self.group)
            context = None if context is None else _CopyToRanks.apply(context, self.group)
        result = self.local(x, context, mask=mask, key_mask=key_mask, positions=positions, cache=cache,
                            return_weights=return_weights)
        y = result[0] if return_weights else result
        if self.world_size > 1:
            y = _SumOverRanks.apply(y, self.group)
            if self.o_bias is not None:
                y = y + self.o_bias
        return (y, result[1]) if return_weights else y


    def _agree(self, x: torch.Tensor, context: torch.Tensor | None, mask: torch.Tensor | None,
               key_mask: torch.Tensor | None, positions: torch.Tensor | None, cache: object) -> None:
        """Every rank's call passes the layer's checks and has the same shapes, or every rank raises.

        Otherwise the all-reduce after o_proj would get tensors of different sizes (gloo aborts)
        or wait for a rank that already raised (until the group's timeout).
        """
        error = None
        try:
            self.local.check(x, context, mask=mask, key_mask=key_mask, positions=positions,
                             cache=cache)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        meta = [0] * len(_CALL) if error is not None else [
            x.shape[0], x.shape[1], -1 if context is None else context.shape[1], _dtype_code(x.dtype),
            int(mask is not None), int(key_mask is not None), int(positions is not None),
            -1 if cache is None else max(cache.host_lengths()),  # type: ignore[attr-defined]
            int(torch.is_grad_enabled())]
        agree(self.group, meta, error, _check_same_call)


#: What the ranks of a head-parallel call agree on (:meth:`HeadParallelAttention._agree`).
_CALL = ("B", "S", "Sk (-1: no context)", "dtype", "mask", "key_mask", "positions", "cached tokens (-1: no cache)",
         "grad enabled")


def _check_same_call(table: list[list[int]]) -> str | None:
    if any(row != table[0] for row in table):
        return (f"the ranks' head-parallel calls differ in ({', '.join(_CALL)}): {_rows(table)}; every rank must "
                "call with the same x (B, S, E) and the same arguments")
    return None


def shard_heads(layer: MultiHeadAttention, group: object = None) -> HeadParallelAttention:
    """A layer that computes ``layer``'s output from this rank's slice of its heads.

    Call it on every rank of ``group`` with the same layer (same weights, e.g. the same
    seed or a loaded checkpoint): each keeps its slices, ``full_state_dict()`` gathers them
    back. Forward costs one all-reduce of (B, S, E); backward one more (dx), plus one per
    replicated K/V parameter when Hkv < P.

    Args:
        layer: the full layer.
        group: ProcessGroup, 1-D DeviceMesh or None (the default group).

    Raises:
        ValueError: H not divisible by P, or Hkv neither divisible by P nor dividing it;
            decided from sizes every rank shares, so every rank raises before any
            communication. At a call: on every rank, if the ranks' calls disagree (see
            :meth:`HeadParallelAttention.forward`).
    """
    return HeadParallelAttention(layer, group)


def tensor_parallel_plan(layer: MultiHeadAttention) -> dict[str, object]:
    """torch's standard tensor-parallel plan for the layer: q/k/v column-wise, o_proj row-wise.

    Use it with ``torch.distributed.tensor.parallel.parallelize_module(layer, mesh, plan)``.
    The layer takes its local head counts from the sharded weights; a split that would put
    part of a head, or part of a query group, on a rank (H or Hkv not divisible by the
    mesh size) is refused with a ``ValueError`` at the first forward, on every rank. For
    Hkv < P use :func:`shard_heads`, which replicates K/V heads.

    Returns:
        ``{"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
        "o_proj": RowwiseParallel()}``
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(layer, MultiHeadAttention):
        raise TypeError(f"layer must be a multihead.MultiHeadAttention, got {type(layer).__name__}")
    return {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel()}
