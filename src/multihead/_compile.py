"""What the library tells ``torch.compile`` about its own functions, without importing it.

``torch.compiler.assume_constant_result`` imports ``torch._dynamo`` (1.4 s) when it is applied,
so using it as a decorator makes ``import multihead`` pay for the compiler whether or not it is
ever used. :func:`constant_in_graphs` marks a function the way that decorator does (the
attribute it sets; ``tests/core/test_imports.py`` checks that the two agree on the installed
torch), so that importing the library imports no part of the compiler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["constant_in_graphs", "MARK"]

F = TypeVar("F", bound=Callable[..., object])

#: The attribute ``torch.compiler.assume_constant_result`` sets on the function it marks.
MARK = "_dynamo_marked_constant"


def constant_in_graphs(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``, without importing the compiler: traced
    graphs take ``fn()``'s result as a constant (``fn`` must return the same value for the
    whole process, as the facts of the machine and the loaded kernels do)."""
    setattr(fn, MARK, True)
    return fn
