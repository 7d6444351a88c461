"""Process groups, refusals that reach every rank, and the ring's point-to-point shift.

Notation: P world size of the group, r this rank's index in it.

Everything here is a thin layer over ``torch.distributed``; nothing starts a process
group. A caller passes a ``ProcessGroup`` or a 1-D ``DeviceMesh`` (or None = the default
group), as torch and DeepSpeed do.

**Errors instead of hangs.** A collective that only some ranks enter waits forever (or
until the group's timeout). So every public entry point first validates what it can see
locally, then exchanges a few integers of metadata (:func:`agree`) *before* any data
moves: if any rank's inputs are bad, or the ranks' shapes disagree, every rank raises the
same ``ValueError`` in that same call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["ParallelError", "resolve_group", "world_and_rank", "agree", "ring_shift"]


class ParallelError(ValueError):
    """A refusal raised on every rank with the same message."""


def resolve_group(group: object) -> dist.ProcessGroup:
    """A ``ProcessGroup`` from a ``ProcessGroup``, a 1-D ``DeviceMesh`` or None (the default group).

    Raises:
        ValueError: torch.distributed is not initialised, or a mesh with more than one dimension.
        TypeError: anything else.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: call torch.distributed.init_process_group "
                         "(torchrun sets the environment) before using multihead.parallel; "
                         "multihead never starts a process group itself")
    if group is None:
        world = dist.group.WORLD
        assert world is not None  # set by init_process_group (checked above)
        return world
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group must be a 1-D DeviceMesh (slice it by name, mesh['cp']), got a "
                             f"{group.ndim}-D mesh {tuple(group.mesh.shape)}")
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, "
                    f"got {type(group).__name__}")


def world_and_rank(group: dist.ProcessGroup) -> tuple[int, int]:
    """(P, r) of this process in ``group`` (already resolved)."""
    return dist.get_world_size(group), dist.get_rank(group)


def _device_of(group: dist.ProcessGroup) -> torch.device:
    """Where this group's collectives want their tensors: CUDA for NCCL, else the CPU."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group: dist.ProcessGroup, local: Sequence[int], error: str | None,
          check: Callable[[list[list[int]]], str | None]) -> list[list[int]]:
    """Exchange a few integers per rank and refuse on every rank together.

    Args:
        group: a resolved process group.
        local: this rank's metadata (same length on every rank: a design constant).
        error: this rank's own refusal of its inputs (found before any communication),
            or None.
        check: given every rank's metadata (P lists), the message of a refusal that every
            rank can see (mismatched shapes, unshardable sizes), or None.

    Returns:
        every rank's metadata, ``table[rank]``.

    Raises:
        ValueError: on every rank, with the same message, if any rank had ``error`` or
            ``check`` refuses the table. Costs one all-gather of ``len(local) + 1``
            int64 per rank (and one small object gather when a rank refused its inputs).
    """
    p, _ = world_and_rank(group)
    mine = torch.tensor([0 if error is None else 1, *local], dtype=torch.int64, device=_device_of(group))
    gathered = [torch.empty_like(mine) for _ in range(p)]
    dist.all_gather(gathered, mine, group=group)
    table = [g.tolist() for g in gathered]
    if any(row[0] for row in table):
        messages: list[object] = [None] * p
        dist.all_gather_object(messages, error, group=group)
        bad = [(rank, msg) for rank, msg in enumerate(messages) if msg is not None]
        text = "; ".join(f"rank {rank}: {msg}" for rank, msg in bad)
        raise ParallelError(f"refused on every rank because {text}")
    body = [row[1:] for row in table]
    message = check(body)
    if message is not None:
        raise ParallelError(message)
    return body


def ring_shift(tensors: Sequence[torch.Tensor], recv_shapes: Sequence[Sequence[int]], group: dist.ProcessGroup,
               *, backward: bool = False, tag: int = 0) -> Callable[[], list[torch.Tensor]]:
    """Start sending ``tensors`` one step around the ring; return a function that waits.

    Forward direction: to rank r+1, from rank r-1 (``backward=True``: the other way).
    All tensors of a step go in one ``batch_isend_irecv`` so the step is one
    communication call that overlaps whatever the caller computes before waiting.

    Args:
        tensors: what this rank sends (contiguous copies are made if needed).
        recv_shapes: the shapes the peer sends (uneven shards differ per rank).
        tag: distinct per step and direction, so transfers in flight together never mix
            (tensor i of the step uses ``tag + i``).

    Returns:
        ``wait()``: blocks until this step's transfers are done and returns the
        received tensors (same dtypes as ``tensors``).
    """
    p, r = world_and_rank(group)
    dst, src = ((r - 1) % p, (r + 1) % p) if backward else ((r + 1) % p, (r - 1) % p)
    dst_g, src_g = dist.get_global_rank(group, dst), dist.get_global_rank(group, src)
    sends = [t.contiguous() for t in tensors]
    recvs = [torch.empty(tuple(shape), dtype=t.dtype, device=t.device) for t, shape in zip(sends, recv_shapes)]
    ops = [dist.P2POp(dist.isend, t, dst_g, group, tag + i) for i, t in enumerate(sends)]
    ops += [dist.P2POp(dist.irecv, t, src_g, group, tag + i) for i, t in enumerate(recvs)]
    works = dist.batch_isend_irecv(ops)

    def wait() -> list[torch.Tensor]:
        for w in works:
            w.wait()
        del sends[:]  # keep the send buffers alive until here
        return recvs

    return wait
