"""What runs a benchmark: the machine's description and this process's memory.

Notation: none (no tensors here).

The suite (:mod:`multihead.tools.bench`) and the parallel benchmark
(:mod:`multihead.parallel.bench`) both record :func:`machine_info` with their results and
measure a call's peak memory as :func:`rss` ``("VmHWM:")`` after :func:`reset_peak_rss`,
minus :func:`rss` ``("VmRSS:")`` before it (Linux's ``/proc/self``).
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

__all__ = ["VECTOR_FEATURES", "cpu_model", "machine_info", "rss", "reset_peak_rss"]

#: The vector features the kernels (or their peers) can use, as /proc/cpuinfo names them.
VECTOR_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                   "amx_tile", "amx_bf16")


def cpu_model() -> tuple[str, list[str]]:
    """The CPU's model name and which of :data:`VECTOR_FEATURES` it has (Linux; else the platform's words)."""
    from ..backends.native.cpu import cpuinfo

    info = cpuinfo()
    flags = set(info.get("flags", "").split())
    return info.get("model name") or platform.processor() or platform.machine(), [f for f in VECTOR_FEATURES
                                                                                   if f in flags]


def machine_info() -> dict[str, Any]:
    """What ran the benchmark: versions, CPU model and vector features, cores and torch threads."""
    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = None
    from ..backends import native
    from ..backends.gemm import onednn_usable, gemm_choice

    model, features = cpu_model()
    return {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": hf,
        "cpu": model, "vector_features": features, "native_vector_bits": native.vector_bits(),
        "native_build": native.build_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "onednn": onednn_usable(), "gemm": gemm_choice(),
    }


def rss(field: str) -> int:
    """This process's memory in bytes under ``field`` of ``/proc/self/status``: ``"VmRSS:"``
    (resident now) or ``"VmHWM:"`` (the high-water mark).

    Raises:
        OSError: ``field`` is not in the file (or the file is absent: not Linux).
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> None:
    """Reset this process's high-water mark (``VmHWM``) to its current RSS (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
