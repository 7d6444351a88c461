"""Spawn a gloo world on 127.0.0.1 and run a table of cases in it (used by test_parallel*.py).

Starting a fresh interpreter is slow (about 4 s a process on 2 cores, most of it importing
torch), so the ranks are forked from one forkserver that has imported torch, multihead and the
case tables once for the session (each rank still a process of its own, with a fresh gloo group);
each world size is started once and its ranks run every case; each rank returns a dict of
results through a queue.
Every collective runs under the process group's timeout; the parent waits a bounded
time and kills its own children (by their process objects) if they do not finish.
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

from multihead.parallel.bench import start_measurable

#: Timeout of every collective in the children (a hang becomes an error after this).
COLLECTIVE_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, target: str, results: Any,
           collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        module, name = target.split(":")
        out = getattr(importlib.import_module(module), name)(rank, world_size)
        results.put((rank, out, None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


#: Imported once by the forkserver the ranks are forked from (not by each rank).
PRELOAD = ["torch", "torch.distributed", "multihead", "multihead.parallel", "parallel_harness", "parallel_cases",
           "parallel_agree_cases"]


def run_world(world_size: int, target: str, *, timeout_s: float = 170.0,
              collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> list[dict[str, Any]]:
    """Run ``target`` ("module:function", called as ``function(rank, world_size)``) on every rank.

    ``collective_timeout_s``: the process group's timeout in the children (a collective that
    some rank never enters fails after it).

    Returns:
        each rank's returned dict, by rank.

    Raises:
        RuntimeError: a rank raised (its traceback included) or the world did not finish.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # the forkserver starts with the first rank (start_measurable's env)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, target, results, collective_timeout_s),
                         daemon=True)
             for r in range(world_size)]
    start_measurable(procs)  # RSS high-water marks count live tensors
    got: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size:  # bounded: by the deadline, or a child that died without reporting
            try:
                rank, out, err = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    errors.append(f"world of {world_size}: ranks {dead} died, or no result within {timeout_s} s "
                                  f"(ranks done: {sorted(got)})")
                    break
                continue
            if err is not None:
                errors.append(f"rank {rank}:\n{err}")
            got[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise RuntimeError("\n".join(errors))
    return [got[r] for r in range(world_size)]
