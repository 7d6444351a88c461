"""The fused decoding step: a whole cached layer call in one native call, and why not.

Notation: B batch, E embed_dim, H query heads, Hkv key/value heads, D head_dim, C cache
capacity.

``layer(x, cache=cache)`` with one new token per row is, in the seed's terms, the whole
pipeline (project, split, RoPE, cache write, attention, concat, W_o) for B ≤ 8 vectors.
:func:`fused_step` runs it in one call of the native kernel; :func:`why_not_fused` says
whether it applies to a call and, if not, the first reason — the counterpart of
:func:`multihead.backends.auto.auto_path` for the layer. The layer asks it in one line,
so a call that takes the fused step and one that does not give the same numbers within
rounding (tested), and a user can always ask which one runs.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from .backends import native
from .cache import KVCache
from .mrope import MRoPE
from .qk_norm import RMSNorm
from .rope import RoPE

__all__ = ["why_not_fused", "fused_for", "fused_step", "repeat_step", "FusedStep", "FUSED_CONDITIONS", "PROGRAMMABLE"]


class Layer(Protocol):
    """What the fused step reads of a :class:`multihead.MultiHeadAttention`: sizes, settings and
    parts (the module is not imported here: it builds on this module)."""

    @property
    def embed_dim(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def scale(self) -> float: ...
    @property
    def dropout(self) -> float: ...
    @property
    def window(self) -> int | None: ...
    @property
    def backend(self) -> str | None: ...
    @property
    def qk_norm(self) -> str | None: ...
    @property
    def softcap(self) -> float | None: ...
    @property
    def alibi_slopes(self) -> torch.Tensor | None: ...
    @property
    def sinks(self) -> Any: ...
    @property
    def rope(self) -> RoPE | None: ...
    @property
    def watch(self) -> object | None: ...
    @property
    def training(self) -> bool: ...
    @property
    def _parameters(self) -> dict[str, Any]: ...
    @property
    def _buffers(self) -> dict[str, Any]: ...
    @property
    def _modules(self) -> dict[str, Any]: ...


def plain_linear(linear: nn.Module) -> bool:
    """An ``nn.Linear`` with no hooks: its forward may be run by a faster GEMM.

    Anything else (a subclass, a LoRA or quantized replacement, a module with hooks or
    with its own ``forward`` assigned on the instance) is called as a module, so its own
    behaviour is kept.
    """
    return type(linear) is nn.Linear and _unhooked(linear)


def _unhooked(module: nn.Module) -> bool:
    """No hook of its own or global, no ``forward`` assigned on the instance: its forward is its class's."""
    return ("forward" not in module.__dict__ and not module._forward_hooks and not module._forward_pre_hooks
            and not _GLOBAL_HOOKS[0] and not _GLOBAL_HOOKS[1])


#: ``nn.Module``'s global forward (pre-)hook registries, which every module call runs.
_GLOBAL_HOOKS = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks)


def _projections(layer: Layer) -> tuple[nn.Linear, ...]:
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


def _projection_shapes(layer: Layer) -> bool:
    """Each projection's weight is (out, in) and bias (out,) as the layer's widths say:
    q (H·D, E), k and v (Hkv·D, E), o (E, H·D). The kernel reads them by those widths."""
    hd, kv, e = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim, layer.embed_dim
    for proj, (out, width) in zip(_projections(layer), ((hd, e), (kv, e), (kv, e), (e, hd))):
        w, b = _weight_bias(proj)
        if w is None or tuple(w.shape) != (out, width) or (b is not None and tuple(b.shape) != (out,)):
            return False
    return True


def _plain_rope(layer: Layer, cache: KVCache) -> bool:
    """No RoPE, or a plain one whose tables the kernel can read as they are (contiguous float32
    on the CPU, the same shape) and which cover every row's next position."""
    rope = layer.rope
    if rope is None:
        return True
    cos, sin = rope.cos, rope.sin
    # MRoPE at (S,) / (B, S) positions is RoPE's rotation on RoPE's tables (its three rows equal)
    return (type(rope) in (RoPE, MRoPE) and max(cache.host_lengths()) < rope.table_limit and cos.is_cpu and sin.is_cpu
            and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape and cos.is_contiguous()
            and sin.is_contiguous())


#: The kernel's QK-norm mode per ``qk_norm`` placement it runs: per head, before or after RoPE.
_NORM_MODE = {"head": 1, "head_after_rope": 2, "proj": 3}


def _norm_modules(layer: Layer) -> tuple[RMSNorm, RMSNorm] | None:
    """The layer's ``q_norm`` and ``k_norm`` where it has a QK-norm, else None."""
    if layer.qk_norm is None:
        return None
    mods = layer._modules
    return mods["q_norm"], mods["k_norm"]  # type: ignore[return-value]


def _norm_weight(norm: RMSNorm) -> torch.Tensor | None:
    """A QK-norm's weight: its parameter, or the ones buffer of a weightless norm (Llama 4's L2 norm,
    :func:`multihead.interop.hf_weights.convert`), or None."""
    weight = norm._parameters.get("weight")
    return weight if weight is not None else norm._buffers.get("weight")


def _plain_norm(layer: Layer, x: torch.Tensor) -> bool:
    """No QK-norm, or one the kernel computes as the layer would: per head over D (before or after
    RoPE), both norms plain :class:`~multihead.RMSNorm` modules with no hooks, one eps and offset,
    contiguous (D,) weights of x's dtype on the CPU."""
    norms = _norm_modules(layer)
    if norms is None:
        return True
    if layer.qk_norm not in _NORM_MODE:
        return False
    q_norm, k_norm = norms
    d = layer.head_dim
    sizes = (layer.num_heads * d, layer.num_kv_heads * d) if layer.qk_norm == "proj" else (d, d)
    return (all(type(m) is RMSNorm and _unhooked(m) for m in norms)
            and q_norm.eps == k_norm.eps and q_norm.offset == k_norm.offset
            and all(w is not None and tuple(w.shape) == (n,) and w.is_contiguous() and w.dtype == x.dtype
                    and w.is_cpu for w, n in zip(map(_norm_weight, norms), sizes)))


def _step_norm(layer: Layer) -> native.Norm | None:
    """The kernel's QK-norm for a layer :func:`_plain_norm` accepts: (q weight, k weight, eps, mode)."""
    norms = _norm_modules(layer)
    if norms is None:
        return None
    q_norm, k_norm = norms
    mode = _NORM_MODE[layer.qk_norm] | (4 if q_norm.offset else 0)  # type: ignore[index]
    return (_norm_weight(q_norm), _norm_weight(k_norm), float(q_norm.eps), mode)  # type: ignore[return-value]


#: A fused step ready to run on x (B, 1, E): y (B, 1, E).
Step = Callable[[torch.Tensor], torch.Tensor]

Check = Callable[["Layer", torch.Tensor, KVCache, dict], bool]

#: The layer's programmable-attention keywords (:meth:`multihead.MultiHeadAttention.forward`): the
#: fused step runs none of them, so a call with any is routed to the composed steps.
PROGRAMMABLE: tuple[str, ...] = ("mask_mod", "block_mask", "bias", "score_mod")

#: (reason it does not apply, test that must hold), in the order they are asked.
FUSED_CONDITIONS: tuple[tuple[str, Check], ...] = (
    ("not one new token per row", lambda layer, x, c, kw: x.dim() == 3 and x.shape[1] == 1),
    (f"more than {native.MAX_STEP_ROWS} rows", lambda layer, x, c, kw: x.shape[0] <= native.MAX_STEP_ROWS),
    ("key_mask given (padding)", lambda layer, x, c, kw: kw.get("key_mask") is None),
    ("positions given", lambda layer, x, c, kw: kw.get("positions") is None),
    ("context given (cross-attention)", lambda layer, x, c, kw: kw.get("context") is None),
    ("weights asked for", lambda layer, x, c, kw: not kw.get("return_weights", False)),
    ("a mask_mod, block_mask, bias or score_mod given (the core attention step takes them)",
     lambda layer, x, c, kw: all(kw.get(name) is None for name in PROGRAMMABLE)),
    ("the layer is watched (multihead.trace or multihead.heads.capture)", lambda layer, x, c, kw: layer.watch is None),
    ("the layer has soft-capping, ALiBi or sinks",
     lambda layer, x, c, kw: layer.softcap is None and layer.alibi_slopes is None and layer.sinks is None),
    ("the layer's QK-norm is not one the step computes (qk_norm 'head', 'head_after_rope' or 'proj', in plain "
     "RMSNorm modules with one eps and contiguous weights of the input's dtype)",
     lambda layer, x, c, kw: _plain_norm(layer, x)),
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
    ("a projection is not a plain contiguous nn.Linear (subclass, hooks, its own forward, or strided weights)",
     lambda layer, x, c, kw: all(plain_linear(p) and all(t is None or t.is_contiguous() for t in _weight_bias(p))
                                 for p in _projections(layer))),
    ("a projection's weight or bias is not of the layer's shape", lambda layer, x, c, kw: _projection_shapes(layer)),
    ("the RoPE is not a plain multihead.RoPE (or MRoPE) whose contiguous float32 CPU tables cover the positions",
     lambda layer, x, c, kw: _plain_rope(layer, c)),
    ("the native kernel is not compiled here for AVX-512 or AVX2", lambda layer, x, c, kw: native.vector_bits() >= 256),
)


def why_not_fused(layer: Layer, x: torch.Tensor, cache: KVCache, **call: object) -> str | None:
    """None when ``layer(x, cache=cache, **call)`` runs as one native call; else the first reason not.

    Args:
        layer: the :class:`~multihead.MultiHeadAttention`.
        x: (B, S, E) the call's input; cache: its :class:`~multihead.KVCache`.
        **call: the call's other arguments (``key_mask``, ``positions``, ``context``,
            ``return_weights``, ``observe``, the :data:`PROGRAMMABLE` ones), as given to the layer.

    The call is assumed valid (the layer validates it first). Asking may build the
    native kernel (first time only).
    """
    for reason, holds in FUSED_CONDITIONS:
        if not holds(layer, x, cache, call):
            return reason
    return None


def fused_for(layer: Layer, x: torch.Tensor, cache: KVCache, **call: object) -> Step | str:
    """The fused step for this call, or the first reason it does not apply (:func:`why_not_fused`).
    The one question both the layer's ``forward`` and :class:`multihead.hf.KVCacheAdapter` ask,
    once the call's checks passed.

    In eager mode the step is the :class:`FusedStep` bound to ``(layer, cache)`` and held by the
    cache (``cache.fused``, made again when a tensor it points into changed); traced
    (``torch.compile``, a dispatch mode), the operator (:func:`fused_step`).

    Args: as :func:`why_not_fused`'s.

    Returns:
        ``step(x) -> y`` (B, 1, E), or the reason (a str).
    """
    reason = why_not_fused(layer, x, cache, **call)
    if reason is not None:
        return reason
    if _traced():
        return functools.partial(fused_step, layer, cache=cache, checked=True)
    return FusedStep.bind(layer, x, cache)


def fused_step(layer: Layer, x: torch.Tensor, cache: KVCache, *, checked: bool = False) -> torch.Tensor:
    """One decoding step in one native call, then the cache's counters committed.

    Args:
        x: (B, 1, E), a call for which :func:`why_not_fused` returned None.
        checked: the call also passed every check of the layer's ``forward`` (which says so):
            then an eager step remembers what those checks read, for :func:`repeat_step`.

    Returns:
        y: (B, 1, E), as ``layer(x, cache=cache)`` (within rounding). If the step fails,
        the slots it wrote are restored: the cache is left bitwise as it was.
    """
    if not _traced():
        return FusedStep.bind(layer, x, cache)(x, checked=checked)
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
                                            float(layer.scale), *_norm_operands(layer),
                                            window=layer.window)  # (B, E)
        cache.commit([1] * b)
    except BaseException:
        cache.k[slots] = saved[0]
        cache.v[slots] = saved[1]
        raise
    return y.view(b, 1, e)


def _norm_operands(layer: Layer) -> tuple[torch.Tensor | None, torch.Tensor | None, float, int]:
    """The operator's QK-norm arguments (q weight, k weight, eps, mode), or (None, None, 0.0, 0)."""
    norm = _step_norm(layer)
    return (None, None, 0.0, 0) if norm is None else norm


class FusedStep:
    """The fused decoding step of one (layer, cache) pair, in eager mode: the kernel's arguments
    marshalled once (:class:`~multihead.backends.native.StepPlan`) and, after a checked step,
    the guard that lets the next step skip the call's checks (:meth:`repeat`).

    Held by the cache (``cache.fused``): :meth:`bind` makes it again whenever a tensor it points
    into changes. In a model that streams its weights every step runs with the interpreter's
    caches cold, where the marshalling, the operator's dispatch and the checks cost a sizeable
    part of a step. The kernel advances the counters the cache hands it
    (:meth:`KVCache.native_counters`); the cache mirrors them, or undoes the step
    (:meth:`KVCache.undo_native_step`).
    """

    def __init__(self, layer: Layer, cache: KVCache, plan: native.StepPlan) -> None:
        self.plan = plan
        self.guard: _Guard | None = None
        self._layer = weakref.ref(layer)
        self._cache = weakref.ref(cache)

    @staticmethod
    def bind(layer: Layer, x: torch.Tensor, cache: KVCache) -> FusedStep:
        """The cache's step for ``layer`` and rows like ``x`` (B, 1, E): kept, or made anew."""
        b = x.shape[0]
        rope = layer.rope
        tables = None if rope is None else (rope.cos, rope.sin, rope.rotary_dim, rope.interleaved)
        layers = [_weight_bias(p) for p in _projections(layer)]
        shape = (layer.num_heads, layer.num_kv_heads, layer.head_dim, float(layer.scale))
        norm = _step_norm(layer)
        lengths, slot_pos = cache.native_counters()
        step = cache.fused
        if (isinstance(step, FusedStep) and step._layer() is layer and step.plan.key == native.StepPlan.key_of(
                b, layers, tables, cache.k, cache.v, lengths, slot_pos, x.dtype, shape, norm, layer.window)):
            return step
        plan = native.StepPlan(b, layers, num_heads=shape[0], num_kv_heads=shape[1], head_dim=shape[2], rope=tables,
                               cache_k=cache.k, cache_v=cache.v, lengths=lengths, slot_pos=slot_pos, scale=shape[3],
                               dtype=x.dtype, norm=norm, window=layer.window)
        step = FusedStep(layer, cache, plan)
        cache.fused = step
        return step

    def __call__(self, x: torch.Tensor, *, checked: bool = True, starts: torch.Tensor | None = None) -> torch.Tensor:
        """The step on x (B, 1, E): y (B, 1, E). ``checked``: the call passed every check of the
        layer's ``forward``, so what they read is remembered for :meth:`repeat`. ``starts``: each
        row's first slot, (B,) int64 (left padding before it; :func:`.backends.native.decode_step`),
        given by a caller that checked it (:func:`multihead.interop.hf_cache.own_step`), or None."""
        layer, cache = self._layer(), self._cache()
        if layer is None or cache is None:
            raise ValueError("this fused step's layer or cache no longer exists")
        guard = _Guard(*_snapshot(layer, x, cache, self.plan), _limit(layer, cache)) if checked else None
        y = self._run(x, cache, starts)
        self.guard = guard
        return y

    def repeat(self, layer: Layer, x: torch.Tensor, cache: KVCache,
               starts: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step without asking the checks again, when everything they read is as it was at the
        last checked step (:func:`_snapshot`): y (B, 1, E); else None, and nothing was done."""
        guard = self.guard
        if guard is None or torch.is_grad_enabled() or not native.ops.direct(x):
            return None
        refs, values = _snapshot(layer, x, cache, self.plan)
        if (values != guard.values or len(refs) != len(guard.refs) or not all(map(operator.is_, refs, guard.refs))
                or cache.owner() is not layer or self._layer() is not layer
                or max(cache.host_lengths()) >= guard.limit):
            return None
        return self._run(x, cache, starts)

    def _run(self, x: torch.Tensor, cache: KVCache, starts: torch.Tensor | None = None) -> torch.Tensor:
        """The plan's kernel (K and V written, the counters advanced; nothing written if it fails),
        then the counters' host mirror: y (B, 1, E). Anything failing after the kernel (an
        interrupt as it returns) has its writes undone: the cache is then bitwise as it was."""
        held = cache.host_lengths()
        try:
            y = self.plan.run(x if x.is_contiguous() else x.contiguous(), starts)  # (B, 1, E): B rows of E
            cache.mirror_step(held)
        except BaseException:
            cache.undo_native_step(held, self.plan.saved)
            raise
        return y


class _Guard(NamedTuple):
    """What a checked step's checks read (:func:`_snapshot`), and the longest a row may then be."""

    refs: list[object]
    values: list[object]
    limit: int


def _snapshot(layer: Layer, x: torch.Tensor, cache: KVCache,
              plan: native.StepPlan) -> tuple[list[object], list[object]]:
    """Everything the call's checks, :data:`FUSED_CONDITIONS` and the plan's key read, but the
    rows' lengths, in two lists: objects compared by identity (held by the guard, so that an
    identity can never become another object's) and values compared by ``==``.

    Objects: the classes of the layer, its projections and its RoPE, and the values of the
    layer's attribute, parameter, buffer and submodule registries (its ``watch`` among them),
    the projections' attributes and parameters, the RoPE's attributes and buffers (any
    reassignment: a weight, a bias, ``scale``, ``window``, ``training``, a registry, an instance
    ``forward``), the cache's buffers and settings. Values: x's shape, dtype and device, the
    thread count, the number of forward hooks (global, and each projection's), the logit scale
    and the dropout (as the plan's key and the conditions read them, so a 0-d tensor changed in
    place counts too), and the data pointer, shape, strides and dtype of every tensor the plan
    points into (``.data`` replaced on the same tensor changes no identity).
    """
    rope = layer.rope
    projections = _projections(layer)
    refs: list[object] = [type(layer), cache.k, cache.v, cache.lengths, cache.slot_pos, cache.max_len, cache.ring]
    values: list[object] = [x.shape, x.dtype, x.device, torch.get_num_threads(), len(_GLOBAL_HOOKS[0]),
                            len(_GLOBAL_HOOKS[1]), float(layer.scale), float(layer.dropout)]  # numbers as read
    for registry in (layer.__dict__, layer._parameters, layer._buffers, layer._modules):
        refs.extend(registry.values())
    for m in projections:  # what an nn.Linear's forward reads: its attributes and parameters
        refs.append(type(m))
        refs.extend(m.__dict__.values())
        refs.extend(m._parameters.values())
        values += (len(m._forward_hooks), len(m._forward_pre_hooks))
    if rope is not None:  # what the step reads of a RoPE: its tables and settings (it never calls it)
        refs.append(type(rope))
        refs.extend(rope.__dict__.values())
        refs.extend(rope._buffers.values())
    for norm in _norm_modules(layer) or ():  # a QK-norm's eps, offset, weight and hooks (it is never called)
        refs.append(type(norm))
        refs.extend(norm.__dict__.values())
        refs.extend(norm._parameters.values())
        values += (len(norm._forward_hooks), len(norm._forward_pre_hooks))
    values.extend((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in plan.tensors)  # the pointer: the device too
    return refs, values


def _limit(layer: Layer, cache: KVCache) -> int:
    """Rows shorter than this take one more token: the cache's ``max_len`` and the RoPE table's reach."""
    return cache.max_len if layer.rope is None else min(cache.max_len, layer.rope.table_limit)


def repeat_step(layer: Layer, x: torch.Tensor, cache: KVCache, starts: torch.Tensor | None = None
                ) -> torch.Tensor | None:
    """``layer(x, cache=cache)`` as the fused step without asking its checks again, when
    everything they read is as it was at the last step that asked them all: y (B, 1, E);
    else None, and nothing has been done (the caller asks them all).

    The layer's ``forward`` asks this first for a plain cached call (no mask, key_mask,
    positions, context, weights or checks asked for). Each check of a call costs little,
    but a step of a model that streams its weights runs with the interpreter's caches cold,
    where the checks, the conditions and the plan's key took 0.25-0.3 ms a layer, more than
    reading what they read at once (:func:`_snapshot`). It runs only in eager mode without
    gradients (:func:`.backends.native.ops.direct`), for a cache bound to this layer whose
    rows are all shorter than the limits (``max_len``, the RoPE table) the checks compared.

    Args: as :func:`fused_step`'s; ``starts``: as :meth:`FusedStep.__call__`'s.
    """
    step = cache.fused if type(cache) is KVCache else None  # anything else: the checks say what is wrong
    if type(step) is not FusedStep:
        return None
    return step.repeat(layer, x, cache, starts)


def _traced() -> bool:
    """Whether this call is being traced or intercepted (``torch.compile``, ``torch.export``, a
    ``TorchDispatchMode`` such as fake tensors): then the step must be the operator, not a ctypes call."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def _written_slots(cache: KVCache, b: int) -> tuple[torch.Tensor, slice, torch.Tensor]:
    """An index of ``cache.k`` selecting the (B, Hkv, D) slots the step writes: each row's next
    one, by the device lengths (advanced indexing: a compiled step is one graph for all lengths)."""
    return (torch.arange(b, device=cache.lengths.device), slice(None), cache.lengths)
