"""Run the whole benchmark suite: ``python benchmarks/run.py [--quick] [--out DIR] [--threads N] [--json]``.

The same as ``multihead bench``: prints the machine, its measured limits (sgemm
GFLOP/s, copy GB/s) and one table per case (both times, the speedup, the fraction of
the machine's limit), then writes ``DIR/bench.json`` and ``DIR/bench.png``
(default ``benchmarks/results``). The library does the work (:mod:`multihead.tools.bench`).
"""

from __future__ import annotations

import sys

from multihead.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
