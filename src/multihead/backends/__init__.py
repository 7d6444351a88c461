"""Attention backends behind one signature, chosen by name, with declared capabilities.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim.

* :mod:`.registry` — :class:`BackendSpec`, :func:`register_backend`, :func:`resolve_backend`
  (refuses, by name, a capability a backend lacks; never substitutes another).
* :mod:`.eager` — ``"explicit"``: written out; weights, log-sum-exp, gradients.
* :mod:`.sdpa` — ``"sdpa"``: torch's fused kernel; gradients, dropout.
* :mod:`.blocked` — ``"blocked"``: the torch-only blocked kernel (inference), and the
  torch decoding path.
* :mod:`.native` — ``"native"``: the compiled C++ kernels (CPU; PyTorch operators, with the
  FlashAttention-2 backward).
* :mod:`.auto` — ``"auto"``: the ordered rules that pick one of the above per call.

=========  =======  ===  =====  =======  ==========================  =======
backend    weights  lse  grads  dropout  dtypes                      devices
=========  =======  ===  =====  =======  ==========================  =======
explicit   yes      yes  yes    yes      any float                   any
sdpa       no       no   yes    yes      any float                   any
blocked    no       yes  no     no       any float (half in f32)     any
native     no       yes  yes    no       float32, float16, bfloat16  cpu
auto       yes      yes  yes    yes      any float                   any
=========  =======  ===  =====  =======  ==========================  =======
"""

from __future__ import annotations

from ..masks import full_mask
from . import auto, blocked, eager, native, sdpa
from .eager import safe_softmax
from .registry import (Backend, BackendSpec, available_backends, get_backend, get_spec, missing_capability,
                       register_backend, resolve_backend)

__all__ = ["Backend", "BackendSpec", "register_backend", "get_backend", "get_spec", "resolve_backend",
           "available_backends", "missing_capability", "full_mask", "safe_softmax",
           "auto", "blocked", "eager", "native", "sdpa"]
