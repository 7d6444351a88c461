"""The CPU as ``/proc/cpuinfo`` describes it: what ``"auto"`` asks of the machine, and what the
native kernel's build is keyed on (:mod:`._build`). Read once, on first use; nothing happens
at import time.

What the built kernel itself says of the machine (its vector width, whether its bfloat16 loop
runs on AMX tiles) is asked of the loaded library: :mod:`.loader`.
"""

from __future__ import annotations

import functools

from ..._compile import constant_in_graphs

__all__ = ["cpuinfo", "cpu_vendor", "amx_bf16", "bf16_instructions", "BF16_FLAGS"]


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


@constant_in_graphs  # traced graphs take it as a constant (no file read in them)
def cpu_vendor() -> str:
    """The CPU's vendor as ``/proc/cpuinfo`` names it (``"GenuineIntel"``, ``"AuthenticAMD"``);
    ``""`` where it cannot be read. ``"auto"`` asks it: torch's own CPU kernels (MKL, oneDNN)
    run different code on different vendors' CPUs of the same vector width."""
    return cpuinfo().get("vendor_id", "")


@constant_in_graphs
def amx_bf16() -> bool:
    """Whether the CPU has AMX tiles for bfloat16 (``amx_bf16``), which oneDNN, and so torch's
    SDPA in bfloat16, runs on. ``"auto"`` asks it."""
    return "amx_bf16" in cpuinfo().get("flags", "").split()


#: The CPU flags of bfloat16 products in hardware (AVX512-BF16's dot products, AMX's tiles).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def bf16_instructions() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (one of :data:`BF16_FLAGS`). Without them
    torch emulates bfloat16 products in float32 arithmetic: with AVX2 alone, the bundled model's
    encoder in bfloat16 took 6.7x its float32 time (AMD EPYC, Zen 3, 2 threads)."""
    flags = cpuinfo().get("flags", "").split()
    return any(flag in flags for flag in BF16_FLAGS)
