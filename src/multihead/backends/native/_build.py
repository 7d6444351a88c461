"""Building and loading the native kernels: compiler, private cache folder, hashed build.

The first call that needs the kernels compiles ``csrc/`` for this machine (``-O3
-march=native``, one or two seconds) into a cache folder, ``$MULTIHEAD_CACHE_DIR`` or
``~/.cache/multihead`` (or, if that cannot be written, a private folder under the
system's temporary folder), under a name that hashes the sources, the compiler and the
CPU's flags, so a shared home folder or an upgraded compiler never loads a stale or
foreign build. A folder that is not the user's own, or that others may write to, is
never used. Nothing happens at import time.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

__all__ = ["load"]

_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_SOURCES = ("common.h", "attention.cpp", "decode.cpp", "backward.cpp")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dirs() -> list[Path]:
    """Where a build may go, in order of preference."""
    root = os.environ.get("MULTIHEAD_CACHE_DIR")
    first = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multihead"
    return [first, Path(tempfile.gettempdir()) / f"multihead-{os.getuid()}"]


def _private_dir(path: Path) -> bool:
    """Create ``path`` if needed; True if it is ours and no one else may write to it.

    A shared library is loaded from here: a folder others can write to could hand us
    theirs under the expected name.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022 and os.access(path, os.W_OK)


def _compiler() -> tuple[str | None, str]:
    """The C++ compiler to use, or None with the reason."""
    if os.environ.get("MULTIHEAD_NATIVE", "1") == "0":
        return None, "disabled by MULTIHEAD_NATIVE=0"
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        return None, "no C++ compiler found (set CXX or install g++)"
    return compiler, ""


def _compile(compiler: str, sources: dict[str, bytes], folder: Path, target: Path) -> str | None:
    """Compile into ``target`` atomically; None on success, else the reason."""
    try:
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            for name, text in sources.items():
                (Path(tmp) / name).write_bytes(text)
            out = Path(tmp) / target.name
            units = [str(Path(tmp) / name) for name in _SOURCES if name.endswith(".cpp")]
            done = subprocess.run([compiler, *_FLAGS, "-o", str(out), *units], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                return f"compiling the native kernel failed: {done.stderr.strip()[-2000:]}"
            os.replace(out, target)  # atomic: concurrent builders each write a whole file
    except (OSError, subprocess.SubprocessError) as err:
        return f"building the native kernel failed: {err}"
    return None


def load() -> tuple[ctypes.CDLL | None, str]:
    """Compile (once per machine and source) and load the kernels: ``(library, status)``,
    the library None when they cannot be used here, the status saying why (or where from)."""
    compiler, reason = _compiler()
    if compiler is None:
        return None, reason
    csrc = resources.files("multihead.backends.native").joinpath("csrc")
    sources = {name: csrc.joinpath(name).read_bytes() for name in _SOURCES}
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"compiler {compiler!r} does not run: {err}"
    key = hashlib.sha256(b"\0".join([*sources.values(), version.encode(), " ".join(_FLAGS).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:20]
    folder = next((d for d in _cache_dirs() if _private_dir(d)), None)
    if folder is None:
        return None, f"no private folder to build into (tried {', '.join(map(str, _cache_dirs()))})"
    target = folder / f"attention-{key}.so"
    if not target.exists():
        failure = _compile(compiler, sources, folder, target)
        if failure is not None:
            return None, failure
    try:
        return ctypes.CDLL(str(target)), f"ready: {target}"
    except OSError as err:
        return None, f"loading {target} failed: {err}"
