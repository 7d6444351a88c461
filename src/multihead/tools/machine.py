"""What runs a benchmark: the machine's description and this process's memory.

Notation: none (no tensors here).

The suite (:mod:`multihead.tools.bench`) and the parallel benchmark
(:mod:`multihead.parallel.bench`) both record :func:`machine_info` with their results and
measure a call's peak memory as :func:`rss` ``("VmHWM:")`` after :func:`reset_peak_rss`,
minus :func:`rss` ``("VmRSS:")`` before it (Linux's ``/proc/self``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["VECTOR_FEATURES", "cpu_model", "machine_info", "rss", "reset_peak_rss", "OthersLoad", "BUSY_SHARE",
           "competing_process", "COMPETING_MAX_S", "busy_note", "load_note", "is_busy"]

#: Other processes using more than this share of the machine's CPUs make a timing unreliable.
BUSY_SHARE = 0.10

#: A competing process (:func:`competing_process`) ends after this many seconds even if its block did not end it.
COMPETING_MAX_S = 6 * 3600.0

_SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"

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


def _cpu_seconds() -> float | None:
    """Busy CPU time of the whole machine so far (all cores; Linux's /proc/stat), or None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 5:
        return None
    ticks = [int(x) for x in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    busy = sum(ticks[:8]) - idle  # user nice system idle iowait irq softirq steal; guests are in user
    return busy / os.sysconf("SC_CLK_TCK")


def _helpers_cpu_seconds(pids: Sequence[int]) -> float:
    """CPU time (user + system) of the processes ``pids`` so far (Linux's /proc/PID/stat; 0 for
    one that is gone or where the machine does not tell)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


class OthersLoad:
    """How much of the machine other processes used while a block ran: their CPU time (the
    machine's busy time less this process's and its ``helpers``') over the block's wall time ×
    the cores.

    ``with OthersLoad() as load: ...`` then ``load.share`` (0 = nobody else; None where the
    machine does not tell, e.g. not Linux) and ``load.busy`` (over :data:`BUSY_SHARE`).

    Args:
        helpers: ids of processes that work for this one (e.g. the benchmark's peer workers):
            their CPU time counts as this process's, not as others'.
    """

    def __init__(self, helpers: Sequence[int] = ()) -> None:
        self.share: float | None = None
        self._helpers = tuple(helpers)

    def __enter__(self) -> "OthersLoad":
        self._wall, self._all = time.perf_counter(), _cpu_seconds()
        self._mine = time.process_time() + _helpers_cpu_seconds(self._helpers)
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._wall
        mine = time.process_time() + _helpers_cpu_seconds(self._helpers) - self._mine
        end = _cpu_seconds()
        if self._all is None or end is None or wall <= 0:
            return
        cores = os.cpu_count() or 1
        self.share = max(0.0, min(1.0, (end - self._all - mine) / (wall * cores)))

    @property
    def busy(self) -> bool:
        """Other processes used more than :data:`BUSY_SHARE` of the CPUs during the block."""
        return is_busy(self.share)


def load_note(share: float | None, competing: bool = False) -> str:
    """How much of the CPUs other processes used while a timing ran (``share``, as :class:`OthersLoad`
    measures it; None: unknown), as every timing's output says it: with "the competing process
    included" beside one, or "busy: these figures are not a verdict" above :data:`BUSY_SHARE`."""
    text = ("other processes' use of the CPUs is unknown" if share is None
            else f"other processes used {share:.0%} of the CPUs meanwhile")
    if competing:
        return f"{text} (the competing process included)"
    return f"{text} (busy: these figures are not a verdict)" if is_busy(share) else text


def is_busy(share: float | None) -> bool:
    """Whether other processes used more than :data:`BUSY_SHARE` of the CPUs (``share``; None: unknown)."""
    return share is not None and share > BUSY_SHARE


def busy_note(share: float | None) -> str | None:
    """:func:`load_note` for a timing whose output only speaks of the load when the machine was
    busy (``share`` above :data:`BUSY_SHARE`); None when it was not."""
    return load_note(share) if is_busy(share) else None


@contextlib.contextmanager
def competing_process(on: bool = True) -> Iterator[subprocess.Popen[bytes] | None]:
    """One CPU-bound process beside the block where ``on`` (a Python spinning on one core, killed
    when the block ends, alive :data:`COMPETING_MAX_S` at most), for timings under load; None where off."""
    if not on:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(COMPETING_MAX_S)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
