"""Token-by-token decoding through a small stack of multihead layers, one KV cache per layer.

    python examples/decode.py [--layers 4] [--prompt 256] [--new 64] [--kv-heads 2]

Prints the time per generated token and the memory of the caches, and checks that the
cached decoding equals a full causal forward over the whole sequence.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import multihead as mh


class Block(nn.Module):
    """Pre-norm attention block: x + attn(norm(x)) (the seed's residual)."""

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(embed_dim)
        self.attn = mh.MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads, bias=False,
                                          causal=True, rope=mh.RoPE(embed_dim // num_heads))

    def forward(self, x: torch.Tensor, cache: mh.KVCache | None = None) -> torch.Tensor:
        return x + self.attn(self.norm(x), cache=cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embed-dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(args.embed_dim, args.heads, args.kv_heads) for _ in range(args.layers)).eval()
    total = args.prompt + args.new
    x = torch.randn(1, total, args.embed_dim)

    with torch.inference_mode():
        caches = [block.attn.new_cache(1, total) for block in blocks]
        h = x[:, : args.prompt]
        start = time.perf_counter()
        for block, cache in zip(blocks, caches):
            h = block(h, cache)
        prefill_s = time.perf_counter() - start
        outs = [h]
        # A real model would feed back its sampled token; here the next inputs are given.
        step_times = []
        for t in range(args.prompt, total):
            start = time.perf_counter()
            h = x[:, t : t + 1]
            for block, cache in zip(blocks, caches):
                h = block(h, cache)
            step_times.append(time.perf_counter() - start)
            outs.append(h)
        decoded = torch.cat(outs, dim=1)

        full = x
        for block in blocks:
            full = block(full)

    step_times.sort()
    cache_bytes = sum(c.nbytes for c in caches)
    mha_bytes = cache_bytes * args.heads // args.kv_heads
    print(f"{args.layers} layers, d={args.embed_dim}, {args.heads} heads, {args.kv_heads} KV heads, "
          f"threads={torch.get_num_threads()}")
    print(f"prefill {args.prompt} tokens: {prefill_s * 1e3:.1f} ms")
    print(f"decode: {step_times[len(step_times) // 2] * 1e3:.2f} ms/token (median of {len(step_times)})")
    print(f"KV caches: {cache_bytes / 2**20:.2f} MiB for {total} tokens "
          f"({cache_bytes // total} bytes/token; full MHA would need {mha_bytes / 2**20:.2f} MiB)")
    print(f"max |cached - full forward| = {(decoded - full).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
