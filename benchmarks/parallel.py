"""The parallel case of the benchmark suite: ``python benchmarks/parallel.py [--quick] [--json FILE]``.

Ring attention (causal, zigzag, float32, H=8, D=64) at S = 16384 and 32768 on P = 1, 2, 4
spawned gloo processes: each rank's peak memory, its time, the bytes it sends against
(P-1)/P of K and V; and the head-parallel layer's time at P = 1, 2. The library does the
work (:mod:`multihead.parallel.bench`; also ``multihead.bench.run_suite(parallel=True)``).
"""

from __future__ import annotations

import argparse
import json
import sys

from multihead.parallel import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S = 2048 only")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args()
    result = bench.run(**({"seqs": (2048,)} if args.quick else {}), progress=lambda s: print(s, file=sys.stderr))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(bench.format_report(result))
