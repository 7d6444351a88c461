"""Benchmark of multihead.parallel: ring attention's per-rank memory, time and bytes sent,
and the head-parallel layer's time, each world spawned fresh on 127.0.0.1 (gloo).

Notation: B batch (1), H heads, S tokens, D head dim, P ranks, E embed dim.

* ring: causal, zigzag, float32, B=1, H=Hkv=8, D=64, S in (16384, 32768), P in (1, 2, 4, 8):
  each rank's peak RSS increase during one forward call (its own shard of q, k, v
  allocated inside the measured region, as a rank would hold them), its time, and the
  bytes it sends around the ring against the theory: (P-1)/P of K and V. The peak is
  compared with what the design holds (:func:`ring_model_bytes`): q, k, v and the output
  of S/P tokens, plus the foreign K/V shards in flight — one at P = 2 (one exchange), two
  from P = 3 on (the shard in use and the one arriving, which is what lets the transfer
  overlap the compute); at P = 1 the ring is not used (plain attention: q, k, v, out).
* heads: a layer E=1024, H=16, S=2048, float32 forward, P in (1, 2).

With fewer cores than ranks the times measure the scheduler, not the algorithm
(:func:`run` reports times only where P <= cores). Nothing here prints.
"""

from __future__ import annotations

import gc
import os
import queue
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ..tools.machine import machine_info, reset_peak_rss, rss

__all__ = ["run", "format_report", "ring_model_bytes"]


def ring_model_bytes(seq: int, world: int, heads: int, head_dim: int, itemsize: int = 4) -> int:
    """The bytes a rank of ring attention holds by design (no temporaries), B = 1, H = Hkv.

    ``(4 + 2·min(P - 1, 2)) · (S / P) · H · D · itemsize``: this rank's q, k, v and output,
    plus K and V of ``min(P - 1, 2)`` foreign shards in flight. Per rank it falls as 1/P once
    the number of buffers in flight is constant (P >= 3); from P = 1 to 2 and 2 to 3 it
    falls less, since the ring adds one buffer each time.
    """
    shard = -(-seq // world) * heads * head_dim * itemsize
    return (4 + 2 * min(world - 1, 2)) * shard


def _ring_rank(rank: int, p: int, seq: int, heads: int, head_dim: int) -> dict[str, Any]:
    import torch.distributed as dist

    from . import ring_attention
    from .layout import shard_sizes

    sent = [0]
    original = dist.batch_isend_irecv

    # (the parameter keeps batch_isend_irecv's name: callers may pass it by keyword)
    def counting(p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:  # bytes this rank sends
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in p2p_op_list if op.op is dist.isend)
        return original(p2p_op_list)

    warm = [torch.randn(1, heads, 4 * 2 * p, head_dim) for _ in range(3)]
    ring_attention(*(t[:, :, :8] for t in warm), causal=True)  # kernels loaded before the baseline
    dist.batch_isend_irecv = counting
    n = shard_sizes(seq, p, "zigzag")[rank]
    gc.collect()
    dist.barrier()
    base = rss("VmRSS:")
    reset_peak_rss()
    with torch.no_grad():
        q, k, v = (torch.randn(1, heads, n, head_dim) for _ in range(3))
        t0 = time.perf_counter()
        out = ring_attention(q, k, v, causal=True, layout="zigzag")
        seconds = time.perf_counter() - t0
    peak = rss("VmHWM:") - base
    dist.batch_isend_irecv = original
    kv_bytes = 2 * heads * seq * head_dim * 4
    return {"case": "ring", "seq": seq, "world": p, "rank": rank, "peak_bytes": peak, "seconds": seconds,
            "sent_bytes": sent[0], "theory_bytes": kv_bytes * (p - 1) // p, "shard_bytes": 4 * q.nbytes,
            "out_ok": bool(torch.isfinite(out).all())}


def _heads_rank(rank: int, p: int, embed: int, heads: int, seq: int, reps: int) -> dict[str, Any]:
    import multihead as mh

    from . import shard_heads

    torch.manual_seed(0)
    layer = mh.MultiHeadAttention(embed, heads, causal=True)
    hp = shard_heads(layer)
    x = torch.randn(1, seq, embed)
    times = []
    with torch.no_grad():
        hp(x)
        for _ in range(reps):
            t0 = time.perf_counter()
            hp(x)
            times.append(time.perf_counter() - t0)
    return {"case": "heads", "world": p, "rank": rank, "seq": seq, "embed": embed, "heads": heads,
            "seconds": sorted(times)[len(times) // 2]}


def _child(rank: int, p: int, port: int, job: tuple, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p,
                                timeout=timedelta(seconds=600))
        runners: dict[str, Callable[..., dict[str, Any]]] = {"ring": _ring_rank, "heads": _heads_rank}
        fn = runners[job[0]]
        results.put((rank, fn(rank, p, *job[1:]), None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, None, repr(exc)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_measurable(procs: list[Any]) -> None:
    """Start processes with a fixed mmap threshold: every large tensor is then mapped and
    unmapped, so a process's RSS high-water mark counts its live tensors, not glibc's heap
    keeping freed blocks (its dynamic threshold)."""
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 17)
    try:
        for proc in procs:
            proc.start()
    finally:
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def _spawn(p: int, job: tuple, timeout_s: float = 900.0) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_child, args=(r, p, port, job, results), daemon=True) for r in range(p)]
    start_measurable(procs)
    got: dict[int, Any] = {}
    try:
        for _ in range(p):
            rank, out, err = results.get(timeout=timeout_s)
            if err is not None:
                raise RuntimeError(f"rank {rank}: {err}")
            got[rank] = out
    except queue.Empty as exc:
        raise RuntimeError(f"benchmark world of {p} did not finish in {timeout_s} s") from exc
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [got[r] for r in range(p)]


def run(*, seqs: tuple[int, ...] = (16384, 32768), worlds: tuple[int, ...] = (1, 2, 4, 8), heads: int = 8,
        head_dim: int = 64, head_worlds: tuple[int, ...] = (1, 2), progress: Any = None) -> dict[str, Any]:
    """Run the parallel cases; returns ``{"machine", "ring": [...], "heads": [...]}`` (rows per rank)."""
    say = progress or (lambda line: None)
    ring_rows, head_rows = [], []
    for seq in seqs:
        for p in worlds:
            say(f"ring S={seq} P={p}")
            ring_rows += _spawn(p, ("ring", seq, heads, head_dim))
    for p in head_worlds:
        say(f"heads P={p}")
        head_rows += _spawn(p, ("heads", 1024, 16, 2048, 5))
    return {"machine": machine_info(), "cores": os.cpu_count(), "heads_ring": heads, "head_dim": head_dim,
            "ring": ring_rows, "heads": head_rows}


def format_report(result: dict[str, Any]) -> str:
    """The benchmark as text: per (S, P) the largest per-rank peak, time, bytes sent vs theory."""
    cores = result["cores"]
    lines = [f"ring attention, causal zigzag, float32, H=8, D=64 (cores: {cores})",
             f"{'S':>6} {'P':>2} {'peak MiB/rank':>14} {'design MiB':>11} {'peak/design':>12} {'x P vs P=1':>11} "
             f"{'time s':>8} {'sent MiB':>9} {'theory MiB':>11}"]
    rows = result["ring"]
    for seq in sorted({r["seq"] for r in rows}):
        one = max(r["peak_bytes"] for r in rows if r["seq"] == seq and r["world"] == 1)
        for p in sorted({r["world"] for r in rows if r["seq"] == seq}):
            group = [r for r in rows if r["seq"] == seq and r["world"] == p]
            peak = max(r["peak_bytes"] for r in group)
            secs = max(r["seconds"] for r in group)
            time_txt = f"{secs:8.2f}" if p <= cores else f"{'(' + format(secs, '.1f') + ')':>8}"
            design = ring_model_bytes(seq, p, result.get("heads_ring", 8), result.get("head_dim", 64))
            lines.append(f"{seq:>6} {p:>2} {peak / 2**20:14.1f} {design / 2**20:11.1f} {peak / design:12.2f} "
                         f"{peak * p / one:11.2f} {time_txt} "
                         f"{max(r['sent_bytes'] for r in group) / 2**20:9.1f} {group[0]['theory_bytes'] / 2**20:11.1f}")
    lines.append("head-parallel layer E=1024, H=16, S=2048, float32 forward")
    for p in sorted({r["world"] for r in result["heads"]}):
        secs = max(r["seconds"] for r in result["heads"] if r["world"] == p)
        lines.append(f"  P={p}: {secs * 1e3:.1f} ms")
    return "\n".join(lines)
