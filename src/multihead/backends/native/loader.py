"""The native kernels' module: loaded on first use, and what it says of this machine.

:func:`loaded` imports the build :mod:`.isa` chooses (installed with the package, for this CPU's
vector width), or compiles the machine's own (:mod:`._build`, with a message: only where no
installed build runs here, or ``MULTIHEAD_NATIVE_ISA=machine``), once per process; every other
module asks :func:`library` (None where it cannot run here) or :func:`require` (raises, naming
:func:`status`). Nothing happens at import time.

What the loaded build reports of the machine lives here too: the vector width it was compiled
for (:func:`vector_bits`) and whether its bfloat16 loop runs on AMX tiles (:func:`amx`, switched
by :func:`amx_enabled`). What ``/proc/cpuinfo`` says is :mod:`.cpu`'s.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable, Iterator
from types import ModuleType

from ..._compile import constant_in_graphs
from . import isa
from ._ffi import MAX_STEP_ROWS

__all__ = ["loaded", "library", "require", "build", "available", "status", "vector_bits", "amx", "amx_enabled",
           "build_name", "compile_for_machine"]

#: Set by :func:`loaded` once the kernels are loaded (never loading them), for the facts asked
#: at every decoding step without a call of :func:`loaded`: the cache's counter writer
#: ``mh_advance_counters`` (:func:`.counters.advance_counters`; None before the kernels are
#: loaded), the vector width (:func:`vector_bits`, :func:`.attention.query_tile`) and the build.
counter_writer: Callable[..., int] | None = None
loaded_bits = 0
loaded_build = ""


def _import(name: str) -> tuple[ModuleType | None, str]:
    """The kernels' module of build ``name`` (:mod:`.isa`), or None with the reason."""
    if name == isa.MACHINE:
        from . import _build  # the compiler's driver: imported only where the machine's own build is used

        module, why = _build.load()
        if module is None and not os.environ.get(isa.ENV):
            why = f"no installed build runs on this CPU (installed: {', '.join(isa.installed()) or 'none'}); {why}"
        return module, why
    try:
        module = importlib.import_module(isa.module_name(name))
    except ImportError as err:
        return None, f"the installed {name} build cannot be loaded: {err}"
    return module, f"ready: the installed {name} build ({module.__file__})"


@functools.cache
def loaded() -> tuple[ModuleType | None, str]:
    """``(module, status)``: the kernels' module for this CPU, loaded, or None with the reason;
    once per process (``loaded.cache_clear()`` loads again).

    Raises:
        ValueError: ``MULTIHEAD_NATIVE_ISA`` names a build that cannot run here (:func:`.isa.chosen`).
    """
    global counter_writer, loaded_bits, loaded_build
    if os.environ.get("MULTIHEAD_NATIVE", "1") == "0":
        return None, "disabled by MULTIHEAD_NATIVE=0"
    name = isa.chosen()
    lib, why = _import(name)
    if lib is None:
        return None, why
    if lib.mh_max_step_rows() != MAX_STEP_ROWS:
        return None, f"the {name} build takes {lib.mh_max_step_rows()} step rows, this module {MAX_STEP_ROWS}"
    counter_writer, loaded_bits, loaded_build = lib.mh_advance_counters, int(lib.mh_vector_bits()), name
    return lib, why


def library() -> ModuleType | None:
    """The loaded kernels (loaded on first call), or None where they cannot run here."""
    return loaded()[0]


def build() -> bool:
    """Load the kernels now (instead of on first use): the installed build for this CPU, or the
    machine's own, compiled if it is not cached yet; True when available."""
    return library() is not None


def compile_for_machine() -> tuple[bool, str]:
    """Compile the machine's own build now (``-march=native``, into the cache folder: what
    ``multihead build --machine`` runs), or find it compiled and verified: ``(ok, status)``.
    Later processes use it where no installed build runs here, or with
    ``MULTIHEAD_NATIVE_ISA=machine``; this process keeps the build it loaded."""
    from . import _build

    module, why = _build.load()
    return module is not None, why


@constant_in_graphs
def available() -> bool:
    """Whether the native kernels can run here (loads them on first call)."""
    return library() is not None


def status() -> str:
    """Why the kernels are or are not available, and which build runs ("not loaded yet" before
    first use)."""
    return loaded()[1] if loaded.cache_info().currsize else "not loaded yet"


def build_name() -> str:
    """The build that runs here (``"avx2"``, ``"avx512"``, ``"amx"``, ``"baseline"``, ``"generic"``
    or ``"machine"``: :mod:`.isa`), ``""`` where none does; loads the kernels on first call."""
    return loaded_build if library() is not None else ""


def require() -> ModuleType:
    """The loaded kernels (loaded on first call).

    Raises:
        RuntimeError: the kernels are not available here, with :func:`status`'s reason.
    """
    lib = library()
    if lib is None:
        raise RuntimeError(f"the native kernel is not available: {status()}")
    return lib


@constant_in_graphs
def amx() -> bool:
    """Whether the bfloat16 FlashAttention loop runs on AMX tiles here (a build with AMX, the
    operating system's permission to use them, not switched off by :func:`amx_enabled`);
    otherwise it runs on AVX-512 (or narrower) vectors. ``"auto"`` asks it for bfloat16."""
    lib = library()
    return lib is not None and bool(lib.mh_amx_ready())


@contextlib.contextmanager
def amx_enabled(enabled: bool) -> Iterator[None]:
    """Within the block, the bfloat16 loop runs on AMX (``True``, where it can) or never
    (``False``: the AVX-512 loop, as on a CPU without AMX); restored after. Process-wide, for
    tests and measurements: not for concurrent use."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    lib = require()
    before = lib.mh_amx_switch(int(enabled))
    try:
        yield
    finally:
        lib.mh_amx_switch(before)


@constant_in_graphs
def vector_bits() -> int:
    """The SIMD width of the build that runs here: 512 (AVX-512), 256 or 128; 0 if the kernels
    are not available.

    Their register tiles are chosen at compile time for the width: AVX-512 (32 zmm
    registers) and AVX2 (16 ymm registers) each have their own, measured; narrower
    vectors run the AVX2 tiles split by the compiler, correct but not measured, so
    ``"auto"`` (its thresholds per width), the fused decoding step and the few-row
    projections only use the kernels at 512 and 256.
    """
    return 0 if library() is None else loaded_bits
