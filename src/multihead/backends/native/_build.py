"""The machine's own build of the native kernels: compiled here, kept in a private cache folder,
verified before it is loaded.

The package installs builds for every vector width (:mod:`.isa`); this one is compiled only where
none of them runs here (the package was installed without a C++ compiler), or where
``MULTIHEAD_NATIVE_ISA=machine`` asks for it: ``csrc/`` for this machine (``-O3 -march=native``,
or ``$MULTIHEAD_NATIVE_ARCH``; its units in parallel: about 15 s on 2 cores, announced on the
``multihead`` logger, which Python prints to stderr unless logging is configured) as the Python
module ``_kernels_machine``, into a cache folder, ``$MULTIHEAD_CACHE_DIR`` or
``~/.cache/multihead`` (or, if that cannot be written, a private folder under the system's
temporary folder), under a name that hashes the sources, the compiler, the Python ABI and the
CPU's flags, so a shared home folder or an upgraded compiler never loads a stale or foreign
build. ``multihead build`` compiles it ahead. Nothing happens at import time.

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

import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import time
from importlib import resources
from pathlib import Path
from types import ModuleType

from .cpu import cpuinfo
from .files import cache_dirs, private_dir, read_record, unsafe, write_atomically
from .isa import MACHINE, module_name

__all__ = ["load"]

_MODULE = f"_kernels_{MACHINE}"
_COMPILE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=c++17", f"-DMH_MODULE={_MODULE}")  # each unit, with _march()
_LINK_FLAGS = ("-fopenmp", "-shared")
_ARCH = re.compile(r"[a-z0-9][a-z0-9.-]{0,39}")  # a -march CPU name
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SOURCES = ("common.h", "kernels.h", "module.cpp", "attention.cpp", "attention_amx.cpp", "decode.cpp", "backward.cpp")
_LOG = logging.getLogger("multihead")
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
        record = read_record(record_file)  # any damage is a ValueError: the kernel is rebuilt
    except FileNotFoundError:
        return "it has no build record (size and SHA-256)"
    except (OSError, ValueError) as err:
        return f"its build record is unreadable ({err})"
    recorded = _recorded(record)
    if recorded is None:
        return (f"its build record is unreadable (a {type(record).__name__}, not "
                "{\"size\": an int >= 0, \"sha256\": 64 hex digits})")
    (size, sha), (got_size, got_sha) = recorded, _digest(target)
    if got_size != size:
        return f"it is {got_size} bytes, its build recorded {size} (truncated or damaged)"
    if got_sha != sha:
        return "its SHA-256 differs from the one its build recorded (damaged or replaced)"
    return None


def _recorded(record: object) -> tuple[int, str] | None:
    """(size, SHA-256) of a build record ``{"size": int >= 0, "sha256": 64 hex digits}``, or None."""
    if not isinstance(record, dict):
        return None
    size, sha = record.get("size"), record.get("sha256")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return None
    return (size, sha) if isinstance(sha, str) and _SHA256.fullmatch(sha) else None


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
    include = f"-I{sysconfig.get_paths()['include']}"
    return _run_all([[*compiler, *_COMPILE_FLAGS, include, march, "-c", "-o", str(u.with_suffix(".o")), str(u)]
                     for u in units])


def _python_headers() -> str | None:
    """Why this Python's headers cannot be compiled against, or None."""
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return None if header.is_file() else f"this Python's headers are not installed ({header} is missing)"


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


def _import(target: Path) -> ModuleType:
    """The extension module in ``target`` (a verified build), loaded as ``_kernels_machine``."""
    loader = importlib.machinery.ExtensionFileLoader(module_name(MACHINE), str(target))
    spec = importlib.util.spec_from_file_location(module_name(MACHINE), target, loader=loader)
    if spec is None:
        raise ImportError(f"no module spec for {target}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _key(compiler: list[str], version: str, march: str, sources: dict[str, bytes]) -> str:
    """The build's name: a hash of what it depends on (sources, compiler, flags, Python, CPU)."""
    parts = [*sources.values(), shlex.join(compiler).encode(), version.encode(),
             " ".join((*_COMPILE_FLAGS, march, *_LINK_FLAGS)).encode(), _cpu_flags().encode(),
             str(sysconfig.get_config_var("EXT_SUFFIX")).encode(), sysconfig.get_paths()["include"].encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def _prepare() -> tuple[list[str], str, dict[str, bytes], str] | str:
    """``(compiler, march, sources, version)`` of the build, or why it cannot be made here."""
    compiler, reason = _compiler()
    if compiler is None:
        return reason
    try:
        march = _march()
    except ValueError as err:
        return str(err)
    headers = _python_headers()
    if headers is not None:
        return headers
    csrc = resources.files("multihead.backends.native").joinpath("csrc")
    sources = {name: csrc.joinpath(name).read_bytes() for name in _SOURCES}
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"compiler {shlex.join(compiler)!r} does not run: {err}"
    return compiler, march, sources, version


def _build_announced(compiler: list[str], march: str, sources: dict[str, bytes], folder: Path,
                     target: Path) -> str | None:
    """:func:`_compile`, announced before and after on the ``multihead`` logger (never silent)."""
    _LOG.warning("multihead: compiling the native kernels for this machine (%s, about 15 s on 2 cores, once; "
                 "`multihead build` does it ahead) into %s", march, folder)
    start = time.perf_counter()
    failure = _compile(compiler, march, sources, folder, target)
    if failure is None:
        _LOG.warning("multihead: the native kernels were compiled in %.1f s", time.perf_counter() - start)
    else:
        _LOG.warning("multihead: compiling the native kernels failed; the torch paths run instead (%s)",
                     failure[:300])
    return failure


def load() -> tuple[ModuleType | None, str]:
    """Compile (once per machine and source), verify and load the machine's build: ``(module,
    status)``, the module None when it cannot be made here, the status saying why (or where
    from, and why it was rebuilt)."""
    prepared = _prepare()
    if isinstance(prepared, str):
        return None, f"the machine's own build cannot be compiled: {prepared}"
    compiler, march, sources, version = prepared
    folder = next((d for d in cache_dirs() if private_dir(d)), None)
    if folder is None:
        return None, f"no private folder to build into (tried {', '.join(map(str, cache_dirs()))})"
    target = folder / f"attention-{_key(compiler, version, march, sources)}.so"
    rebuilt = ""
    if os.path.lexists(target):
        why = _verify(target)
        if why is not None:
            rebuilt = f" (rebuilt: the cached build was refused: {why})"
    if rebuilt or not os.path.lexists(target):
        failure = _build_announced(compiler, march, sources, folder, target)
        if failure is not None:
            return None, failure + rebuilt
        why = _verify(target)  # what is loaded is exactly what was just built
        if why is not None:
            return None, f"the kernel just built at {target} cannot be loaded: {why}"
    try:
        return _import(target), f"ready: the machine's own build ({target}){rebuilt}"
    except ImportError as err:
        return None, f"loading {target} failed: {err}"
