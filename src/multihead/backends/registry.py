"""The backend registry: every backend with what it can do, and one check before a call.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim
(Dv for values).

A backend is a callable with one signature::

    backend(q, k, v, *, mask, causal, window, scale, dropout_p, return_weights, return_lse, features)
        -> (out (B, H, Sq, Dv), weights (B, H, Sq, Sk) or None, lse (B, H, Sq) or None)

receiving arguments already validated by :func:`multihead.attention` (``mask`` is None
or a 4-D bool view broadcastable to (B, H, Sq, Sk)). ``features`` is one
:class:`multihead.logits.Features` value: the logit features (``softcap``, ``alibi_slopes``
(H,), ``sinks`` (H,)), set only when asked for and only for a backend that declares them,
and packed sequences (``cu_seqlens``), set only for a backend declaring ``varlen`` (the
others receive them as a dense block-diagonal mask: :func:`takes_segments`), and a block mask
(``block_mask``), set only for a backend declaring ``block_mask`` (the others receive its dense
form in ``mask``: :func:`place_block_mask`). An additive ``bias`` and a ``score_mod`` reach only
a backend declaring them; any other is refused by name. Each is registered with a
:class:`BackendSpec` stating its capabilities; :func:`resolve_backend` compares a call
with them **before any work** and raises a ``ValueError`` naming the missing one: a
backend the user names never hands the call to another (the only router is ``"auto"``,
:mod:`multihead.backends.auto`, whose rules say which backend runs and why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, Protocol, TypeVar, overload

import torch

from ..logits import NO_FEATURES, Features
from ..masks import segment_mask

__all__ = ["Backend", "BackendSpec", "register_backend", "get_backend", "get_spec", "resolve_backend",
           "available_backends", "missing_capability", "Prepared", "takes_segments", "place_segments",
           "place_block_mask", "FEATURES"]


#: A backend's prepared plain call (:attr:`BackendSpec.prepare`): ``(q, k, v, scale, causal, window,
#: mask)`` -> out, or None where it does not take the call; ``mask`` a validated bool mask
#: broadcastable to (B, H, Sq, Sk), or None.
Prepared = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, bool, Optional[int], Optional[torch.Tensor]],
                    Optional[torch.Tensor]]


class Backend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | None,
        causal: bool,
        window: int | None,
        scale: float,
        dropout_p: float,
        return_weights: bool,
        return_lse: bool,
        features: Features = NO_FEATURES,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]: ...


def _always() -> str | None:
    return None


@dataclass(frozen=True)
class BackendSpec:
    """What a backend can do; a call asking for anything else is refused by name.

    Attributes:
        name: the name users pass as ``backend=``.
        fn: the backend.
        weights: returns the attention weights when asked.
        lse: returns the per-row log-sum-exp when asked.
        grad: differentiable (autograd through q, k, v).
        dropout: applies dropout on the probabilities.
        dtypes: input dtypes it takes; None = any floating dtype.
        devices: device types it runs on (``"cpu"``, ``"cuda"``...); None = any.
        ready: returns None when it can run in this process, else why not (e.g. a
            kernel that could not be built); asked before any work.
        softcap: applies logit soft-capping (keyword ``softcap``).
        alibi: adds ALiBi biases (keyword ``alibi_slopes``).
        sinks: joins learned sink logits to the softmax (keyword ``sinks``).
        varlen: takes packed sequences as structure (keyword ``cu_seqlens``), computing
            no scores across sequences; others get them as a dense mask.
        grad_features: the features (keys of :data:`FEATURES`, and ``"cu_seqlens"``) its
            backward applies; None = every feature it declares. Gradients with any other
            are refused by name (packed sequences then arrive as a dense mask instead).
        block_mask: takes a :class:`multihead.block_mask.BlockMask` as structure
            (``features.block_mask``); others get it as a dense mask (:func:`place_block_mask`).
        bias: adds an additive float bias to the logits (keyword ``bias``).
        score_mod: applies a Python score_mod (keyword ``score_mod``).
        prepare: for a call signature without logit feature, packing, weights, lse, gradient or
            dropout, ``prepare(q, k, v)`` makes once what the backend runs for it: a function
            ``(q, k, v, scale, causal, window, mask) -> out (B, H, Sq, Dv)`` (``mask``: bool,
            broadcastable to (B, H, Sq, Sk), or None), or None from it where it does not take a call
            (the backend then runs as usual); None = no such function.
    """

    name: str
    fn: Backend
    weights: bool = False
    lse: bool = False
    grad: bool = False
    dropout: bool = False
    dtypes: frozenset[torch.dtype] | None = None
    devices: frozenset[str] | None = None
    ready: Callable[[], str | None] = field(default=_always, compare=False)
    softcap: bool = False
    alibi: bool = False
    sinks: bool = False
    varlen: bool = False
    grad_features: frozenset[str] | None = None
    block_mask: bool = False
    bias: bool = False
    score_mod: bool = False
    prepare: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Prepared] | None = field(default=None,
                                                                                             compare=False)


#: The logit features a call may ask for: keyword -> (BackendSpec field, in words).
FEATURES: dict[str, tuple[str, str]] = {
    "softcap": ("softcap", "logit soft-capping (softcap=...)"),
    "alibi_slopes": ("alibi", "ALiBi biases (alibi_slopes=...)"),
    "sinks": ("sinks", "attention sinks (sinks=...)"),
    "bias": ("bias", "an additive bias (bias=...)"),
    "score_mod": ("score_mod", "a score_mod (score_mod=...)"),
}

_SPECS: dict[str, BackendSpec] = {}


F = TypeVar("F", bound=Backend)


@overload
def register_backend(name: str, fn: None = None, *, weights: bool = False, lse: bool = False,
                     grad: bool = False, dropout: bool = False, dtypes: frozenset[torch.dtype] | None = None,
                     devices: frozenset[str] | None = None, ready: Callable[[], str | None] = _always,
                     softcap: bool = False, alibi: bool = False, sinks: bool = False,
                     varlen: bool = False, grad_features: frozenset[str] | None = None,
                     block_mask: bool = False, bias: bool = False, score_mod: bool = False,
                     prepare: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Prepared] | None = None,
                     ) -> Callable[[F], F]: ...
@overload
def register_backend(name: str, fn: F, *, weights: bool = False, lse: bool = False,
                     grad: bool = False, dropout: bool = False, dtypes: frozenset[torch.dtype] | None = None,
                     devices: frozenset[str] | None = None, ready: Callable[[], str | None] = _always,
                     softcap: bool = False, alibi: bool = False, sinks: bool = False,
                     varlen: bool = False, grad_features: frozenset[str] | None = None,
                     block_mask: bool = False, bias: bool = False, score_mod: bool = False,
                     prepare: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Prepared] | None = None,
                     ) -> F: ...
def register_backend(name: str, fn: Backend | None = None, *, weights: bool = False, lse: bool = False,
                     grad: bool = False, dropout: bool = False, dtypes: frozenset[torch.dtype] | None = None,
                     devices: frozenset[str] | None = None, ready: Callable[[], str | None] = _always,
                     softcap: bool = False, alibi: bool = False, sinks: bool = False,
                     varlen: bool = False, grad_features: frozenset[str] | None = None,
                     block_mask: bool = False, bias: bool = False, score_mod: bool = False,
                     prepare: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Prepared] | None = None,
                     ) -> Callable[[F], F] | Backend:
    """Register ``fn`` under ``name`` with its capabilities (usable as a decorator).

    Re-registering a name replaces it. The keywords are the fields of :class:`BackendSpec`.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")

    def deco(f: F) -> F:
        _SPECS[name] = BackendSpec(name, f, weights=weights, lse=lse, grad=grad, dropout=dropout,
                                   dtypes=dtypes, devices=devices, ready=ready, softcap=softcap, alibi=alibi,
                                   sinks=sinks, varlen=varlen, grad_features=grad_features,
                                   block_mask=block_mask, bias=bias, score_mod=score_mod, prepare=prepare)
        return f

    return deco if fn is None else deco(fn)


def available_backends() -> tuple[str, ...]:
    """Names of the registered backends."""
    return tuple(_SPECS)


def get_spec(name: str) -> BackendSpec:
    """The :class:`BackendSpec` registered as ``name``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    try:
        return _SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"backend must be one of {sorted(_SPECS)}, got {name!r}") from None


def get_backend(name: str) -> Backend:
    """The backend function registered as ``name`` (see :func:`get_spec`)."""
    return get_spec(name).fn


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will record an operation on these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def missing_capability(spec: BackendSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       dropout_p: float = 0.0, return_weights: bool = False, return_lse: bool = False,
                       features: Features = NO_FEATURES) -> str | None:
    """The first thing this call asks of ``spec`` that it cannot do, in words; None if none.

    ``features``: the call's logit features and packed sequences (packed sequences are never
    missing: a backend without ``varlen`` gets them as a mask, :func:`takes_segments`).
    """
    if features is not NO_FEATURES:  # NO_FEATURES (the common call) asks for none of these
        asked = features.logits()
        for key in asked:
            capability, words = FEATURES[key]
            if not getattr(spec, capability):
                return words
        learned = features.learned()
        if not spec.grad and learned and needs_grad(*learned):
            return "gradients (alibi_slopes, sinks or bias requires grad)"
        if spec.grad and spec.grad_features is not None and asked and needs_grad(q, k, v, *learned):
            for key in asked:
                if key not in spec.grad_features:
                    return f"gradients with {FEATURES[key][1]} (the {spec.name} backward does not apply it)"
    if return_weights and not spec.weights:
        return "returning attention weights (return_weights=True)"
    if return_lse and not spec.lse:
        return "returning the log-sum-exp (return_lse=True)"
    if dropout_p > 0 and not spec.dropout:
        return f"dropout (dropout_p={dropout_p})"
    if not spec.grad and needs_grad(q, k, v):
        return "gradients (q, k or v requires grad; call it under torch.no_grad() or pick a differentiable backend)"
    if spec.dtypes is not None and q.dtype not in spec.dtypes:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in spec.dtypes))
        return f"dtype {str(q.dtype).replace('torch.', '')} (it takes {names})"
    if spec.devices is not None and q.device.type not in spec.devices:
        return f"device {q.device} (it runs on {', '.join(sorted(spec.devices))})"
    return spec.ready()


def takes_segments(spec: BackendSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   features: Features = NO_FEATURES) -> bool:
    """Whether ``spec`` gets packed sequences as ``cu_seqlens`` (structure) for this call, not as a
    dense mask: it declares ``varlen``, and no gradient is needed or its backward applies them."""
    return spec.varlen and (spec.grad_features is None or "cu_seqlens" in spec.grad_features
                            or not needs_grad(q, k, v, *features.learned()))


def place_segments(spec: BackendSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, features: Features,
                   mask: torch.Tensor | None) -> tuple[Features, torch.Tensor | None]:
    """Packed sequences where ``spec`` takes them for this call: as structure (``features`` as
    given, :func:`takes_segments`), else and-ed into ``mask`` as their dense block-diagonal
    (B|1, 1, S, S) form and dropped from ``features``. Returns (features, mask)."""
    cu = features.cu_seqlens
    if cu is None or takes_segments(spec, q, k, v, features):
        return features, mask
    segments = segment_mask(cu, q.shape[2], q.device)  # (B|1, 1, S, S)
    return features._replace(cu_seqlens=None), (segments if mask is None else mask & segments)


def place_block_mask(spec: BackendSpec, features: Features,
                     mask: torch.Tensor | None) -> tuple[Features, torch.Tensor | None]:
    """A block mask where ``spec`` takes it: as structure (``features.block_mask``) for a backend
    declaring ``block_mask``, else and-ed into ``mask`` as its dense (Bm, Hm, Sq, Sk) form and
    dropped from ``features``. Returns (features, mask)."""
    block = features.block_mask
    if block is None or spec.block_mask:
        return features, mask
    dense = block.dense()  # (Bm, Hm, Sq, Sk)
    return features._replace(block_mask=None), (dense if mask is None else mask & dense)


def resolve_backend(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
                    return_weights: bool = False, return_lse: bool = False,
                    features: Features = NO_FEATURES) -> Backend:
    """The backend ``name``, checked to do everything the call asks — before any work.

    Raises:
        ValueError: unknown name, or a capability the backend lacks (named, with the
            backends that have it); never a silent substitute.
    """
    spec = get_spec(name)
    missing = missing_capability(spec, q, k, v, dropout_p=dropout_p, return_weights=return_weights,
                                 return_lse=return_lse, features=features)
    if missing is not None:
        able = [s.name for s in _SPECS.values()
                if missing_capability(s, q, k, v, dropout_p=dropout_p, return_weights=return_weights,
                                      return_lse=return_lse, features=features) is None]
        raise ValueError(f"backend {name!r} cannot do {missing}; backends that can: {able}")
    return spec.fn
