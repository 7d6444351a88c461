"""Context (sequence) parallelism: each process holds a shard of a long sequence.

    torchrun --nproc-per-node 2 examples/ring_attention.py

gloo on CPUs by default, NCCL (one GPU per process) when CUDA is present. The sequence
is cut in the zigzag layout (balanced causal work); K/V travel around the ring; every
rank gets its own tokens' outputs. The script checks the gathered output and the
gradients against the unsharded layer, then decodes 8 tokens with a cache sharded over
the ranks, and prints from rank 0.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import multihead as mh


def main() -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda") if cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    par = mh.parallel

    torch.manual_seed(0)  # the same layer and full input on every rank (a real job loads its shard)
    layer = mh.MultiHeadAttention(256, 8, num_kv_heads=2, causal=True, rope=mh.RoPE(32), device=device)
    x = torch.randn(1, 1000, 256, device=device)  # (B, S, E); S need not divide by the world size

    cp = par.context_parallel(layer, layout="zigzag", method="ring")
    x_local = par.shard_sequence(x, layout="zigzag", dim=1).requires_grad_()  # (B, S_r, E)
    y_local = cp(x_local)  # (B, S_r, E): ring attention, RoPE at global positions
    y_local.sum().backward()  # dK/dV travel back around the ring
    y = par.unshard_sequence(y_local.detach(), layout="zigzag", dim=1)
    with torch.no_grad():
        diff = (y - layer(x)).abs().max().item()

    with torch.no_grad():  # decoding: each rank caches ~1/P of the tokens
        cache = cp.new_cache(1, 1000 + 8)
        cp(par.shard_sequence(x, layout="zigzag", dim=1), cache=cache)
        token = torch.randn(1, 1, 256, device=device)  # the same new token on every rank
        for _ in range(8):
            token = cp(token, cache=cache)
    if rank == 0:
        print(f"{world} ranks, {x_local.shape[1]} of {x.shape[1]} tokens on rank 0: "
              f"max |ring - full| = {diff:.2e}; cache on this rank: {cache.nbytes / 2**10:.0f} KiB "
              f"for {cache.counts[rank]} of {cache.length} tokens")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
