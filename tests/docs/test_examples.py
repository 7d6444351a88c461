"""Every script in examples/ runs, and says what it checked (the docs point readers to them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
#: Each example, how it is run, and a line its output must hold (its own check passing).
EXAMPLES = {
    "decode.py": ([sys.executable, "examples/decode.py", "--layers", "2", "--prompt", "32", "--new", "8"],
                  r"max \|cached - full forward\| = (\d\.\d+e-0[5-9]|\d\.\d+e-[1-9]\d|0\.0)"),
    "run_minilm.py": ([sys.executable, "examples/run_minilm.py"], r"\+1\.000"),
    "parallel_heads.py": ([*TORCHRUN, "examples/parallel_heads.py"],
                          r"max \|sharded - full\| = \d\.\d+e-0[5-9]"),
    "ring_attention.py": ([*TORCHRUN, "examples/ring_attention.py"], r"max \|ring - full\| = \d\.\d+e-0[5-9]"),
}


def test_every_example_is_run_here() -> None:
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name: str) -> None:
    command, expected = EXAMPLES[name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(expected, done.stdout), done.stdout
