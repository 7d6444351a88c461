"""Argument checks shared by the public API.

Every public function validates at its boundary, before any compute or state change,
and raises ``ValueError`` (sizes, shapes, values) or ``TypeError`` (types, dtypes) with a
message that names the argument and shows what was expected and what was got.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

# Refuse sizes that could only come from a mistake and would try to allocate terabytes.
MAX_DIM = 1 << 20


def check_int(name: str, value: object, *, minimum: int = 1, maximum: int = MAX_DIM) -> int:
    """Return ``value`` if it is an int in [minimum, maximum], else raise.

    Raises:
        TypeError: ``value`` is not an int (bool is refused too).
        ValueError: ``value`` is outside [minimum, maximum].
    """
    # numbers.Integral admits numpy integers; bool is an int in Python but never a size.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum or value > maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")
    return value


def check_float(name: str, value: object, *, low: float, high: float,
                high_inclusive: bool = True, low_inclusive: bool = True) -> float:
    """Return ``float(value)`` if it lies in the given interval, else raise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    ok_low = value >= low if low_inclusive else value > low
    ok_high = value <= high if high_inclusive else value < high
    if not (ok_low and ok_high) or value != value:
        lo = "[" if low_inclusive else "("
        hi = "]" if high_inclusive else ")"
        raise ValueError(f"{name} must be in {lo}{low}, {high}{hi}, got {value}")
    return value


def check_tensor(name: str, value: object, *, ndim: int | Sequence[int] | None = None) -> torch.Tensor:
    """Check that ``value`` is a tensor of the given rank(s)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            want = " or ".join(str(n) for n in allowed)
            raise ValueError(
                f"{name} must have {want} dimensions, got {value.dim()} (shape {tuple(value.shape)})"
            )
    return value


def check_float_tensor(name: str, value: torch.Tensor) -> None:
    """Floating-point tensors only: attention on integers is always a mistake."""
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")


def check_like(name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``value`` must share dtype and device with ``ref``."""
    if value.dtype != ref.dtype:
        raise TypeError(f"{name} must have dtype {ref.dtype} like {ref_name}, got {value.dtype}")
    if value.device != ref.device:
        raise ValueError(f"{name} must be on device {ref.device} like {ref_name}, got {value.device}")


def check_bool_mask(name: str, mask: object, target: Sequence[int], legend: str) -> torch.Tensor:
    """A boolean mask broadcastable to ``target`` (True = may attend).

    Args:
        name: argument name for messages.
        mask: the candidate mask.
        target: the full shape it must broadcast to.
        legend: the symbolic target shape for messages, e.g. ``"[B, H, Sq, Sk]"``.
    """
    mask = check_tensor(name, mask)
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a bool tensor (True = may attend), got dtype {mask.dtype}; "
            "convert an additive float mask with multihead.masks.from_additive, or a "
            "torch.nn.MultiheadAttention mask (True = ignore) with multihead.masks.from_torch_mha"
        )
    if mask.dim() > len(target) or not _broadcastable(tuple(mask.shape), tuple(target)):
        raise ValueError(
            f"{name} must be broadcastable to {legend} = {list(target)}, got shape {list(mask.shape)}"
        )
    return mask


def _broadcastable(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    for got, want in zip(reversed(shape), reversed(target)):
        if got not in (1, want):
            return False
    return True


def check_finite(name: str, value: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the first non-finite element of ``value``."""
    bad = ~torch.isfinite(value)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} has a non-finite value {value[index].item()} at index {list(index)} "
            f"(shape {list(value.shape)})"
        )
