"""The C functions of the native kernels: one signature table, next to typed callers.

Every argument list is declared here once, by name, in the order of the C prototype in
``csrc/`` (one argument out of order would be a silent memory bug, so each group is
commented). Callers pass Python values; this module turns them into ctypes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

__all__ = ["MAX_STEP_ROWS", "SUFFIX", "declare", "kernel", "ptr", "int64s", "int64_ptr", "pointers"]

#: Most rows of x that :func:`.step.linear_few_rows` and :func:`.step.decode_step` take (the C++
#: ``MAX_STEP_ROWS``, checked against the built library).
MAX_STEP_ROWS = 4
#: The kernels' name suffix per dtype (``mh_attention_f32``, ``mh_attention_bf16``, ...).
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

_vp, _i64, _int, _f32, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_double
_ptrs, _i64p = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64)

# q, k, v, out, lse (or null), mask (or null); dims (7); strides (19); scale, causal, window
_ATTENTION: list[type] = [_vp, _vp, _vp, _vp, _vp, _vp, _i64p, _i64p, _f32, _int, _i64]

# The decoding step: x (B, E), B, E; weights and biases of q, k, v, o; H, Hkv, D; RoPE cos, sin
# (float32 or null), rotary dim, interleaved; cache k, v, their strides (3), lengths (B); scale,
# y (B, E), saved slots (B, 2, Hkv, D) or null, threads; slot_pos (B × C, row stride) or null,
# its row stride, C: given, the step advances the counters (lengths too) as mh_advance_counters.
_STEP: list[type] = [_vp, _i64, _i64, _ptrs, _ptrs, _i64, _i64, _i64, _vp, _vp, _i64, _int, _vp, _vp, _i64p, _i64p,
                     _f32, _vp, _vp, _int, _vp, _i64, _i64]

# The _bf16 and _f16 kernels take the _f32 ones' arguments, tensors of that dtype (lse and RoPE
# tables float32).
SIGNATURES: dict[str, list[type]] = {
    # + softcap, alibi slopes, sinks (or null), segments (or null), their batch stride,
    # panel counter (or null); query tile, threads
    "mh_attention_f32": _ATTENTION + [_f32, _vp, _vp, _vp, _i64, _vp, _i64, _int],
    "mh_attention_bf16": _ATTENTION + [_f32, _vp, _vp, _vp, _i64, _vp, _i64, _int],
    "mh_attention_f16": _ATTENTION + [_f32, _vp, _vp, _vp, _i64, _vp, _i64, _int],
    "mh_decode_f32": _ATTENTION + [_int],  # + threads
    "mh_decode_bf16": _ATTENTION + [_int],
    "mh_decode_f16": _ATTENTION + [_int],
    # x, M, K, count; weights, their rows N_i, biases, outputs; threads
    "mh_linear_few_rows_f32": [_vp, _i64, _i64, _i64, _ptrs, _i64p, _ptrs, _ptrs, _int],
    "mh_decode_step_f32": _STEP,
    "mh_decode_step_bf16": _STEP,
    "mh_decode_step_f16": _STEP,
    # q, k, v, dout, lse, delta, mask (or null); dq, dk, dv; dims (7), strides (25: q, k, v,
    # dout, dq, dk, dv (b, h, s), mask (b, h, i, j)); scale, causal, window, threads
    "mh_attention_backward_f32": [_vp] * 10 + [_i64p, _i64p, _f64, _int, _i64, _int],
    "mh_attention_backward_f64": [_vp] * 10 + [_i64p, _i64p, _f64, _int, _i64, _int],
    # q, k, v, mask (or null); out, lse; dims (7), strides (25, as the backward's: those of q, k, v
    # and the mask read); scale, causal, window, threads
    "mh_attention_forward_f64": [_vp] * 6 + [_i64p, _i64p, _f64, _int, _i64, _int],
    # kind (0 bfloat16, 1 float16), to_half, src, dst, n: the scalar conversions (tests)
    "mh_convert_scalar": [_int, _int, _vp, _vp, _i64],
    # lengths (B), slot_pos (B × C, row stride), B, row stride, C: a cache's counters after one token
    # per row (multihead.KVCache.commit)
    "mh_advance_counters": [_vp, _vp, _i64, _i64, _i64],
    "mh_vector_bits": [],
    "mh_amx_ready": [],  # 1 where mh_attention_bf16 runs its AMX loop now
    "mh_amx_switch": [_int],  # on (1) or off (0); returns the previous position
    "mh_max_step_rows": [],
}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set every function's argument and return types from :data:`SIGNATURES`."""
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


def kernel(lib: object, name: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """The C function ``name`` (given with its ``_f32`` suffix) for tensors of ``dtype``."""
    return getattr(lib, name.removesuffix("_f32") + "_" + SUFFIX[dtype])


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer, or None (a C null) for no tensor."""
    return None if t is None else t.data_ptr()


def int64s(values: Sequence[int]) -> ctypes.Array[ctypes.c_int64]:
    return (ctypes.c_int64 * len(values))(*values)


def int64_ptr(t: torch.Tensor) -> object:
    """An int64 tensor's data as the C ``int64_t*`` it is passed as."""
    return ctypes.cast(t.data_ptr(), _i64p)


def pointers(tensors: Sequence[torch.Tensor | None]) -> ctypes.Array[ctypes.c_void_p]:
    return (ctypes.c_void_p * len(tensors))(*(ptr(t) for t in tensors))

