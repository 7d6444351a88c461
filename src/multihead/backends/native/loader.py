"""The native kernel's library: built and loaded on first use, and what it says of this machine.

:func:`loaded` builds (:mod:`._build`), loads and declares (:mod:`._ffi`) the library once per
process; every other module asks :func:`library` (None where it cannot run here) or
:func:`require` (raises, naming :func:`status`). Nothing happens at import time.

What the built library reports of the machine lives here too: the vector width it was compiled
for (:func:`vector_bits`) and whether its bfloat16 loop runs on AMX tiles (:func:`amx`, switched
by :func:`amx_enabled`). What ``/proc/cpuinfo`` says is :mod:`.cpu`'s.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from . import _build, _ffi
from ._ffi import MAX_STEP_ROWS

__all__ = ["loaded", "library", "require", "build", "available", "status", "vector_bits", "amx", "amx_enabled"]

#: Set by :func:`loaded` once the library is loaded (never building it), for the two facts asked
#: at every decoding step without a call of :func:`loaded`: the cache's counter writer
#: ``mh_advance_counters`` (:func:`.counters.advance_counters`; None before the library is
#: loaded) and the vector width (:func:`vector_bits`, :func:`.attention.query_tile`).
counter_writer: Callable[..., int] | None = None
loaded_bits = 0


@functools.cache
def loaded() -> tuple[object | None, str]:
    """``(library, status)``: the library built (once per machine and source, :mod:`._build`),
    loaded and declared, or None with the reason; once per process (``loaded.cache_clear()``
    loads again)."""
    global counter_writer, loaded_bits
    lib, why = _build.load()
    if lib is None:
        return None, why
    _ffi.declare(lib)
    if lib.mh_max_step_rows() != MAX_STEP_ROWS:
        return None, f"the built kernel takes {lib.mh_max_step_rows()} step rows, this module {MAX_STEP_ROWS}"
    counter_writer, loaded_bits = lib.mh_advance_counters, int(lib.mh_vector_bits())
    return lib, why


def library():  # type: ignore[no-untyped-def]
    """The loaded library (built on first call), or None where it cannot run here."""
    return loaded()[0]


def build() -> bool:
    """Build and load the kernel now (instead of on first use); True when available."""
    return library() is not None


@torch.compiler.assume_constant_result  # traced graphs take it as a constant: no ctypes in them
def available() -> bool:
    """Whether the native kernel can run here (builds it on first call)."""
    return library() is not None


def status() -> str:
    """Why the kernel is or is not available ("not built yet" before first use)."""
    return loaded()[1] if loaded.cache_info().currsize else "not built yet"


def require():  # type: ignore[no-untyped-def]
    """The loaded library (built on first call).

    Raises:
        RuntimeError: the kernel is not available here, with :func:`status`'s reason.
    """
    lib = library()
    if lib is None:
        raise RuntimeError(f"the native kernel is not available: {status()}")
    return lib


@torch.compiler.assume_constant_result
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


@torch.compiler.assume_constant_result
def vector_bits() -> int:
    """The SIMD width the kernels were compiled for here: 512 (AVX-512), 256 or 128; 0 if
    they are not available.

    Their register tiles are chosen at compile time for the width: AVX-512 (32 zmm
    registers) and AVX2 (16 ymm registers) each have their own, measured; narrower
    vectors run the AVX2 tiles split by the compiler, correct but not measured, so
    ``"auto"`` (its thresholds per width), the fused decoding step and the few-row
    projections only use the kernels at 512 and 256.
    """
    return 0 if library() is None else loaded_bits
