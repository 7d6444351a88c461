"""The layer's pipeline is written once, and the cache alone writes its counters.

Read from the source (``ast``), so a copy of the pipeline or a second writer of the counters
fails here whatever it computes:

* ``split_heads(`` and ``merge_heads(`` are called only by the layer's own steps
  (:mod:`multihead.module`) and the float64 reference; every other path (the Hugging Face
  wrappers, context parallelism, the heads toolkit) composes ``layer.split`` / ``layer.output``.
* the KV cache's counters — ``lengths``, ``slot_pos`` and the host copy ``_host_lengths`` (its
  store ``_mirror``) — are written (assigned, or changed in place) only in :mod:`multihead.cache`; a native step
  advances them only through the tensors :meth:`KVCache.native_counters` hands it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import multihead

SRC = Path(multihead.__file__).parent
COUNTERS = frozenset({"lengths", "slot_pos", "_host_lengths", "_mirror"})
IN_PLACE = frozenset({"add_", "sub_", "copy_", "zero_", "fill_", "masked_fill_", "scatter_", "index_copy_",
                      "index_fill_", "put_", "clamp_"})


def _files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _target_name(node: ast.AST) -> str | None:
    """The counter a store or in-place call reaches: ``x.lengths``, ``x.slot_pos[...]``, ``lengths[...]``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def counter_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, counter) for every assignment to a counter and every in-place method call on one."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                name = _target_name(t)
                # A plain local name assigned (``lengths = ...``) is a new binding, not a write.
                if name in COUNTERS and not isinstance(t, ast.Name):
                    found.append((node.lineno, name))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in IN_PLACE:
            name = _target_name(node.func.value)
            if name in COUNTERS:
                found.append((node.lineno, name))
    return found


def calls_of(tree: ast.AST, names: frozenset[str]) -> list[tuple[int, str]]:
    """(line, name) for every call of a function called one of ``names`` (bare or as an attribute)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in names:
                found.append((node.lineno, name))
    return found


def _relative(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def test_only_the_cache_writes_its_counters() -> None:
    writers = {_relative(p): counter_writes(ast.parse(p.read_text())) for p in _files()}
    outside = {name: lines for name, lines in writers.items() if lines and name != "cache.py"}
    assert not outside, f"KVCache counters written outside cache.py: {outside}"
    assert len(writers["cache.py"]) >= 5  # the writers are there: append/commit, crop, reset, undo, reorder


def test_the_heads_are_split_and_merged_only_by_the_layers_steps() -> None:
    users = {_relative(p): calls_of(ast.parse(p.read_text()), frozenset({"split_heads", "merge_heads"}))
             for p in _files()}
    callers = {name for name, lines in users.items() if lines}
    assert callers == {"module.py", "reference.py"}, users


@pytest.mark.parametrize("source, expected", [
    ("cache.lengths.add_(1)", [(1, "lengths")]),
    ("kv._host_lengths = [0]", [(1, "_host_lengths")]),
    ("slot_pos[b, n] = -1", [(1, "slot_pos")]),
    ("self.slot_pos.scatter_(1, i, p)", [(1, "slot_pos")]),
    ("lengths = cache.lengths", []),  # reading, and a local name
    ("n = kv.lengths.tolist()", []),
])
def test_the_counter_reader_sees_writes_and_only_writes(source: str, expected: list[tuple[int, str]]) -> None:
    assert counter_writes(ast.parse(source)) == expected
