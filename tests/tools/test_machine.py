"""What a benchmark records about the machine, and the memory probe both benchmarks use (Linux)."""

from __future__ import annotations

import mmap
import os
import time

import pytest
import torch

from multihead.tools import machine


def test_machine_info_names_versions_cpu_and_threads() -> None:
    info = machine.machine_info()
    assert info["torch"] == torch.__version__ and info["torch_threads"] == torch.get_num_threads()
    assert isinstance(info["cpu"], str) and info["cpu"]
    assert set(info["vector_features"]) <= set(machine.VECTOR_FEATURES)
    assert info["native_vector_bits"] in (0, 128, 256, 512)


def test_the_peak_counts_what_was_allocated_after_the_reset() -> None:
    machine.reset_peak_rss()
    base = machine.rss("VmRSS:")
    # Fresh anonymous pages, every one written: a tensor could reuse pages the allocator already
    # holds resident (late in a long test process), and then the mark rightly would not move.
    block = mmap.mmap(-1, 64 << 20)
    block.write(b"\1" * (64 << 20))
    assert machine.rss("VmHWM:") - base >= 60 << 20
    block.close()
    machine.reset_peak_rss()  # the mark drops to the RSS of now, whatever the allocator kept
    assert machine.rss("VmHWM:") <= machine.rss("VmRSS:") + (8 << 20)


def test_an_unknown_status_field_is_refused_by_name() -> None:
    with pytest.raises(OSError, match="VmNothing:"):
        machine.rss("VmNothing:")


def test_others_load_sees_a_competing_process() -> None:
    """One CPU-bound process beside an idle block: the block reports others using about one core."""
    import subprocess
    import sys

    from multihead.tools.machine import OthersLoad

    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.5)  # the competitor is running
        with OthersLoad() as load:
            time.sleep(1.0)  # this process idles: what the machine did was someone else's
    finally:
        spin.kill()
        spin.wait()
    cores = os.cpu_count() or 1
    assert load.share is not None and load.share > 0.6 / cores and load.busy



def test_the_competing_process_runs_during_the_block_and_is_ended_after() -> None:
    with machine.competing_process() as proc:
        assert proc is not None and proc.poll() is None
    assert proc.poll() is not None
    with machine.competing_process(False) as none:
        assert none is None


@pytest.mark.parametrize("share, note", [
    (None, None), (0.0, None), (machine.BUSY_SHARE, None),
    (0.37, "other processes used 37% of the CPUs meanwhile (busy: these figures are not a verdict)"),
])
def test_the_busy_note_is_said_only_over_the_busy_share(share: float | None, note: str | None) -> None:
    assert machine.busy_note(share) == note


@pytest.mark.parametrize("share, competing, note", [
    (None, False, "other processes' use of the CPUs is unknown"),
    (0.02, False, "other processes used 2% of the CPUs meanwhile"),
    (0.37, False, "other processes used 37% of the CPUs meanwhile (busy: these figures are not a verdict)"),
    (0.45, True, "other processes used 45% of the CPUs meanwhile (the competing process included)"),
    (None, True, "other processes' use of the CPUs is unknown (the competing process included)"),
])
def test_every_timing_says_the_load_in_one_wording(share: float | None, competing: bool, note: str) -> None:
    assert machine.load_note(share, competing) == note
