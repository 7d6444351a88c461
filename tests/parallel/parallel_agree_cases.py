"""Calls that differ on one rank (B, S, a decoding step's Sn, a local refusal): every rank must
refuse together, with one message, within seconds, with no cache advanced (run by
test_parallel_agree.py in a spawned gloo world whose collectives time out in seconds).

Notation: B batch, S tokens, Sn new tokens of a decoding step, E embed_dim, P world size, r rank.

Each case returns what it raised (parallel_cases.refusal) and the cache state after it; the
last step of each table is a good call after the refusals, compared with the single-process
layer (the caches then held exactly what they held before the refusals).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from multihead import parallel as mp_
from parallel_cases import E, F64, err, make_layer, refusal

B, S0 = 2, 6


def _x(b: int, s: int, seed: int, e: int = E) -> torch.Tensor:
    return torch.randn(b, s, e, generator=torch.Generator().manual_seed(seed), dtype=F64)


def head_cases(rank: int, p: int) -> dict[str, Any]:
    """shard_heads: rank 1 passes another B, another S, another E (its own layer check refuses),
    or a cached step with more new tokens (and one that overflows only its cache)."""
    res: dict[str, Any] = {}
    layer = make_layer(4, 2, causal=True).eval()
    hp = mp_.shard_heads(layer)
    odd = rank == 1
    res["heads/B"] = refusal(lambda: hp(_x(3 if odd else B, S0, 1)))
    res["heads/S"] = refusal(lambda: hp(_x(B, S0 + 1 if odd else S0, 1)))
    res["heads/local"] = refusal(lambda: hp(_x(B, S0, 1, e=E + 2 if odd else E)))
    prompt, step = _x(B, S0, 2), _x(B, 3, 3)
    with torch.no_grad():
        ref_cache = layer.new_cache(B, S0 + 2)
        ref = [layer(prompt, cache=ref_cache), layer(step[:, :1], cache=ref_cache)]
        cache = hp.new_cache(B, S0 + 2)
        got = [hp(prompt, cache=cache)]
        res["heads/decode_Sn"] = refusal(lambda: hp(step[:, :2 if odd else 1], cache=cache))
        res["heads/decode_Sn"]["held"] = cache.host_lengths()
        res["heads/overflow"] = refusal(lambda: hp(step[:, :3 if odd else 1], cache=cache))  # 6 + 3 > 8 on rank 1
        res["heads/overflow"]["held"] = cache.host_lengths()
        got.append(hp(step[:, :1], cache=cache))
    res["heads/after"] = {"err": max(err(g, r) for g, r in zip(got, ref)), "held": cache.host_lengths()}
    return res


def context_cases(rank: int, p: int) -> dict[str, Any]:
    """context_parallel: rank 1 decodes 2 new tokens where the others decode 1, another B, or
    decodes while rank 0 prefills a new cache; a prompt shard of another B."""
    res: dict[str, Any] = {}
    layer = make_layer(4, 2, causal=True).eval()
    cp = mp_.context_parallel(layer)
    odd = rank == 1
    prompt, step = _x(B, S0, 4), _x(B, 2, 5)
    with torch.no_grad():
        ref_cache = layer.new_cache(B, S0 + 4)
        ref = [layer(prompt, cache=ref_cache), layer(step[:, :1], cache=ref_cache)]
        res["context/prefill_B"] = refusal(lambda: cp(mp_.shard_sequence(_x(3, S0, 4) if odd else prompt, dim=1),
                                                      cache=cp.new_cache(B, S0 + 4)))
        cache = cp.new_cache(B, S0 + 4)
        got = [mp_.unshard_sequence(cp(mp_.shard_sequence(prompt, dim=1), cache=cache), dim=1)]

        def state() -> list[Any]:
            return [cache.length, list(cache.counts), cache.held]

        res["context/decode_Sn"] = refusal(lambda: cp(step[:, :2 if odd else 1], cache=cache))
        res["context/decode_Sn"]["state"] = state()
        res["context/decode_B"] = refusal(lambda: cp(_x(3, 1, 5) if odd else step[:, :1], cache=cache))
        res["context/decode_B"]["state"] = state()
        fresh = cp.new_cache(B, S0 + 4)
        res["context/decode_vs_prefill"] = refusal(
            lambda: cp(step[:, :1], cache=cache) if odd else cp(mp_.shard_sequence(prompt, dim=1), cache=fresh))
        res["context/decode_vs_prefill"]["state"] = state()
        got.append(cp(step[:, :1], cache=cache))
    res["context/after"] = {"err": max(err(g, r) for g, r in zip(got, ref)), "state": state()}
    return res


def agree_cases(rank: int, p: int) -> dict[str, Any]:
    out = {**head_cases(rank, p), **context_cases(rank, p)}
    alive = torch.ones(1)
    dist.all_reduce(alive)  # the group still works after every refusal
    out["alive"] = float(alive)
    return out
