"""Head (tensor) parallelism: each process owns a slice of the heads.

    torchrun --nproc-per-node 2 examples/parallel_heads.py

gloo on CPUs by default, NCCL (one GPU per process) when CUDA is present. Every rank
builds the same full layer (same seed, or a loaded checkpoint), keeps its heads, and
gets the full layer's output after one all-reduce. The script checks it against the
unsharded layer and prints the largest difference from rank 0.
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
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    device = torch.device("cuda") if cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same full layer on every rank
    layer = mh.MultiHeadAttention(512, 8, num_kv_heads=2, causal=True, rope=mh.RoPE(64), device=device)
    sharded = mh.parallel.shard_heads(layer)  # this rank: 8 / world query heads (K/V split or replicated)
    x = torch.randn(2, 128, 512, device=device)  # (B, S, E), the same on every rank

    with torch.no_grad():
        y = sharded(x)  # (B, S, E) on every rank: one all-reduce after o_proj
        diff = (y - layer(x)).abs().max().item()
    state = sharded.full_state_dict()  # gathered back into the full layer's state dict
    if rank == 0:
        print(f"{world} ranks, {sharded.local.num_heads} query heads each ({sharded.kv_mode} K/V): "
              f"max |sharded - full| = {diff:.2e}; full state dict keys: {sorted(state)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
