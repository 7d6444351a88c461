"""Building and loading the native kernels: compiler, private cache folder, verified build.

The first call that needs the kernels compiles ``csrc/`` for this machine (``-O3
-march=native``, or ``$MULTIHEAD_NATIVE_ARCH``; its units in parallel: about 13 s on 2 cores) into a cache
folder, ``$MULTIHEAD_CACHE_DIR`` or
``~/.cache/multihead`` (or, if that cannot be written, a private folder under the
system's temporary folder), under a name that hashes the sources, the compiler and the
CPU's flags, so a shared home folder or an upgraded compiler never loads a stale or
foreign build. Nothing happens at import time.

What is loaded is checked first, since loading runs its code and a damaged file kills
the process (SIGBUS) instead of raising:

* folders are created with mode 0700 and files with 0700/0600, whatever the umask; a
  folder that is not the user's own, or that others may write to, is never used
  (:mod:`.files`: the cache folder and its files);
* the kernel file must be a regular file (not a symlink), owned by the user, writable by
  no one else, and match the size and SHA-256 recorded when it was built (the record is
  written atomically beside it). Anything else is rebuilt, the reason kept in the status
  (:func:`multihead.backends.native.status`); if the rebuild fails the kernel is off and
  the status says why.

``$CXX`` may be a command with arguments (``"ccache g++"``): it is split as a shell
would (:func:`shlex.split`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from .cpu import cpuinfo
from .files import cache_dirs, private_dir, unsafe, write_atomically

__all__ = ["load"]

_COMPILE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=c++17")  # each unit, in parallel, with _march()
_LINK_FLAGS = ("-fopenmp", "-shared")
_ARCH = re.compile(r"[a-z0-9][a-z0-9.-]{0,39}")  # a -march CPU name
_SOURCES = ("common.h", "attention.cpp", "attention_amx.cpp", "decode.cpp", "backward.cpp")
_FILE_MODE = 0o700  # the kernel: the user's only (umask can only remove bits; set explicitly)
_RECORD_MODE = 0o600


def _cpu_flags() -> str:
    return cpuinfo().get("flags") or platform.processor() or platform.machine()


def _march() -> str:
    """``-march=native``, or ``-march=$MULTIHEAD_NATIVE_ARCH`` (e.g. ``haswell`` on an AVX-512
    machine: the AVX2 kernels, so that the tests can run the other width's code here too).
    The build's name hashes it. A value that is not a plain CPU name is refused."""
    arch = os.environ.get("MULTIHEAD_NATIVE_ARCH", "native")
    if not _ARCH.fullmatch(arch):
        raise ValueError(f"MULTIHEAD_NATIVE_ARCH must name a CPU for -march (letters, digits, '.', '-'), got {arch!r}")
    return f"-march={arch}"


def _compiler() -> tuple[list[str] | None, str]:
    """The C++ compiler command (``$CXX`` split as a shell would), or None with the reason."""
    if os.environ.get("MULTIHEAD_NATIVE", "1") == "0":
        return None, "disabled by MULTIHEAD_NATIVE=0"
    cxx = os.environ.get("CXX")
    if cxx:
        try:
            command = shlex.split(cxx)
        except ValueError as err:
            return None, f"CXX={cxx!r} is not a valid command line ({err})"
        if not command:
            return None, f"CXX={cxx!r} names no compiler"
        if shutil.which(command[0]) is None:
            return None, f"CXX={cxx!r}: program {command[0]!r} not found"
        return command, ""
    found = shutil.which("g++") or shutil.which("c++")
    if not found:
        return None, "no C++ compiler found (set CXX or install g++)"
    return [found], ""


def _digest(path: Path) -> tuple[int, str]:
    data = path.read_bytes()
    return len(data), hashlib.sha256(data).hexdigest()


def _record_path(target: Path) -> Path:
    return target.with_suffix(".json")


def _verify(target: Path) -> str | None:
    """None if ``target`` may be loaded: safe (:func:`unsafe`) and exactly the file its build
    recorded (size and SHA-256); else why not."""
    st = os.lstat(target)
    why = unsafe(st)
    if why is not None:
        return why
    record_file = _record_path(target)
    try:
        if unsafe(os.lstat(record_file)) is not None:
            return f"its build record {record_file.name} is not a safe file"
        record = json.loads(record_file.read_text())
        size, sha = int(record["size"]), str(record["sha256"])
    except FileNotFoundError:
        return "it has no build record (size and SHA-256)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its build record is unreadable ({type(err).__name__})"
    got_size, got_sha = _digest(target)
    if got_size != size:
        return f"it is {got_size} bytes, its build recorded {size} (truncated or damaged)"
    if got_sha != sha:
        return "its SHA-256 differs from the one its build recorded (damaged or replaced)"
    return None


def _run_all(commands: list[list[str]]) -> str:
    """Run build commands all at once: "" when every one succeeds, else the first failure's
    message (its stderr, or its exit status). Every command is waited for."""
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in commands]
    errors = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err = f"timed out after 300 s. {err}"
        if proc.returncode != 0:
            errors.append(err.strip() or f"exit status {proc.returncode}")
    return errors[0] if errors else ""


def _compile_units(compiler: list[str], march: str, units: list[Path]) -> str:
    """Compile each unit to its ``.o`` beside it, in parallel (they take 5-8 s each at -O3)."""
    return _run_all([[*compiler, *_COMPILE_FLAGS, march, "-c", "-o", str(u.with_suffix(".o")), str(u)]
                     for u in units])


def _run(command: list[str]) -> str:
    """Run one build command: "" on success, else its message."""
    return _run_all([command])


def _compile(compiler: list[str], march: str, sources: dict[str, bytes], folder: Path, target: Path) -> str | None:
    """Compile into ``target`` (mode 0700) and record its size and SHA-256, each written
    atomically; None on success, else the reason."""
    try:
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            for name, text in sources.items():
                (Path(tmp) / name).write_bytes(text)
            out = Path(tmp) / target.name
            units = [Path(tmp) / name for name in _SOURCES if name.endswith(".cpp")]
            failed = _compile_units(compiler, march, units) or _run(
                [*compiler, *_LINK_FLAGS, "-o", str(out), *(str(u.with_suffix(".o")) for u in units)])
            if failed:
                return f"compiling the native kernel failed ({shlex.join(compiler)}): {failed[-2000:]}"
            size, sha = _digest(out)
            os.chmod(out, _FILE_MODE)
            # The record first: a reader that finds the new kernel finds its record.
            write_atomically(_record_path(target), json.dumps({"size": size, "sha256": sha}).encode(),
                              _RECORD_MODE)
            os.replace(out, target)  # atomic: concurrent builders each write a whole file
    except (OSError, subprocess.SubprocessError) as err:
        return f"building the native kernel failed ({shlex.join(compiler)}): {err}"
    return None


def load() -> tuple[ctypes.CDLL | None, str]:
    """Compile (once per machine and source), verify and load the kernels: ``(library,
    status)``, the library None when they cannot be used here, the status saying why (or
    where from, and why it was rebuilt)."""
    compiler, reason = _compiler()
    if compiler is None:
        return None, reason
    try:
        march = _march()
    except ValueError as err:
        return None, str(err)
    csrc = resources.files("multihead.backends.native").joinpath("csrc")
    sources = {name: csrc.joinpath(name).read_bytes() for name in _SOURCES}
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"compiler {shlex.join(compiler)!r} does not run: {err}"
    key = hashlib.sha256(b"\0".join([*sources.values(), shlex.join(compiler).encode(), version.encode(),
                                     " ".join((*_COMPILE_FLAGS, march, *_LINK_FLAGS)).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:20]
    folder = next((d for d in cache_dirs() if private_dir(d)), None)
    if folder is None:
        return None, f"no private folder to build into (tried {', '.join(map(str, cache_dirs()))})"
    target = folder / f"attention-{key}.so"
    rebuilt = ""
    if os.path.lexists(target):
        why = _verify(target)
        if why is not None:
            rebuilt = f" (rebuilt: the cached build was refused: {why})"
    if rebuilt or not os.path.lexists(target):
        failure = _compile(compiler, march, sources, folder, target)
        if failure is not None:
            return None, failure + rebuilt
        why = _verify(target)  # what is loaded is exactly what was just built
        if why is not None:
            return None, f"the kernel just built at {target} cannot be loaded: {why}"
    try:
        return ctypes.CDLL(str(target)), f"ready: {target}{rebuilt}"
    except OSError as err:
        return None, f"loading {target} failed: {err}"
