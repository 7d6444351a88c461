"""Packed sequences' bounds, worked out once: the host path of small CPU positions equals the
torch path, the bounds equal their definition written out (hypothesis), and
:func:`multihead._memo.derived` reuses a value only while its tensor is unchanged.

Notation: B batch, S tokens, N packed sequences.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from multihead import _memo, masks


@st.composite
def packings(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(positions (B, S) or (S,), cu_seqlens (N+1,) or (B, N+1) with empty sequences, S)."""
    b, s = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    rows = []
    for _ in range(b):
        lengths = draw(st.lists(st.integers(1, 7), min_size=1, max_size=s))
        rows.append([p for n in lengths for p in range(n)][:s] + list(range(max(0, s - sum(lengths)))))
    positions = torch.tensor(rows) if draw(st.booleans()) else torch.tensor(rows[0])
    cuts = [sorted(draw(st.lists(st.integers(0, s), max_size=6))) for _ in range(b)]
    cu = torch.tensor([[0, *c, s] for c in cuts]) if len({len(c) for c in cuts}) == 1 and draw(st.booleans()) \
        else torch.tensor([0, *cuts[0], s])
    return positions, cu, s


def _bounds_written_out(cu: torch.Tensor, s: int) -> torch.Tensor:
    """(B|1, 2, S): token t lies in sequence n, the last with cu[n] <= t (empty ones hold none)."""
    rows = cu.reshape(-1, cu.shape[-1]).tolist()
    out = []
    for row in rows:
        n = [max(i for i in range(len(row) - 1) if row[i] <= t) for t in range(s)]
        out.append([[row[i] for i in n], [row[i + 1] for i in n]])
    return torch.tensor(out, dtype=torch.int64)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(packings())
def test_the_host_path_equals_the_torch_path(case: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    positions, cu, s = case
    host = masks.cu_seqlens_from_positions(positions), masks.segment_bounds(cu, s)
    limit = masks.HOST_BOUNDS_MAX
    try:
        masks.HOST_BOUNDS_MAX = -1  # every size on the torch path
        device = masks.cu_seqlens_from_positions(positions), _bounds_written_out(cu, s)
    finally:
        masks.HOST_BOUNDS_MAX = limit
    for a, b in zip(host, device):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)


def test_derived_is_made_once_while_the_tensor_is_unchanged() -> None:
    made = []

    def make(t: torch.Tensor) -> torch.Tensor:
        made.append(1)
        return t * 2

    source = torch.arange(5)
    first = _memo.derived(source, "double", make)
    assert _memo.derived(source, "double", make) is first and len(made) == 1
    assert torch.equal(_memo.derived(source, "other", make), first) and len(made) == 2  # another value of it
    source.add_(1)  # an in-place change: its version moves
    assert torch.equal(_memo.derived(source, "double", make), torch.arange(1, 6) * 2) and len(made) == 3
    again = _memo.derived(source, "double", make)
    again.zero_()  # the value changed by a caller: made afresh
    assert torch.equal(_memo.derived(source, "double", make), torch.arange(1, 6) * 2) and len(made) == 4
    assert torch.equal(_memo.derived(source.clone(), "double", make), torch.arange(1, 6) * 2)  # another tensor
    assert len(made) == 5


def test_derived_remembers_small_inference_tensors_by_value_and_is_bounded() -> None:
    """Inference tensors count no in-place change: a small one is remembered while it and the
    value hold the same values (an in-place change of either is seen), a large one never."""
    made = []

    def make(t: torch.Tensor) -> torch.Tensor:
        made.append(1)
        return t + 1

    with torch.inference_mode():
        source = torch.arange(3)
        first = _memo.derived(source, "x", make)
        assert _memo.derived(source, "x", make) is first and len(made) == 1
        source.add_(1)  # not counted by a version: seen by value
        assert torch.equal(_memo.derived(source, "x", make), torch.arange(1, 4) + 1) and len(made) == 2
        _memo.derived(source, "x", make).zero_()  # the value changed by a caller: made afresh
        assert torch.equal(_memo.derived(source, "x", make), torch.arange(1, 4) + 1) and len(made) == 3
        assert torch.equal(_memo.derived(source.clone(), "x", make), torch.arange(1, 4) + 1)  # another tensor
        assert len(made) == 4
        large = torch.zeros(_memo.BY_VALUE_MAX + 1, dtype=torch.int64)
        for _ in range(2):
            _memo.derived(large, "x", make)
        assert len(made) == 6
        for i in range(3 * _memo.DERIVED_SIZE):
            _memo.derived(torch.arange(i + 1), "x", make)
    for i in range(3 * _memo.DERIVED_SIZE):
        _memo.derived(torch.arange(i + 1), "x", make)
    assert len(_memo._derived) <= _memo.DERIVED_SIZE


def test_a_value_made_under_inference_mode_is_remembered_by_value() -> None:
    """A tensor with a version counter whose value is made under inference_mode (an HF mask made
    before the model call): remembered, the value compared with a copy."""
    made = []
    source = torch.arange(4)
    with torch.inference_mode():
        first = _memo.derived(source, "y", lambda t: made.append(1) or t * 3)
        assert first.is_inference() and _memo.derived(source, "y", lambda t: made.append(1) or t * 3) is first
        first.add_(1)  # the value changed by a caller: made afresh
        assert torch.equal(_memo.derived(source, "y", lambda t: made.append(1) or t * 3), torch.arange(4) * 3)
    assert len(made) == 2


@pytest.mark.parametrize("seq", [masks.HOST_BOUNDS_MAX, masks.HOST_BOUNDS_MAX + 1])
def test_both_paths_take_long_packings(seq: int) -> None:
    """At the host path's limit and just past it (the torch path): one long packing, its cumulative
    lengths from positions and its bounds."""
    cu = torch.tensor([0, 3, 3, seq // 2, seq])
    positions = torch.cat([torch.arange(3), torch.arange(seq // 2 - 3), torch.arange(seq - seq // 2)])
    assert masks.cu_seqlens_from_positions(positions)[0, :4].tolist() == [0, 3, seq // 2, seq]
    bounds = masks.segment_bounds(cu, seq)
    assert bounds.shape == (1, 2, seq)
    assert bounds[0, :, 0].tolist() == [0, 3] and bounds[0, :, 3].tolist() == [3, seq // 2]
    assert bounds[0, :, -1].tolist() == [seq // 2, seq]
