"""The one structural rule: span and key range are exactly the rows and hull of the dense mask."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.masks import Structure, full_mask

structures = st.builds(Structure, causal=st.booleans(), window=st.none() | st.integers(1, 12))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(structures, st.integers(0, 20), st.integers(0, 20))
def test_span_is_each_row_of_the_dense_mask(structure: Structure, sq: int, sk: int) -> None:
    dense = structure.dense(sq, sk)  # (Sq, Sk)
    for i in range(sq):
        lo, hi = structure.span(i + sk - sq, sk)
        row = torch.zeros(sk, dtype=torch.bool)
        row[lo:hi] = True
        assert torch.equal(dense[i], row), (i, lo, hi)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(structures, st.integers(1, 20), st.integers(0, 20), st.data())
def test_key_range_is_the_hull_of_a_block_of_rows(structure: Structure, sq: int, sk: int, data) -> None:
    p0 = data.draw(st.integers(0, sq - 1))
    p1 = data.draw(st.integers(p0 + 1, sq))
    off = sk - sq
    lo, hi = structure.key_range(p0 + off, p1 + off, sk)
    visible = structure.dense(sq, sk)[p0:p1].any(0).nonzero().flatten()  # keys some row sees
    if len(visible) == 0:
        assert hi <= lo
    else:
        assert (lo, hi) == (int(visible.min()), int(visible.max()) + 1)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(structures, st.lists(st.integers(0, 30), min_size=1, max_size=6), st.lists(st.integers(-1, 30), max_size=8))
def test_allows_on_cache_positions_equals_the_span(structure: Structure, queries: list[int], keys: list[int]) -> None:
    """A KV cache asks the rule with explicit positions (slots hold positions, -1 empty)."""
    qp = torch.tensor(queries)[:, None]
    kp = torch.tensor(keys, dtype=torch.long)[None, :]
    got = structure.allows(qp, kp)
    for i, q in enumerate(queries):
        lo, hi = structure.span(q, 1 << 20)
        for j, key in enumerate(keys):
            if key >= 0:
                assert bool(got[i, j]) == (lo <= key < hi)


def test_the_public_masks_and_full_mask_are_built_on_it() -> None:
    assert torch.equal(mh.masks.causal_mask(3, 5), Structure(causal=True).dense(3, 5))
    assert torch.equal(mh.masks.sliding_window_mask(4, 6, window=2), Structure(True, 2).dense(4, 6))
    assert full_mask(None, False, None, 3, 3, None) is None
    m = torch.rand(2, 1, 3, 4) > 0.5
    assert torch.equal(full_mask(m, True, None, 3, 4, None), m & Structure(True).dense(3, 4))


def test_the_structural_rule_has_one_python_home_and_one_cpp_home() -> None:
    """Mechanical check of the refactor: window arithmetic appears only in masks.py and
    in common.h's span() (the per-block bands and key ranges call them)."""
    import re
    from pathlib import Path

    src = Path(mh.__file__).parent
    pattern = re.compile(r"\bwindow\s[-+]\s1\b|\s[-+]\s(P\.|self\.)?window\b")
    homes = set()
    for path in [*src.rglob("*.py"), *src.rglob("*.h"), *src.rglob("*.cpp")]:
        code = [line for line in path.read_text().splitlines()
                if not line.lstrip().startswith(("#", "//")) and "``" not in line]
        if any(pattern.search(line) for line in code):
            homes.add(path.name)
    assert homes <= {"masks.py", "common.h", "reference.py"}, homes
