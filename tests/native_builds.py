"""Fixtures of the native build tests (a plugin of tests/conftest.py): the machine's own build of the
kernels, compiled once per session by the real compiler, and a stand-in "compiler" that hands out
copies of it.

The build driver (:mod:`multihead.backends.native._build`) decides where a build goes, what it
announces, when it reuses or rebuilds one and what it verifies; none of that depends on which
compiler ran. So one real compile (about 20 s on 2 cores) serves every test of the driver: the
others point ``$CXX`` at :data:`STAND_IN` (this Python running a script, a command with arguments
as ``CXX="ccache g++"`` is), which copies that build to the output it is asked for and logs each
link, one line per build.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

#: The stand-in compiler: ``python stand_in.py BUILD LOG <the driver's arguments>``.
STAND_IN = r"""
import os, shutil, sys
args = sys.argv[1:]
if "--version" in args:
    print("stand-in compiler 1.0")
    sys.exit(0)
build, log = args[:2]
if os.environ.get("STAND_IN_FAILS"):
    sys.exit("stand-in compiler: refusing to compile")
shutil.copyfile(build, args[args.index("-o") + 1])
if "-shared" in args:  # the link (the units are compiled first, one call each): one build
    with open(log, "a") as f:
        f.write("built\n")
"""


class StandIn(NamedTuple):
    """A stand-in compiler: ``cxx`` for ``$CXX``, and the log holding one line per build."""

    cxx: str
    log: Path

    def builds(self) -> int:
        """How many builds it has linked."""
        return len(self.log.read_text().splitlines())


@pytest.fixture(scope="session")
def machine_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The machine's own build (``MULTIHEAD_NATIVE_ISA=machine``), compiled by the real compiler
    into a fresh cache folder, loaded and checked against the float64 reference in that process:
    the path of its shared library."""
    cache = tmp_path_factory.mktemp("machine-build")
    code = """
import torch, multihead as mh
from multihead import native
assert native.build(), native.status()
q, k, v = (torch.randn(1, 4, 300, 64) for _ in range(3))
out = mh.attention(q, k, v, causal=True, backend="native")
want = mh.attention(q.double(), k.double(), v.double(), causal=True, backend="explicit")
assert (out.double() - want).abs().max() < 1e-5
print(native.status())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MULTIHEAD_NATIVE": "1", "MULTIHEAD_NATIVE_ISA": "machine",
                               "MULTIHEAD_CACHE_DIR": str(cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled in" in done.stderr  # the real compile is announced
    (build,) = cache.glob("*.so")
    return build


def stand_in(machine_build: Path, folder: Path) -> StandIn:
    """A stand-in compiler handing out copies of ``machine_build``, its script and log in ``folder``."""
    script, log = folder / "stand_in_cxx.py", folder / "builds.log"
    script.write_text(STAND_IN)
    log.touch()
    return StandIn(shlex.join([sys.executable, str(script), str(machine_build), str(log)]), log)


@pytest.fixture
def stand_in_cxx(machine_build: Path, tmp_path: Path) -> StandIn:
    """A fresh stand-in compiler (:func:`stand_in`) for one test."""
    folder = tmp_path / "stand-in"
    folder.mkdir()
    return stand_in(machine_build, folder)
