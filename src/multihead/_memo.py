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


#: At most this many derived values are remembered (:func:`derived`); the oldest goes first.
DERIVED_SIZE = 8
#: Inference tensors of at most this many elements, on the CPU, are remembered by value (:func:`derived`).
BY_VALUE_MAX = 1 << 16
#: What shows a tensor's change: its version counter, or for an inference tensor a copy of it.
Mark = int | torch.Tensor
#: (source, what) -> (the source, its mark, the value, the value's mark)
_derived: dict[tuple[int, Hashable], tuple[torch.Tensor, Mark, torch.Tensor, Mark]] = {}


def derived(source: torch.Tensor, what: Hashable, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``make(source)``, remembered for this very tensor while neither it nor the value changed.

    A tensor's version counter moves with every in-place change, so the same tensor object at the
    same version holds the same values; the entry keeps the source alive, so its ``id`` cannot be
    taken by another tensor meanwhile. A change through ``.data`` is not counted: don't mutate a
    tensor that way between two calls that read it. Inference tensors (made under
    ``torch.inference_mode``, as ``SentenceTransformer.encode`` runs; the value made from any tensor
    there is one) count no change: a small one on the CPU (:data:`BY_VALUE_MAX`) is compared with
    a copy before reuse (``torch.equal``: a few µs where the values this serves cost tens), a
    larger one is not remembered. Nothing is remembered while a compiler traces.

    Args:
        source: the tensor the value is derived from.
        what: which value of it (e.g. ``("bounds", S)``).
        make: computes the value from ``source``; it must not change ``source``.
    """
    if torch.compiler.is_compiling():
        return make(source)
    key = (id(source), what)
    found = _derived.get(key)
    if found is not None and found[0] is source and _unchanged(source, found[1]) and _unchanged(found[2], found[3]):
        return found[2]
    value = make(source)
    source_mark, value_mark = _mark(source), _mark(value)
    if source_mark is not None and value_mark is not None:
        remember(_derived, key, (source, source_mark, value, value_mark), DERIVED_SIZE)
    return value


def _mark(t: torch.Tensor) -> Mark | None:
    """What shows a change of ``t`` later: its version, or for a small CPU inference tensor a copy
    of it; None for a larger inference tensor (not remembered)."""
    if not t.is_inference():
        return t._version
    if t.device.type != "cpu" or t.numel() > BY_VALUE_MAX:
        return None
    return t.clone()


def _unchanged(t: torch.Tensor, mark: Mark) -> bool:
    """Whether ``t`` holds what it held when ``mark`` was taken (:func:`_mark`)."""
    return t._version == mark if isinstance(mark, int) else torch.equal(t, mark)
