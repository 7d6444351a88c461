"""A bounded table of remembered decisions: what ``mh.attention`` (its backend per call
signature) and ``"auto"`` (its rule per signature) keep between calls; and values derived from
a tensor, remembered while that tensor is unchanged (:func:`derived`: a packed batch's sequence
bounds, computed once for all the layers of a model call instead of once per layer)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

__all__ = ["remember", "derived", "DERIVED_SIZE", "BY_VALUE_MAX"]

K = TypeVar("K")
V = TypeVar("V")


def remember(table: dict[K, V], key: K, value: V, limit: int) -> V:
    """``table[key] = value``, the oldest entry dropped first when ``table`` holds ``limit``;
    returns ``value``. Safe against another thread dropping the same entry."""
    if len(table) >= limit:
        try:
            del table[next(iter(table))]
        except (KeyError, RuntimeError, StopIteration):  # another thread took it first
            pass
    table[key] = value
    return value


#: At most this many derived values are remembered (:func:`derived`), of tensors with a version
#: counter and of inference tensors each; the oldest goes first.
DERIVED_SIZE = 8
#: Inference tensors of at most this many elements, on the CPU, are remembered by value (:func:`derived`).
BY_VALUE_MAX = 1 << 16
#: (source, its version, what) -> (the source, its version, the value, the value's version)
_derived: dict[tuple[int, int, Hashable], tuple[torch.Tensor, int, torch.Tensor, int]] = {}
#: (inference source, what) -> (the source, a copy of it, the value, a copy of the value)
_by_value: dict[tuple[int, Hashable], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def derived(source: torch.Tensor, what: Hashable, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``make(source)``, remembered for this very tensor while neither it nor the value changed.

    A tensor's version counter moves with every in-place change, so the same tensor object at the
    same version holds the same values; the entry keeps the source alive, so its ``id`` cannot be
    taken by another tensor meanwhile. A change through ``.data`` is not counted: don't mutate a
    tensor that way between two calls that read it. Inference tensors (``torch.inference_mode``,
    as ``SentenceTransformer.encode`` runs) count no change: a small one on the CPU
    (:data:`BY_VALUE_MAX`) is remembered by value instead, with copies of it and of the value
    compared before reuse (``torch.equal``: a few µs where the values it serves cost tens), a
    larger one not at all. Nothing is remembered while a compiler traces.

    Args:
        source: the tensor the value is derived from.
        what: which value of it (e.g. ``("bounds", S)``).
        make: computes the value from ``source``; it must not change ``source``.
    """
    if torch.compiler.is_compiling():
        return make(source)
    if source.is_inference():
        return _derived_by_value(source, what, make)
    key = (id(source), source._version, what)
    found = _derived.get(key)
    if found is not None and found[0] is source and found[2]._version == found[3]:
        return found[2]
    value = make(source)
    if not value.is_inference():
        remember(_derived, key, (source, source._version, value, value._version), DERIVED_SIZE)
    return value


def _derived_by_value(source: torch.Tensor, what: Hashable,
                      make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """:func:`derived` for an inference tensor: remembered while it and the value hold the values
    they held (compared with copies), for small CPU tensors only."""
    if source.device.type != "cpu" or source.numel() > BY_VALUE_MAX:
        return make(source)
    key = (id(source), what)
    found = _by_value.get(key)
    if (found is not None and found[0] is source and torch.equal(found[1], source)
            and torch.equal(found[2], found[3])):
        return found[2]
    value = make(source)
    if value.device.type == "cpu" and value.numel() <= BY_VALUE_MAX:
        remember(_by_value, key, (source, source.clone(), value, value.clone()), DERIVED_SIZE)
    return value
