"""Checkpoint files: safetensors only; pickles are never unpickled.

Notation: none (tensors by name).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["load_safetensors", "load_state", "PICKLE_SUFFIXES"]

#: File suffixes of pickled checkpoints, refused by :func:`load_safetensors`.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
#: The index of a sharded checkpoint folder.
INDEX_NAME = "model.safetensors.index.json"


def load_safetensors(path: str | os.PathLike[str], *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read tensors from a ``.safetensors`` file, or from a folder's ``model.safetensors``.

    A sharded folder (``model.safetensors.index.json``) is read shard by shard; its
    shards must be files directly inside the folder, each holding exactly the tensors
    the index puts there (a tensor in two shards is refused, never overwritten). Only
    regular files are opened (a FIFO or a device is refused before opening). Pickled
    checkpoints are refused without being opened: unpickling runs arbitrary code, so
    multihead never calls ``torch.load`` on them. Convert them once in a trusted
    environment (e.g. ``safetensors.torch.save_file``).

    Args:
        path: a ``.safetensors`` file or a checkpoint folder.
        device: where to put the tensors.

    Returns:
        ``{name: tensor}``.

    Raises:
        ValueError: a pickle suffix (``.bin``, ``.pt``, ``.pth``, ``.pkl``, ``.ckpt``), a
            folder with only pickled weights, another suffix, not a regular file, a
            corrupt file, or an index that is malformed, names a shard outside the
            folder or disagrees with its shards (the file and the key named).
        FileNotFoundError: nothing at ``path``.
    """
    path = Path(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise ValueError(f"{path}: pickled checkpoints ({', '.join(PICKLE_SUFFIXES)}) are refused: unpickling "
                         "can run arbitrary code, so multihead never unpickles; convert the file to .safetensors")
    if path.is_dir():
        index = path / INDEX_NAME
        if index.is_file():
            return _load_sharded(path, index, device)
        single = path / "model.safetensors"
        if not single.is_file():
            pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
            why = f" (only pickled weights {pickles}, which are refused)" if pickles else ""
            raise ValueError(f"{path}: no model.safetensors{why}")
        path = single
    return _load_file(path, device)


def _load_file(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    """One ``.safetensors`` file, refused before it is opened unless it is a regular file
    (a FIFO would block the reader forever, a device could be read without end)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        mode = path.stat().st_mode  # follows symlinks: what would be opened
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e})") from e
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: expected a .safetensors file, got suffix {path.suffix!r}")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path}: not a regular file ({_file_kind(mode)}); refusing to open it")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a plain file")


def _read_index(folder: Path, index: Path) -> dict[str, str]:
    """``weight_map`` of a sharded checkpoint's index: ``{tensor name: shard file name}``,
    every shard a ``.safetensors`` file directly inside ``folder``.

    Raises:
        ValueError: malformed JSON, a missing or malformed ``weight_map``, a tensor listed
            twice, or a shard name that is absolute, has a folder part or ``..``, or leaves
            the folder (naming the index file and the key).
    """
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"{index}: key {key!r} is listed twice")
            seen[key] = value
        return seen

    if not stat.S_ISREG(index.stat().st_mode):
        raise ValueError(f"{index}: not a regular file; refusing to open it")
    try:
        data = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=no_duplicates)
    except (OSError, UnicodeDecodeError, RecursionError, json.JSONDecodeError) as e:
        raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: 'weight_map' must be a non-empty object {{tensor name: shard file}}, "
                         f"got {type(weight_map).__name__}")
    root = folder.resolve()
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard.endswith(".safetensors"):
            raise ValueError(f"{index}: weight_map[{name!r}] must be a .safetensors file name, got {shard!r}")
        if Path(shard).name != shard or shard in (".", "..") or (root / shard).resolve().parent != root:
            raise ValueError(f"{index}: weight_map[{name!r}] = {shard!r} is not a file inside {folder} "
                             "(shard names may not be absolute, have folder parts or '..', or link outside)")
    return weight_map


def _load_sharded(folder: Path, index: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Every shard the index names, each holding exactly the tensors the index puts in it."""
    weight_map = _read_index(folder, index)
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        tensors = _load_file(folder / shard, device)
        listed = {name for name, where in weight_map.items() if where == shard}
        stray = sorted(set(tensors) - listed)
        if stray:
            other = weight_map.get(stray[0])
            where = f"the index puts it in {other!r}" if other else "the index does not list it"
            raise ValueError(f"{folder / shard}: holds tensor {stray[0]!r} but {where} ({index})")
        absent = sorted(listed - set(tensors))
        if absent:
            raise ValueError(f"{folder / shard}: lacks tensor {absent[0]!r}, which {index} puts there")
        out.update(tensors)
    return out


def load_state(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    *,
    prefix: str = "",
    ignore: Iterable[str] = (),
) -> nn.Module:
    """Load ``tensors`` into ``module`` strictly, with errors that name the key.

    Every entry of ``module.state_dict()`` must be present with the same shape, and every
    tensor must be used. Tensors naming a non-persistent buffer (``position_ids`` in BERT
    checkpoints) are accepted and skipped. Values are cast to each parameter's dtype.

    Args:
        module: e.g. a :class:`MultiHeadAttention` or a transformers model.
        tensors: ``{name: tensor}``, e.g. from :func:`load_safetensors`.
        prefix: strip this from the tensor names first (``"bert."``); names without it
            are then treated as extra.
        ignore: tensor names to skip silently (e.g. a head the module does not have).

    Returns:
        ``module``.

    Raises:
        ValueError: a missing tensor, an extra tensor, or a shape mismatch, naming the key.
    """
    ignore = set(ignore)
    given = {(k[len(prefix):] if prefix and k.startswith(prefix) else k): v
             for k, v in tensors.items() if k not in ignore}
    expected = module.state_dict()
    buffers = {name for name, _ in module.named_buffers()}
    missing = sorted(set(expected) - set(given))
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r}" +
                         (f" (and {len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else ""))
    extra = sorted(set(given) - set(expected) - buffers)
    if extra:
        raise ValueError(f"checkpoint has unexpected tensor {extra[0]!r}" +
                         (f" (and {len(extra) - 1} more: {extra[1:4]})" if len(extra) > 1 else ""))
    for name, want in expected.items():
        got = given[name]
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {list(got.shape)}, "
                             f"expected {list(want.shape)}")
        if not isinstance(got, torch.Tensor) or not (got.is_floating_point() == want.is_floating_point()):
            raise ValueError(f"checkpoint tensor {name!r} has dtype {getattr(got, 'dtype', type(got))}, "
                             f"expected a tensor like {want.dtype}")
    module.load_state_dict({k: given[k] for k in expected}, strict=True)
    return module
