"""The import graph of ``multihead``: no circles, and no private name taken across subpackages.

Every file under ``src/multihead`` is read with :mod:`ast` (nothing is imported). Every
``import`` statement counts, at module level, inside a function and under
``if TYPE_CHECKING:`` alike: a late import still ties two files into one unit that has to be
read, tested and changed together, and a type-only one ties them for the reader and the type
checker. Relative imports are resolved; ``from X import name`` is an edge to ``X.name`` where
that is a module or package of multihead, else to ``X``. Importing ``a.b.c`` also runs
``a/__init__`` and ``a/b/__init__``, but those implicit edges to the parent packages are not
drawn: the modules of a subpackage may import one another without the package's
``__init__`` joining every circle.

The exceptions are listed below, each with its reason, and each must still exist (a stale
entry fails), so that the lists only shrink.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import multihead as mh

SRC = Path(__file__).resolve().parents[2] / "src" / "multihead"

#: Imports that run up the floors on purpose: a lower class's documented convenience
#: classmethod imports the upper module inside itself, so that ``X.from_hf(...)`` reads as
#: the natural spelling while the upper module (which builds X) imports X at module level.
#: (importer, imported, function holding the import): the reason.
UPWARD: dict[tuple[str, str, str], str] = {
    ("multihead.module", "multihead.interop", "MultiHeadAttention.from_torch"):
        "documented convenience over multihead.interop.from_torch, which builds MultiHeadAttention",
    ("multihead.module", "multihead.interop", "MultiHeadAttention.from_hf"):
        "documented convenience over multihead.interop.from_hf, which builds MultiHeadAttention",
    ("multihead.latent", "multihead.interop.hf_registry", "MultiHeadLatentAttention.from_hf"):
        "documented convenience: the registry's description of DeepSeek's class is what it converts",
    ("multihead.config", "multihead.interop.hf_layers", "AttentionConfig.from_hf"):
        "documented convenience over interop.hf_layers.read, which builds AttentionConfig (its family "
        "readers, hf_layers.SPECIAL, return AttentionConfigs: tests/interop/test_deepseek.py replaces one)",
}


@dataclass(frozen=True)
class Import:
    """One edge: ``importer`` imports ``imported`` (and ``name`` from it, for ``from ... import``)."""

    importer: str
    imported: str
    name: str | None  # the name after ``import`` in ``from X import name``; None for ``import X``
    source: str  # the module the name comes from: X of ``from X import name``
    scope: str  # the function or class holding the statement ("" at module level)
    where: str  # file:line

    def __str__(self) -> str:
        what = f"from {self.source} import {self.name}" if self.name is not None else f"import {self.imported}"
        return f"{self.where}: {what}" + (f" (in {self.scope})" if self.scope else "")


def _modules() -> tuple[dict[str, Path], set[str]]:
    """Every module of multihead by dotted name, and which of them are packages."""
    modules, packages = {}, set()
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
            packages.add(".".join(parts))
        modules[".".join(parts)] = path
    return modules, packages


MODULES, PACKAGES = _modules()


def _package(module: str) -> str:
    """The package ``module`` belongs to (a package belongs to itself)."""
    return module if module in PACKAGES else module.rpartition(".")[0]


class _Collector(ast.NodeVisitor):
    """Every import statement of one file, with the qualified name of the scope holding it."""

    def __init__(self, module: str, path: Path) -> None:
        self.module, self.path, self.scope, self.found = module, path, [], []

    def _enter(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _enter

    def _add(self, imported: str, name: str | None, source: str, line: int) -> None:
        where = f"{self.path.relative_to(SRC.parent.parent)}:{line}"
        self.found.append(Import(self.module, imported, name, source, ".".join(self.scope), where))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "multihead":
                self._add(alias.name, None, alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = _package(self.module).split(".")
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] != "multihead":
            return
        for alias in node.names:
            candidate = f"{source}.{alias.name}"
            self._add(candidate if candidate in MODULES else source, alias.name, source, node.lineno)


def _imports() -> Iterator[Import]:
    for module, path in MODULES.items():
        collector = _Collector(module, path)
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        yield from collector.found


IMPORTS = list(_imports())


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _upward(edge: Import) -> bool:
    return (edge.importer, edge.imported, edge.scope) in UPWARD


def _circles(edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for e in edges:
        if e.importer != e.imported:
            graph[e.importer].add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # the graph has ~80 nodes: recursion is shallow
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _one_cycle(component: list[str], edges: list[Import]) -> list[Import]:
    """A shortest cycle through the component's first module, as the imports that make it."""
    inside = set(component)
    by_source: dict[str, list[Import]] = {}
    for e in edges:
        if e.importer in inside and e.imported in inside and e.importer != e.imported:
            by_source.setdefault(e.importer, []).append(e)
    start = component[0]
    paths: dict[str, list[Import]] = {start: []}
    frontier = [start]
    while frontier:  # breadth first: the first way back to ``start`` is a shortest cycle
        nxt = []
        for v in frontier:
            for e in by_source.get(v, []):
                if e.imported == start:
                    return paths[v] + [e]
                if e.imported not in paths:
                    paths[e.imported] = paths[v] + [e]
                    nxt.append(e.imported)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {component}")


# ---- the reading itself ------------------------------------------------------------------------
def test_every_import_of_multihead_names_a_module_that_exists() -> None:
    unknown = [str(e) for e in IMPORTS if e.imported not in MODULES]
    assert not unknown, "imports of modules that are not files of src/multihead:\n" + "\n".join(unknown)


def test_the_reader_sees_every_kind_of_import() -> None:
    """Module level, relative at two depths, a module imported by name, ``import a.b``, under
    ``if TYPE_CHECKING:`` and inside a method: the reading the tests below rely on."""
    code = "\n".join([
        "from typing import TYPE_CHECKING",
        "from . import hf_config",
        "from ..backends import native, get_backend",
        "from ..config import AttentionConfig",
        "import multihead.masks",
        "import torch",
        "if TYPE_CHECKING:",
        "    from ..module import MultiHeadAttention",
        "class Reader:",
        "    def read(self):",
        "        from .hf_layers import read",
    ])
    collector = _Collector("multihead.interop.reader", SRC / "interop" / "reader.py")
    collector.visit(ast.parse(code))
    got = {(e.imported, e.name, e.scope) for e in collector.found}
    assert got == {("multihead.interop.hf_config", "hf_config", ""),
                   ("multihead.backends.native", "native", ""), ("multihead.backends", "get_backend", ""),
                   ("multihead.config", "AttentionConfig", ""), ("multihead.masks", None, ""),
                   ("multihead.module", "MultiHeadAttention", ""),
                   ("multihead.interop.hf_layers", "read", "Reader.read")}


# ---- no circles ----------------------------------------------------------------------------------
def test_no_import_circles() -> None:
    edges = [e for e in IMPORTS if not _upward(e)]
    circles = _circles(edges)
    report = []
    for component in circles:
        cycle = _one_cycle(component, edges)
        report.append(f"circle of {len(component)} modules {component}, e.g.:\n    "
                      + "\n    ".join(str(e) for e in cycle))
    assert not circles, "import circles (an edge may be excused only in UPWARD):\n" + "\n".join(report)


@pytest.mark.parametrize("edge", sorted(UPWARD), ids=lambda e: f"{e[0]}->{e[1]}")
def test_each_excused_upward_import_still_exists(edge: tuple[str, str, str]) -> None:
    assert any(_upward(e) and (e.importer, e.imported, e.scope) == edge for e in IMPORTS), (
        f"{edge} is excused in UPWARD but no longer imported there: delete the entry")


def test_the_excused_upward_imports_are_late() -> None:
    """An excused import sits inside its method: importing the lower module never runs the upper one."""
    assert all(scope for _, _, scope in UPWARD)


# ---- private names -------------------------------------------------------------------------------
def _private_across() -> list[Import]:
    """Imports of a private name (``_x``: a function, a constant or a module) defined in a module of
    another subpackage than the importer's."""
    found = []
    for e in IMPORTS:
        name = e.name if e.name is not None else e.imported.rpartition(".")[2]
        source = e.source if e.name is not None else e.imported.rpartition(".")[0]
        if _is_private(name) and _package(source) != _package(e.importer):
            found.append(e)
    return found


def test_no_private_name_is_imported_from_another_subpackage() -> None:
    offending = [str(e) for e in _private_across()]
    assert not offending, ("private names imported across subpackages (give them a public name, or move "
                           "them down):\n" + "\n".join(offending))


# ---- the removed shims stay removed ----------------------------------------------------------------
def test_the_kernels_shim_is_gone() -> None:
    """``multihead.kernels`` re-exported the router and the projections' GEMM; their homes are
    :mod:`multihead.backends.auto`, :mod:`multihead.backends.blocked` and :mod:`multihead.linear`."""
    assert importlib.util.find_spec("multihead.kernels") is None
    with pytest.raises(AttributeError, match="kernels"):
        mh.kernels  # noqa: B018  (the lazy attribute must not exist)
    assert not [str(e) for e in IMPORTS if e.imported == "multihead.kernels"]


#: The modules allowed a dynamic import (see the test below).
DYNAMIC = ("multihead", "multihead.backends.native.loader")


def test_no_import_hides_from_a_static_reading() -> None:
    """``__import__`` and ``importlib.import_module`` name modules this reading cannot follow;
    the package's own lazy attributes (``multihead.__getattr__``) and the kernels' loader, which
    imports the build of the kernels the CPU runs (an extension module: it imports nothing of
    multihead), are the uses, by design."""
    hidden = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if called in ("__import__", "import_module") and module not in DYNAMIC:
                    hidden.append(f"{path.relative_to(SRC.parent.parent)}:{node.lineno}")
    assert not hidden, "dynamic imports: " + ", ".join(hidden)
