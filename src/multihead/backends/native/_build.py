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
  folder that is not the user's own, or that others may write to, is never used;
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
import functools
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

__all__ = ["load"]

_COMPILE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=c++17")  # each unit, in parallel, with _march()
_LINK_FLAGS = ("-fopenmp", "-shared")
_ARCH = re.compile(r"[a-z0-9][a-z0-9.-]{0,39}")  # a -march CPU name
_SOURCES = ("common.h", "attention.cpp", "attention_amx.cpp", "decode.cpp", "backward.cpp")
_DIR_MODE = 0o700  # folders and the kernel: the user's only (umask can only remove bits; set explicitly)
_FILE_MODE = 0o700
_RECORD_MODE = 0o600


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields in ``/proc/cpuinfo`` (``"vendor_id"``, ``"model name"``,
    ``"flags"``, ...), read once; empty where it cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if not line.strip():  # the first processor ends
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


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


def _cache_dirs() -> list[Path]:
    """Where a build may go, in order of preference."""
    root = os.environ.get("MULTIHEAD_CACHE_DIR")
    first = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multihead"
    return [first, Path(tempfile.gettempdir()) / f"multihead-{os.getuid()}"]


def _private_dir(path: Path) -> bool:
    """Create ``path`` (and missing parents) with mode 0700; True if it is ours and no one
    else may write to it.

    A shared library is loaded from here: a folder others can write to could hand us
    theirs under the expected name.
    """
    try:
        for folder in reversed([path, *path.parents]):
            if not folder.exists():
                folder.mkdir(mode=_DIR_MODE)
                os.chmod(folder, _DIR_MODE)  # explicit: not whatever the umask leaves
        st = path.stat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022 \
        and os.access(path, os.W_OK)


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


def unsafe(st: os.stat_result) -> str | None:
    """Why a file with this ``lstat`` must not be loaded, or None: it must be a regular
    file (not a symlink), owned by the user and writable by no one else."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"others may write to it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


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


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    """``path`` holds ``data`` with ``mode``, all or nothing (a temporary file, then rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
            _write_atomically(_record_path(target), json.dumps({"size": size, "sha256": sha}).encode(),
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
    folder = next((d for d in _cache_dirs() if _private_dir(d)), None)
    if folder is None:
        return None, f"no private folder to build into (tried {', '.join(map(str, _cache_dirs()))})"
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
