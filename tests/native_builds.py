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
waits for it and checks it as it did a compile it started itself. Under pytest-xdist every worker
collects every test: the first to get there starts the run's one build, in a folder the controlling
process made, and each worker that needs it waits for its exit status there.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
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
        return subprocess.Popen([sys.executable, "-c", MACHINE_BUILD], stdout=out, stderr=err, env=_build_env(cache))


def _build_env(cache: Path) -> dict[str, str]:
    """The machine build's environment: the native kernels on, built for this CPU into ``cache``."""
    return {**os.environ, "MULTIHEAD_NATIVE": "1", "MULTIHEAD_NATIVE_ISA": "machine", "MULTIHEAD_CACHE_DIR": str(cache)}


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the tests that will run count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("machine_build" in getattr(item, "fixturenames", ()) for item in items):
        return
    if _xdist_worker():  # every worker collects every test: the first to get here starts the run's one build
        _start_shared_build(_shared_folder())
        return
    cache = Path(tempfile.mkdtemp(prefix="multihead-machine-build-"))  # removed at the session's end
    _FOLDERS.append(cache)
    _STARTED["build"] = (_start_machine_build(cache), cache)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A build no test waited for (the run stopped early) is stopped with the session; the folders
    started at collection are removed (under pytest-xdist, the controlling process removes the
    workers' shared one after they have all finished)."""
    started = _STARTED.pop("build", None)
    if started is not None and started[0].poll() is None:
        started[0].kill()
        started[0].wait()
    while _FOLDERS:
        shutil.rmtree(_FOLDERS.pop(), ignore_errors=True)


#: The folder of the build pytest-xdist's workers share, made by the controlling process (inherited).
SHARED = "MULTIHEAD_TESTS_SHARED_BUILD"


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, the controlling process makes the folder of the workers' one machine build
    before it starts them (they inherit its environment); removed at its session's end."""
    if getattr(config.option, "numprocesses", None) and not _xdist_worker():
        folder = Path(tempfile.mkdtemp(prefix="multihead-machine-build-"))
        _FOLDERS.append(folder)
        os.environ[SHARED] = str(folder / "build")


def _xdist_worker() -> bool:
    return "PYTEST_XDIST_WORKER" in os.environ


def _shared_folder() -> Path:
    return Path(os.environ[SHARED])


#: Run by the build shared between workers: the build's check, then its exit status in a file (the
#: workers that did not start it wait for that file).
_SHARED_BUILD = """
import os, subprocess, sys
folder = sys.argv[1]
with open(os.path.join(folder, "stdout"), "w") as out, open(os.path.join(folder, "stderr"), "w") as err:
    code = subprocess.run([sys.executable, "-c", sys.argv[2]], stdout=out, stderr=err).returncode
with open(os.path.join(folder, "returncode.tmp"), "w") as f:
    f.write(str(code))
os.replace(os.path.join(folder, "returncode.tmp"), os.path.join(folder, "returncode"))
"""


def _start_shared_build(folder: Path) -> None:
    """Start the machine build into ``folder`` unless a worker of this run already has (a lock file
    decides)."""
    from filelock import FileLock

    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock", timeout=60):
        if (folder / "started").exists():
            return
        subprocess.Popen([sys.executable, "-c", _SHARED_BUILD, str(folder), MACHINE_BUILD],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                         env=_build_env(folder))
        (folder / "started").touch()


def _wait_shared_build(folder: Path, timeout_s: float = 600.0) -> int:
    """The shared build's exit status, once it has one (polled; bounded by ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not (folder / "returncode").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the shared machine build in {folder} did not finish within {timeout_s} s")
        time.sleep(0.2)
    return int((folder / "returncode").read_text())


@pytest.fixture(scope="session")
def machine_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The machine's own build (``MULTIHEAD_NATIVE_ISA=machine``), compiled by the real compiler
    into a fresh cache folder, loaded and checked against the float64 reference in that process:
    the path of its shared library. (Started at collection where the session runs a test using it;
    one build for all of pytest-xdist's workers.)"""
    if _xdist_worker():
        cache = _shared_folder()
        _start_shared_build(cache)  # started at collection; here too for a test that asked for it late
        returncode = _wait_shared_build(cache)
    else:
        returncode, cache = _wait_own_build(tmp_path_factory)
    stderr = (cache / "stderr").read_text()
    assert returncode == 0, stderr[-3000:]
    assert "compiled in" in stderr  # the real compile is announced
    (build,) = cache.glob("*.so")
    return build


def _wait_own_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    """(exit status, cache folder) of this session's machine build, started at collection or now."""
    started = _STARTED.pop("build", None)
    if started is None:
        cache = tmp_path_factory.mktemp("machine-build")
        started = (_start_machine_build(cache), cache)
    process, cache = started
    try:
        return process.wait(timeout=600), cache
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


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
