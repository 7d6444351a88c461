"""The native CPU kernels (``csrc/``): compiled when the package is installed, one build per
vector width, the one for this CPU chosen at run time.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim,
Dv value head dim.

The kernels are C++ with no dependency but OpenMP and no torch C++ ABI: ``attention.cpp`` (the
FlashAttention loop), ``decode.cpp`` (decoding: attention, few-row linear layers, a whole layer
step), ``backward.cpp``, ``attention_amx.cpp`` (the bfloat16 loop on AMX tiles), ``common.h``
(what they share, with the structural rule's C++ copy ``span()``), their C entry points in
``kernels.h``, and ``module.cpp``, which makes them a Python extension module. ``setup.py``
builds that module for each width of ``csrc/variants.json`` (``_kernels_amx``,
``_kernels_avx512``, ``_kernels_avx2``, ``_kernels_baseline``); :mod:`.isa` picks the best one
this CPU runs (``MULTIHEAD_NATIVE_ISA`` names another). A package installed without a C++
compiler has none: the kernels are then compiled for the machine on first use, announced on
stderr (:mod:`._build`; ``multihead build`` does it ahead), and without a compiler either, or
with ``MULTIHEAD_NATIVE=0``, :func:`available` is False and ``"auto"`` uses its torch paths;
the reason is in :func:`status`. Nothing happens at import time.

The module is loaded after torch, so its OpenMP threads come from torch's own runtime (no
second thread pool). Results do not depend on the thread count (bitwise). Forking a process
after torch has used its OpenMP threads can hang the child in any torch operation (ours or
not): call ``torch.set_num_threads(1)`` in the child first, or use the ``spawn`` start method.

The package, one concern a module, each importing only those below it:

* :mod:`.cpu` — the CPU as ``/proc/cpuinfo`` describes it (:func:`cpu_vendor`, :func:`amx_bf16`);
* :mod:`.files` — the private cache folder and its files (machine builds, :mod:`..gemm`'s verdicts);
* :mod:`.isa` — which build runs here; :mod:`._build` — compiling the machine's own;
  :mod:`._ffi` — dtype suffixes and the C function for a dtype;
* :mod:`.loader` — the kernels' module: :func:`build`, :func:`available`, :func:`status`,
  :func:`build_name`, and what it says of the machine (:func:`vector_bits`, :func:`amx`,
  :func:`amx_enabled`);
* :mod:`.attention` — the two attention loops' entry points (:func:`attention_f32`,
  :func:`decode_f32`, :func:`key_panels`), their checks and the call;
* :mod:`.step` — decoding a token: :func:`linear_few_rows`, :func:`decode_step`, :class:`StepPlan`;
* :mod:`.ops` — the ``torch.ops.multihead.*`` operators and :func:`run`, the way into them;
* :mod:`.counters` — a cache's counters in one C call (:func:`advance_counters`);
* here: the ``"native"`` backend's registration, and the names above.
"""

from __future__ import annotations

import torch

from ...logits import NO_FEATURES, Features
from ..registry import register_backend
from . import ops  # registers torch.ops.multihead.*: cheap, builds nothing
from ._ffi import MAX_STEP_ROWS, SUFFIX, kernel
from .attention import (DECODE_ROWS, LANE_KEYS, LANE_ROWS, MAX_BLOCK_KEYS, Logits, Tiles, attention_f32, decode_f32,
                        key_panels, rows_per_kv_head)
from .counters import advance_counters
from .cpu import BF16_FLAGS, amx_bf16, bf16_instructions, cpu_vendor
from .loader import amx, amx_enabled, available, build, build_name, compile_for_machine, status, vector_bits
from .ops import run
from .step import NORM_MODES, Norm, StepPlan, decode_step, linear_few_rows

__all__ = ["available", "status", "build", "build_name", "compile_for_machine", "vector_bits", "cpu_vendor",
           "amx_bf16", "bf16_instructions", "BF16_FLAGS", "amx", "amx_enabled",
           "advance_counters", "attention_f32", "decode_f32", "key_panels", "linear_few_rows", "decode_step",
           "StepPlan", "Norm", "NORM_MODES", "MAX_STEP_ROWS", "DTYPES", "SUFFIX", "DECODE_ROWS", "Logits", "kernel",
           "rows_per_kv_head", "LANE_KEYS", "LANE_ROWS",
           "run", "native_backend", "ops"]

#: Input dtypes of the native backend: each has its own kernels, which read and write that
#: dtype and compute in float32 (half precision is widened in registers as it is loaded,
#: never copied to float32 tensors; outputs rounded to nearest even; lse float32).
DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


def _not_ready() -> str | None:
    return None if available() else f"running here: the native kernel is not available ({status()})"


@register_backend("native", lse=True, grad=True, dtypes=DTYPES, devices=frozenset({"cpu"}), ready=_not_ready,
                  softcap=True, alibi=True, sinks=True, varlen=True, grad_features=frozenset({"bias"}),
                  block_mask=True, bias=True, prepare=ops.prepare)
def native_backend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    mask: torch.Tensor | None, causal: bool, window: int | None, scale: float,
    dropout_p: float, return_weights: bool, return_lse: bool, features: Features = NO_FEATURES,
) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """The compiled kernels: float32, bfloat16, float16 (computed in float32, no float32
    copies), CPU, with the native backward for gradients (half precision: computed on
    float32 copies). Soft-capping, ALiBi, sinks, an additive bias (dense, or relative: one
    value per head and distance) and packed sequences (``cu_seqlens`` as structure) in the
    forward; its backward takes the bias (and gives its gradient), none of the others: the
    registry refuses gradients with another logit feature here by name, and packed sequences
    with gradients reach it as a dense mask.

    A block mask (``features.block_mask``, and-ed with ``mask`` if both are given) runs in the
    FlashAttention loop, forward and backward, its empty tiles never computed; few query rows
    per K/V head (decoding) take it as its dense mask in the decoding loop instead.

    Anything else (dropout, weights, float64, another device, no compiler here) is
    refused by the registry before the call, naming what is missing.
    """
    mask, tiles = _block_mask(q, k, mask, features)
    out, lse = run(q, k, v, scale=scale, causal=causal, window=window, mask=mask, return_lse=return_lse,
                   softcap=features.softcap, alibi_slopes=features.alibi_slopes, sinks=features.sinks,
                   cu_seqlens=features.cu_seqlens, tiles=tiles, bias=features.bias, relative=features.relative)
    return out, None, lse


def _block_mask(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                features: Features) -> tuple[torch.Tensor | None, Tiles | None]:
    """(mask, tiles) for the kernels: a block mask as :class:`Tiles` (a dense mask folded into it),
    or as a dense mask where the kernels take no tiles (decoding rows, key blocks over 1024)."""
    block = features.block_mask
    if block is None:
        return mask, None
    if rows_per_kv_head(q, k) <= DECODE_ROWS or block.block_size[1] > MAX_BLOCK_KEYS:
        dense = block.dense()  # (Bm, Hm, Sq, Sk)
        return (dense if mask is None else mask & dense), None
    if mask is not None:
        block = block & mask
    return None, Tiles(block.tiles, block.partial, *block.block_size)
