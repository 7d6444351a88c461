"""A bounded table of remembered decisions: what ``mh.attention`` (its backend per call
signature) and ``"auto"`` (its rule per signature) keep between calls."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["remember"]

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
