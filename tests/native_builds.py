"""Fixtures of the native build tests (a plugin of tests/conftest.py): the machine's own build of the
kernels, compiled once per session by the real compiler, and a stand-in "compiler" that hands out
copies of it.

The build driver (:mod:`multihead.backends.native._build`) decides where a build goes, what it
announces, when it reuses or rebuilds one and what it verifies; none of that depends on which
compiler ran. So one real compile (about 20 s on 2 cores) serves every test of the driver: the
others point ``$CXX`` at :data:`STAND_IN` (this Python running a script, a command with arguments
as ``CXX="ccache g++"`` is), which copies that build to the output it is asked for and logs each
link, one line per build.

The real compile starts in the background as soon as collection shows that a test needs it
(:func:`pytest_collection_modifyitems`): the tests collected before the first that asks for it
run meanwhile (most of them keep one core busy, the compiler takes the other), and the fixture
waits for it and checks it as it did a compile it started itself.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
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


#: The machine build's check, in the process that compiles it: build, load, compare with float64.
MACHINE_BUILD = """
import torch, multihead as mh
from multihead import native
assert native.build(), native.status()
q, k, v = (torch.randn(1, 4, 300, 64) for _ in range(3))
out = mh.attention(q, k, v, causal=True, backend="native")
want = mh.attention(q.double(), k.double(), v.double(), causal=True, backend="explicit")
assert (out.double() - want).abs().max() < 1e-5
print(native.status())
"""

#: The machine build under way: (its process, its cache folder), started at collection.
_STARTED: dict[str, tuple[subprocess.Popen, Path]] = {}
#: The folders those builds were started in (outside pytest's own temporary folders).
_FOLDERS: list[Path] = []


def _start_machine_build(cache: Path) -> subprocess.Popen:
    """Start the machine build into ``cache`` (its output in ``cache/stdout`` and ``cache/stderr``)."""
    with open(cache / "stdout", "w") as out, open(cache / "stderr", "w") as err:
        return subprocess.Popen([sys.executable, "-c", MACHINE_BUILD], stdout=out, stderr=err,
                                env={**os.environ, "MULTIHEAD_NATIVE": "1", "MULTIHEAD_NATIVE_ISA": "machine",
                                     "MULTIHEAD_CACHE_DIR": str(cache)})


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the tests that will run count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("machine_build" in getattr(item, "fixturenames", ()) for item in items):
        cache = Path(tempfile.mkdtemp(prefix="multihead-machine-build-"))  # removed at the session's end
        _FOLDERS.append(cache)
        _STARTED["build"] = (_start_machine_build(cache), cache)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A build no test waited for (the run stopped early) is stopped with the session; the folders
    started at collection are removed."""
    started = _STARTED.pop("build", None)
    if started is not None and started[0].poll() is None:
        started[0].kill()
        started[0].wait()
    while _FOLDERS:
        shutil.rmtree(_FOLDERS.pop(), ignore_errors=True)


@pytest.fixture(scope="session")
def machine_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The machine's own build (``MULTIHEAD_NATIVE_ISA=machine``), compiled by the real compiler
    into a fresh cache folder, loaded and checked against the float64 reference in that process:
    the path of its shared library. (Started at collection where the session runs a test using it.)"""
    started = _STARTED.pop("build", None)
    if started is None:
        cache = tmp_path_factory.mktemp("machine-build")
        started = (_start_machine_build(cache), cache)
    process, cache = started
    try:
        returncode = process.wait(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    stderr = (cache / "stderr").read_text()
    assert returncode == 0, stderr[-3000:]
    assert "compiled in" in stderr  # the real compile is announced
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
