"""Run the whole benchmark suite: ``python benchmarks/run.py [--quick] [--out DIR]``.

Prints the machine, its measured limits and one table per case (both times, the
speedup, the fraction of the sgemm rate or of the copy bandwidth), then writes
``DIR/bench.json`` and ``DIR/bench.png``. The library does the work
(:mod:`multihead.bench`); this script only parses arguments and prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from multihead import bench


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions (a smoke test)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where to write JSON and PNG")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, = cores)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()} (cores: {bench.machine_info()['cores']})", flush=True)
    t0 = time.perf_counter()
    def progress(line: str) -> None:
        print(f"  running {line}", file=sys.stderr, flush=True)

    suite = bench.run_suite(quick=args.quick, progress=progress)
    print(bench.format_report(suite))
    json_path = bench.write_json(suite, args.out / "bench.json")
    png_path = bench.plot(suite, args.out / "bench.png")
    print(f"\nwrote {json_path} and {png_path} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
