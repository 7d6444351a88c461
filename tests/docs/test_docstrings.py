"""The API reference is generated from the docstrings: each documented argument must exist.

Every public function and method of the modules the reference shows is read with
``inspect``; each entry of its ``Args:`` section (``name: ...`` or grouped, ``k, v: ...``)
must name parameters of its signature, so a renamed argument cannot leave a stale entry.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: The modules of the API reference: every ``::: name`` of docs/api/*.md.
API = sorted({m.group(1) for page in (ROOT / "docs" / "api").glob("*.md")
              for m in re.finditer(r"^::: ([\w.]+)", page.read_text("utf-8"), re.M)})
ENTRY = re.compile(r"^(?P<names>\*{0,2}[A-Za-z_][\w*]*(?:\s*\([^)]*\))?(?:,\s*\*{0,2}[A-Za-z_][\w*]*"
                   r"(?:\s*\([^)]*\))?)*)\s*:(?:\s|$)")


def _objects(name: str) -> Iterator[tuple[str, Any]]:
    """The public functions and methods under ``name`` (a module, class or function)."""
    module_name, _, attr = name.rpartition(".")
    try:
        obj: Any = importlib.import_module(name)
    except ModuleNotFoundError:
        obj = getattr(importlib.import_module(module_name), attr)
    if inspect.isfunction(obj):
        yield name, obj
        return
    if inspect.isclass(obj) and "__init__" in vars(obj) and obj.__doc__:
        yield name, _ClassDoc(obj)  # a class documents its constructor's arguments
    members = vars(obj).items() if inspect.isclass(obj) else (
        (n, v) for n, v in vars(obj).items() if getattr(v, "__module__", None) == obj.__name__)
    for member, value in members:
        if member.startswith("_") and member != "__init__":
            continue
        if inspect.isclass(value):
            yield from _objects(f"{name}.{member}")
        elif inspect.isfunction(value) and (member != "__init__" or value.__doc__):
            yield f"{name}.{member}", value


class _ClassDoc:
    """A class's own docstring, checked against its ``__init__``'s signature."""

    def __init__(self, cls: type) -> None:
        self.__doc__ = cls.__doc__
        self.__signature__ = inspect.signature(vars(cls)["__init__"])


def args_entries(doc: str) -> list[list[str]]:
    """The names of each entry of a Google-style ``Args:`` section."""
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return []
    indent = None
    entries = []
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            break
        indent = depth if indent is None else indent
        if depth != indent:
            continue  # a continuation line
        m = ENTRY.match(line.strip())
        if m is None:
            entries.append([line.strip()])  # not an entry: reported as such
            continue
        names = re.sub(r"\([^)]*\)", "", m.group("names"))
        entries.append([n.strip().lstrip("*") for n in names.split(",")])
    return entries


def test_args_entries_reader() -> None:
    doc = """Summary.

    Args:
        q: (B, H, S, D).
        k, v: (B, Hkv, S, D), the keys
            and values.
        softcap, alibi_slopes (H,), sinks (H,): the features.
        **kwargs: the rest.

    Returns:
        something.
    """
    assert args_entries(doc) == [["q"], ["k", "v"], ["softcap", "alibi_slopes", "sinks"], ["kwargs"]]
    assert args_entries("Summary.\n\n    Args:\n        See the module.\n") == [["See the module."]]


@pytest.mark.parametrize("name", API)
def test_documented_arguments_exist(name: str) -> None:
    problems = []
    for qualname, fn in _objects(name):
        if not fn.__doc__:
            continue
        params = set((fn.__signature__ if isinstance(fn, _ClassDoc) else inspect.signature(fn)).parameters)
        for entry in args_entries(fn.__doc__):
            missing = [n for n in entry if n not in params]
            if missing:
                problems.append(f"{qualname}: {', '.join(missing)}")
    assert not problems, "docstring entries that are not parameters:\n" + "\n".join(problems)
