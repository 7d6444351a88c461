"""The machine's own build of the kernels (compiled where no installed build runs here) is
verified before it is loaded: a damaged or unsafe cached kernel is rebuilt (the reason in
``status()``), never loaded, and never kills the process.

Loading a truncated shared library raises SIGBUS in the loader, so every scenario runs
in one subprocess (``SCRIPT``) that reports what it saw; the test then checks it. The
"compiler" is the stand-in of ``tests/backends/conftest.py`` (a command with arguments, as
``CXX="ccache g++"`` is), which copies the session's one real build, so building costs nothing.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from multihead.backends.native import _build, files

from native_builds import stand_in

SCRIPT = r"""
import json, os, shlex, shutil, stat, sys
from pathlib import Path
os.umask(0)  # the worst umask: every file and folder must still be private
from multihead.backends import native
from multihead.backends.native import _build

base, stand_in, log = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
report = {}

def load(name, cxx=None):
    if cxx is None:
        os.environ.pop("CXX", None)
    else:
        os.environ["CXX"] = cxx
    os.environ["MULTIHEAD_CACHE_DIR"] = str(base / name)
    native.loader.loaded.cache_clear()
    ok = native.build()
    kernel = next((base / name).glob("*.so"), None)
    report[name] = {"available": ok, "status": native.status(), "builds": len(log.read_text().splitlines()),
                    "mode": stat.S_IMODE(os.lstat(kernel).st_mode) if kernel else None,
                    "regular": kernel is not None and stat.S_ISREG(os.lstat(kernel).st_mode),
                    "dir_mode": stat.S_IMODE((base / name).stat().st_mode) if (base / name).exists() else None,
                    "parent_mode": stat.S_IMODE((base / name).parent.stat().st_mode)}
    return kernel

load("nested/real", stand_in)  # into folders that do not exist yet
good = load("good", stand_in)
load("good", stand_in)  # a verified cached build is reused, not rebuilt
report["reused"] = report["good"]

def damaged(name, damage, compiler_fails=False):
    shutil.copytree(base / "good", base / name)
    damage(base / name / good.name)
    os.environ["STAND_IN_FAILS"] = "1" if compiler_fails else ""
    load(name, stand_in)

damaged("truncated", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]))
damaged("empty", lambda p: p.write_bytes(b""))
damaged("altered", lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 1]) + p.read_bytes()[1:]))
damaged("group_writable", lambda p: p.chmod(0o775))
damaged("symlink", lambda p: (p.unlink(), p.symlink_to(good)))
damaged("no_record", lambda p: p.with_suffix(".json").unlink())
damaged("truncated_and_compiler_fails", lambda p: p.write_bytes(b""), compiler_fails=True)
load("missing_program", "no-such-ccache g++")
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory, machine_build) -> dict:
    base = tmp_path_factory.mktemp("builds")
    compiler = stand_in(machine_build, base)
    env = {**os.environ, "MULTIHEAD_NATIVE": "1", "MULTIHEAD_NATIVE_ISA": "machine", "TMPDIR": str(base)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(base), compiler.cxx, str(compiler.log)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, f"the process died (code {done.returncode}): {done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fresh_build_is_private_whatever_the_umask(report) -> None:
    real = report["nested/real"]
    assert real["available"] and real["status"].startswith("ready"), real
    assert real["mode"] == 0o700 and real["dir_mode"] == 0o700 and real["parent_mode"] == 0o700, real


def test_a_compiler_command_with_arguments_is_split_like_a_shell(report) -> None:
    good = report["good"]
    assert good["available"] and good["builds"] == 2 and good["mode"] == 0o700, good  # nested/real's, its own


def test_a_verified_cached_build_is_reused(report) -> None:
    assert report["reused"]["available"] and report["reused"]["builds"] == 2  # none more


@pytest.mark.parametrize("case, reason", [
    ("truncated", r"bytes, its build recorded \d+ \(truncated or damaged\)"),
    ("empty", r"it is 0 bytes, its build recorded"),
    ("altered", r"SHA-256 differs"),
    ("group_writable", r"others may write to it \(mode 0775\)"),
    ("symlink", r"it is a symbolic link"),
    ("no_record", r"no build record"),
])
def test_a_damaged_or_unsafe_cached_kernel_is_rebuilt_with_the_reason(report, case: str, reason: str) -> None:
    import re

    seen = report[case]
    assert seen["available"], seen
    assert seen["status"].startswith("ready") and "rebuilt: the cached build was refused" in seen["status"], seen
    assert re.search(reason, seen["status"]), seen
    assert seen["regular"] and seen["mode"] == 0o700, seen


def test_rebuilds_are_counted(report) -> None:
    """nested/real and good (2) + truncated, empty, altered, group_writable, symlink, no_record (6)."""
    assert report["no_record"]["builds"] == 8


def test_a_failed_rebuild_leaves_the_kernel_off_with_both_reasons(report) -> None:
    seen = report["truncated_and_compiler_fails"]
    assert not seen["available"], seen
    assert "compiling the native kernel failed" in seen["status"] and "refusing to compile" in seen["status"], seen
    assert "it is 0 bytes" in seen["status"], seen


def test_a_missing_compiler_program_in_cxx_is_named(report) -> None:
    seen = report["missing_program"]
    assert not seen["available"] and "program 'no-such-ccache' not found" in seen["status"], seen


def _lstat(mode: int, uid: int | None = None) -> os.stat_result:
    return os.stat_result((mode, 1, 1, 1, os.getuid() if uid is None else uid, 0, 100, 0, 0, 0))


@pytest.mark.parametrize("mode, uid, reason", [
    (stat.S_IFREG | 0o700, os.getuid() + 1, "owned by uid"),
    (stat.S_IFREG | 0o666, None, "others may write to it (mode 0666)"),
    (stat.S_IFREG | 0o720, None, "others may write to it (mode 0720)"),
    (stat.S_IFLNK | 0o777, None, "symbolic link"),
    (stat.S_IFIFO | 0o600, None, "not a regular file"),
], ids=["foreign_owner", "world_writable", "group_writable", "symlink", "fifo"])
def test_only_a_private_regular_file_may_be_loaded(mode: int, uid: int | None, reason: str) -> None:
    assert reason in files.unsafe(_lstat(mode, uid))


def test_a_private_regular_file_may_be_loaded() -> None:
    assert files.unsafe(_lstat(stat.S_IFREG | 0o700)) is None
    assert files.unsafe(_lstat(stat.S_IFREG | 0o755)) is None


def test_a_unit_that_fails_silently_still_fails_the_build(tmp_path) -> None:
    """The units compile in parallel; one failing with no message is a failure all the same
    (named by its exit status), never mistaken for success."""
    units = [tmp_path / "a.cpp", tmp_path / "b.cpp"]
    for u in units:
        u.write_text("int f() { return 0; }\n")
    assert _build._compile_units(["false"], "-march=native", units) == "exit status 1"
    assert _build._run(["false"]) == "exit status 1"
