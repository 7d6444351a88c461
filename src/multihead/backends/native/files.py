"""The private cache folder and the files kept in it: the native kernel's builds
(:mod:`._build`) and :mod:`multihead.backends.gemm`'s verdicts.

A shared library is loaded from this folder, and what is read back from it decides which
code runs, so it is the user's only: folders are created with mode 0700 whatever the umask,
a folder that is not the user's own or that others may write to is never used, files are
written atomically and checked (:func:`unsafe`) before they are read. What a kept record
holds is read by :func:`read_record`, which turns any damage (deep nesting, numbers beyond
float range, binary garbage, a truncated or oversized file) into a ``ValueError`` for its
caller to discard and rebuild, never a ``RecursionError`` or ``OverflowError`` at every call.
:func:`locked` serialises the processes that would write one record at the same time.
Nothing happens at import time.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["cache_dirs", "private_dir", "unsafe", "write_atomically", "read_record", "locked", "MAX_RECORD_BYTES"]

#: The largest record :func:`read_record` reads (the records kept here are a few hundred bytes).
MAX_RECORD_BYTES = 1 << 20

_DIR_MODE = 0o700  # folders and the kernel: the user's only (umask can only remove bits; set explicitly)


def cache_dirs() -> list[Path]:
    """Where a build may go, in order of preference."""
    root = os.environ.get("MULTIHEAD_CACHE_DIR")
    first = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multihead"
    return [first, Path(tempfile.gettempdir()) / f"multihead-{os.getuid()}"]


def private_dir(path: Path) -> bool:
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


def write_atomically(path: Path, data: bytes, mode: int) -> None:
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


def read_record(path: Path, max_bytes: int = MAX_RECORD_BYTES) -> object:
    """The JSON value kept in ``path``, a safe file (:func:`unsafe`) of at most ``max_bytes``.

    Standard JSON only: NaN, infinities and numbers beyond float range (``1e400``) are refused,
    as is nesting deeper than Python's recursion limit, so what a damaged file holds can only
    make this raise ``ValueError``.

    Raises:
        FileNotFoundError: there is no ``path``.
        OSError: it cannot be read.
        ValueError: unsafe, too large, not UTF-8, not standard JSON or nested too deep; the
            message says which.
    """
    why = unsafe(os.lstat(path))
    if why is not None:
        raise ValueError(f"{path.name} is not a safe file: {why}")
    # No symlink followed, no FIFO waited on, and the file read is the one checked (fstat).
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        why = unsafe(os.fstat(f.fileno()))
        if why is not None:
            raise ValueError(f"{path.name} is not a safe file: {why}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{path.name} must be at most {max_bytes} bytes, got more")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:  # the C scanner's guard: [[[[...]]]] nested past the recursion limit
        raise ValueError(f"{path.name} is nested too deeply") from None
    except ValueError as err:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors
        raise ValueError(f"{path.name} is not standard JSON: {type(err).__name__}") from None


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is beyond float range")
    return value


@contextlib.contextmanager
def locked(path: Path) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (an ``flock``; the file is created 0600 if missing)
    while the block runs; yields False, unlocked, where the lock file cannot be opened.

    The lock is released when the block ends or the process dies, never left behind.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # releases the flock
