"""The private cache folder and the files kept in it: the native kernel's builds
(:mod:`._build`) and :mod:`multihead.backends.gemm`'s verdicts.

A shared library is loaded from this folder, and what is read back from it decides which
code runs, so it is the user's only: folders are created with mode 0700 whatever the umask,
a folder that is not the user's own or that others may write to is never used, files are
written atomically and checked (:func:`unsafe`) before they are read. Nothing happens at
import time.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

__all__ = ["cache_dirs", "private_dir", "unsafe", "write_atomically"]

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
