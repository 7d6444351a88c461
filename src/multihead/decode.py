"""The fused decoding step: a whole cached layer call in one native call, and why not.

Notation: B batch, E embed_dim, H query heads, Hkv key/value heads, D head_dim, C cache
capacity.

``layer(x, cache=cache)`` with one new token per row is, in the seed's terms, the whole
pipeline (project, split, RoPE, cache write, attention, concat, W_o) for B ≤ 4 vectors.
:func:`fused_step` runs it in one call of the native kernel; :func:`why_not_fused` says
whether it applies to a call and, if not, the first reason — the counterpart of
:func:`multihead.backends.auto.auto_path` for the layer. The layer asks it in one line,
so a call that takes the fused step and one that does not give the same numbers within
rounding (tested), and a user can always ask which one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from .backends import native
from .cache import KVCache
from .rope import RoPE

if TYPE_CHECKING:
    from .module import MultiHeadAttention

__all__ = ["why_not_fused", "fused_step", "FUSED_CONDITIONS"]


def plain_linear(linear: nn.Module) -> bool:
    """An ``nn.Linear`` with no hooks: its forward may be run by a faster GEMM.

    Anything else (a subclass, a LoRA or quantized replacement, a module with hooks)
    is called as a module, so its own behaviour is kept.
    """
    return (type(linear) is nn.Linear and not linear._forward_hooks and not linear._forward_pre_hooks
            and not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks)


def _projections(layer: MultiHeadAttention) -> tuple[nn.Linear, ...]:
    mods = layer._modules  # the registry nn.Module's attribute lookup searches (asked at every step)
    return (mods["q_proj"], mods["k_proj"], mods["v_proj"], mods["o_proj"])  # type: ignore[return-value]


def _weight_bias(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a projection. An ``nn.Linear``'s from its parameter registry, which
    is what ``linear.weight`` returns for it (``nn.Module`` keeps a registered parameter
    nowhere else), without ``__getattr__``'s search, a sizeable cost at every decoded token;
    anything else by attribute."""
    params = linear._parameters
    if type(linear) is nn.Linear and "weight" in params and "bias" in params:
        return params["weight"], params["bias"]  # type: ignore[return-value]
    return linear.weight, linear.bias  # type: ignore[return-value]


def _plain_rope(layer: MultiHeadAttention, cache: KVCache) -> bool:
    rope = layer.rope
    return rope is None or (type(rope) is RoPE and max(cache.host_lengths()) < rope.table_limit and rope.cos.is_cpu)


Check = Callable[["MultiHeadAttention", torch.Tensor, KVCache, dict], bool]

#: (reason it does not apply, test that must hold), in the order they are asked.
FUSED_CONDITIONS: tuple[tuple[str, Check], ...] = (
    ("not one new token per row", lambda layer, x, c, kw: x.dim() == 3 and x.shape[1] == 1),
    (f"more than {native.MAX_STEP_ROWS} rows", lambda layer, x, c, kw: x.shape[0] <= native.MAX_STEP_ROWS),
    ("key_mask given (padding)", lambda layer, x, c, kw: kw.get("key_mask") is None),
    ("positions given", lambda layer, x, c, kw: kw.get("positions") is None),
    ("context given (cross-attention)", lambda layer, x, c, kw: kw.get("context") is None),
    ("weights asked for", lambda layer, x, c, kw: not kw.get("return_weights", False)),
    ("an observer is attached (trace or capture)", lambda layer, x, c, kw: kw.get("observe") is None),
    ("the layer has a sliding window", lambda layer, x, c, kw: layer.window is None),
    ("the layer has QK-norm, soft-capping, ALiBi or sinks",
     lambda layer, x, c, kw: layer.qk_norm is None and layer.softcap is None and layer.alibi_slopes is None
     and layer.sinks is None),
    ("a ring cache", lambda layer, x, c, kw: not c.ring),
    ("dropout in training mode", lambda layer, x, c, kw: not (layer.training and layer.dropout > 0)),
    ("a backend other than auto or native", lambda layer, x, c, kw: layer.backend in (None, "auto", "native")),
    ("not float32, bfloat16 or float16", lambda layer, x, c, kw: x.dtype in native.SUFFIX),
    ("the projections' weights or the cache are not of the input's dtype",
     lambda layer, x, c, kw: c.k.dtype == c.v.dtype == x.dtype and all(
         t is None or t.dtype == x.dtype for p in _projections(layer) for t in _weight_bias(p))),
    ("not on the CPU", lambda layer, x, c, kw: x.is_cpu),
    ("the cache's K and V buffers have different or non-unit-stride rows",
     lambda layer, x, c, kw: c.k.stride() == c.v.stride() and c.k.stride(-1) == 1),
    ("a projection is not a plain contiguous nn.Linear (subclass, hooks, or strided weights)",
     lambda layer, x, c, kw: all(plain_linear(p) and all(t is None or t.is_contiguous() for t in _weight_bias(p))
                                 for p in _projections(layer))),
    ("the RoPE is not a plain multihead.RoPE whose CPU table covers the positions",
     lambda layer, x, c, kw: _plain_rope(layer, c)),
    ("the native kernel is not compiled here for AVX-512 or AVX2", lambda layer, x, c, kw: native.vector_bits() >= 256),
)


def why_not_fused(layer: MultiHeadAttention, x: torch.Tensor, cache: KVCache, **call: object) -> str | None:
    """None when ``layer(x, cache=cache, **call)`` runs as one native call; else the first reason not.

    Args:
        layer: the :class:`~multihead.MultiHeadAttention`.
        x: (B, S, E) the call's input; cache: its :class:`~multihead.KVCache`.
        **call: the call's other arguments (``key_mask``, ``positions``, ``context``,
            ``return_weights``, ``observe``), as given to the layer.

    The call is assumed valid (the layer validates it first). Asking may build the
    native kernel (first time only).
    """
    for reason, holds in FUSED_CONDITIONS:
        if not holds(layer, x, cache, call):
            return reason
    return None


def fused_step(layer: MultiHeadAttention, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One decoding step in one native call, then the cache's counters committed.

    Args:
        x: (B, 1, E), a call for which :func:`why_not_fused` returned None.

    Returns:
        y: (B, 1, E), as ``layer(x, cache=cache)`` (within rounding). If the step fails,
        the slots it wrote are restored: the cache is left bitwise as it was.
    """
    if not _traced():
        return _eager_step(layer, x, cache)
    # Traced: the operator, so that torch.compile sees one opaque node that writes the cache.
    b, _, e = x.shape
    rope = layer.rope
    cos, sin, rotary_dim, interleaved = (None, None, 0, False) if rope is None else (
        rope.cos, rope.sin, rope.rotary_dim, rope.interleaved)
    projs = _projections(layer)
    slots = _written_slots(cache, b)
    saved = [t[slots] for t in (cache.k, cache.v)]  # (B, Hkv, D), copies: a failure restores them
    x2 = x.reshape(b, e).contiguous()
    try:
        y = torch.ops.multihead.decode_step(x2, [p.weight for p in projs], [p.bias for p in projs], cos, sin,
                                            rotary_dim, interleaved, cache.k, cache.v, cache.lengths,
                                            layer.num_heads, layer.num_kv_heads, layer.head_dim,
                                            float(layer.scale))  # (B, E)
        cache.commit([1] * b)
    except BaseException:
        cache.k[slots] = saved[0]
        cache.v[slots] = saved[1]
        raise
    return y.view(b, 1, e)


def _eager_step(layer: MultiHeadAttention, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """:func:`fused_step` in eager mode: the kernel called with the arguments marshalled
    once per layer and cache (:class:`~multihead.backends.native.StepPlan`, kept on the
    cache, remade whenever a tensor it points into changes). In a model that streams its
    weights every step runs with the interpreter's caches cold, where the marshalling, the
    operator's dispatch and copies of the written slots cost a sizeable part of a step.

    Args, returns: as :func:`fused_step`'s. The kernel writes nothing unless it runs whole;
    it hands back the slots' old K and V, put back if anything fails after it.
    """
    b = x.shape[0]
    rope = layer.rope
    tables = None if rope is None else (rope.cos, rope.sin, rope.rotary_dim, rope.interleaved)
    layers = [_weight_bias(p) for p in _projections(layer)]
    shape = (layer.num_heads, layer.num_kv_heads, layer.head_dim, float(layer.scale))
    plan = cache.step_plan
    if not isinstance(plan, native.StepPlan) or plan.key != native.StepPlan.key_of(
            b, layers, tables, cache.k, cache.v, cache.lengths, x.dtype, shape):
        plan = cache.step_plan = native.StepPlan(
            b, layers, num_heads=shape[0], num_kv_heads=shape[1], head_dim=shape[2], rope=tables, cache_k=cache.k,
            cache_v=cache.v, lengths=cache.lengths, scale=shape[3], dtype=x.dtype)
    held = cache.host_lengths()
    y = plan.run(x if x.is_contiguous() else x.contiguous())  # (B, 1, E): B rows of E
    try:
        cache.commit([1] * b)
    except BaseException:
        plan.restore(held)
        raise
    return y


def _traced() -> bool:
    """Whether this call is being traced or intercepted (``torch.compile``, ``torch.export``, a
    ``TorchDispatchMode`` such as fake tensors): then the step must be the operator, not a ctypes call."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def _written_slots(cache: KVCache, b: int) -> tuple[torch.Tensor, slice, torch.Tensor]:
    """An index of ``cache.k`` selecting the (B, Hkv, D) slots the step writes: each row's next
    one, by the device lengths (advanced indexing: a compiled step is one graph for all lengths)."""
    return (torch.arange(b, device=cache.lengths.device), slice(None), cache.lengths)
