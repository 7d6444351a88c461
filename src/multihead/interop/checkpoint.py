"""Checkpoint files: safetensors only; pickles are never unpickled.

Notation: none (tensors by name).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

__all__ = ["load_safetensors", "load_state", "PICKLE_SUFFIXES"]

#: File suffixes of pickled checkpoints, refused by :func:`load_safetensors`.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def load_safetensors(path: str | os.PathLike[str], *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read tensors from a ``.safetensors`` file, or from a folder's ``model.safetensors``.

    A sharded folder (``model.safetensors.index.json``) is read shard by shard. Pickled
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
            folder with only pickled weights, another suffix, or a corrupt file (named).
        FileNotFoundError: nothing at ``path``.
    """
    import json

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise ValueError(f"{path}: pickled checkpoints ({', '.join(PICKLE_SUFFIXES)}) are refused: unpickling "
                         "can run arbitrary code, so multihead never unpickles; convert the file to .safetensors")
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from e
            out: dict[str, torch.Tensor] = {}
            for shard in shards:
                out.update(load_safetensors(path / shard, device=device))
            return out
        single = path / "model.safetensors"
        if not single.is_file():
            pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
            why = f" (only pickled weights {pickles}, which are refused)" if pickles else ""
            raise ValueError(f"{path}: no model.safetensors{why}")
        path = single
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: expected a .safetensors file, got suffix {path.suffix!r}")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e


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
