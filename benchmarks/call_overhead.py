"""The Python cost of one ``mh.attention`` call at small shapes: ``python benchmarks/call_overhead.py``.

Time per call (1 thread unless ``--threads``, no grad, warmed up) of torch's
``F.scaled_dot_product_attention`` and of ``mh.attention`` with ``backend`` "auto" (the default),
"sdpa", "native" and "explicit", at
(B, H, Sq, D) = (1, 12, 16, 32) with 16 keys (a short prefill) and (1, 32, 1, 128) with 512
keys (a decoding step; 32 K/V heads as in the benchmark suite's call case, and 8: GQA).

Each timing is ``--calls`` calls in a row, in the thread's CPU time (another process on the
machine inflates it less than the wall clock); a case's time in a round is the median of
``--repeats`` timings, and the cases are interleaved over ``--rounds`` rounds. Printed: the
median over the rounds and its ratio to SDPA's time in the same round (the median of those
ratios), then the least time of any round and its ratio to SDPA's least (what a busy
machine disturbs least); the line above says which path ``"auto"`` takes
(:func:`multihead.backends.auto.auto_path`).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import multihead as mh
from multihead.backends import auto

SHAPES = {
    "prefill (1,12,16,32) Sk=16": ((1, 12, 16, 32), (1, 12, 16, 32)),
    "decode (1,32,1,128) Hkv=32 Sk=512": ((1, 32, 1, 128), (1, 32, 512, 128)),
    "decode (1,32,1,128) Hkv=8 Sk=512": ((1, 32, 1, 128), (1, 8, 512, 128)),
}


def per_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the time of one call (seconds), after a warm-up."""
    for _ in range(max(calls // 4, 50)):
        fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        times.append((time.thread_time() - start) / calls)
    return statistics.median(times)


#: ``--sweep``: small shapes (q's, k's; causal or not) where "auto" and ``backend="native"`` are timed
#: against ``backend="sdpa"``.
SWEEP = [((1, 12, s, 32), (1, 12, s, 32), False) for s in (4, 8, 16, 32)] + [
    ((1, 4, s, 64), (1, 4, s, 64), False) for s in (16, 32, 64)] + [
    ((1, 12, s, 64), (1, 12, s, 64), causal) for s in (16, 32, 64, 128, 256) for causal in (False, True)] + [
    ((1, 32, 1, 128), (1, hkv, sk, 128), False) for hkv in (32, 8) for sk in (64, 128, 256, 512, 1024)]


def sweep(calls: int, repeats: int, rounds: int) -> None:
    """``mh.attention`` with "auto" and "native" against ``backend="sdpa"`` over :data:`SWEEP` (no grad)."""
    print("auto and native against backend='sdpa' (median of the rounds' ratios):")
    for qs, ks, causal in SWEEP:
        q, k, v = torch.randn(qs), torch.randn(ks), torch.randn(ks)
        fns = {name: functools.partial(mh.attention, q, k, v, causal=causal, backend=name)
               for name in ("auto", "sdpa", "native")}
        with torch.no_grad():
            found: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(rounds):
                for name, fn in fns.items():
                    found[name].append(per_call(fn, calls, repeats))
        ratios = {name: statistics.median(a / s for a, s in zip(found[name], found["sdpa"]))
                  for name in ("auto", "native")}
        print(f"  q {qs} k {ks} causal={causal!s:5}: auto {auto.auto_path(q, k, v)!r:16} "
              f"sdpa {statistics.median(found['sdpa']) * 1e6:8.1f} µs; auto {ratios['auto']:5.2f}×, "
              f"native {ratios['native']:5.2f}×")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="also time auto against backend='sdpa' on SWEEP")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (default 1: the call's own cost)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.sweep:
        sweep(max(args.calls // 10, 20), args.repeats, args.rounds)
    for label, (qs, ks) in SHAPES.items():
        q, k, v = torch.randn(qs), torch.randn(ks), torch.randn(ks)
        sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v)  # as torch users call it
        cases: dict[str, Callable[[], object]] = {
            "F.sdpa": sdpa if qs[1] == ks[1] else functools.partial(sdpa, enable_gqa=True),
            "mh auto": functools.partial(mh.attention, q, k, v),
            "mh sdpa": functools.partial(mh.attention, q, k, v, backend="sdpa"),
            "mh native": functools.partial(mh.attention, q, k, v, backend="native"),
            "mh explicit": functools.partial(mh.attention, q, k, v, backend="explicit"),
        }
        with torch.no_grad():
            # Interleaved: each case timed in turn, the whole round repeated, medians kept.
            found: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(args.rounds):
                for name, fn in cases.items():
                    found[name].append(per_call(fn, args.calls, args.repeats))
            print(f"{label}: auto takes {auto.auto_path(q, k, v)!r}")
            print(f"  {'':12s} {'median':>11s} {'ratio':>6s} {'least':>11s} {'ratio':>6s}")
            for name, ts in found.items():
                ratio = statistics.median(t / base for t, base in zip(ts, found["F.sdpa"]))
                least = min(ts) / min(found["F.sdpa"])
                print(f"  {name:12s} {statistics.median(ts) * 1e6:8.2f} µs {ratio:5.2f}× "
                      f"{min(ts) * 1e6:8.2f} µs {least:5.2f}×")


if __name__ == "__main__":
    main()
