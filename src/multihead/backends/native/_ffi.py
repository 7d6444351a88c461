"""What the Python side of the native kernels shares: their dtype suffixes, the step's row limit,
and the C function for a dtype.

The kernels are the functions of an extension module (``csrc/module.cpp``), which converts each
argument from the C prototype's own type (``csrc/kernels.h``): addresses as ints (a tensor's
``data_ptr()``) or None, dims and strides as tuples of ints, arrays of addresses as tuples. No
ctypes: a call costs what its arguments' conversion does, well under a microsecond.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["MAX_STEP_ROWS", "SUFFIX", "kernel", "ptr", "pointers"]

#: Most rows of x that :func:`.step.linear_few_rows` and :func:`.step.decode_step` take (the C++
#: ``MAX_STEP_ROWS``, checked against the loaded build).
MAX_STEP_ROWS = 8
#: The kernels' name suffix per dtype (``mh_attention_f32``, ``mh_attention_bf16``, ...).
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


_KERNELS: dict[tuple[object, str, torch.dtype], Any] = {}  # (module, name, dtype) -> its function


def kernel(lib: object, name: str, dtype: torch.dtype) -> Any:
    """The C function ``name`` (given with its ``_f32`` suffix) for tensors of ``dtype``."""
    fn = _KERNELS.get((lib, name, dtype))
    if fn is None:
        fn = _KERNELS[(lib, name, dtype)] = getattr(lib, name.removesuffix("_f32") + "_" + SUFFIX[dtype])
    return fn


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data address, or None (a C null) for no tensor."""
    return None if t is None else t.data_ptr()


def pointers(tensors: Sequence[torch.Tensor | None]) -> tuple[int | None, ...]:
    """The tensors' addresses (None for no tensor), as a C array of pointers is passed."""
    return tuple(None if t is None else t.data_ptr() for t in tensors)
