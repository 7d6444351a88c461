"""torch.export and torch.compile(dynamic=True) with a dynamic sequence length: one program valid over the whole range.

The router used to compare sizes while tracing ("few rows", "enough scores"), and each
comparison became a guard that narrowed the range (``Dim("s", min=2, max=1024)`` failed with
"s <= 32" or "16*s*s >= 16384"). With symbolic sizes "auto" now takes one path valid at every
size, and the native operator picks its loop from the real sizes inside.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim, export

import multihead as mh
from multihead.backends.native import ops

#: Sizes on both sides of every threshold the rules had (rows, scores), and the range's ends.
SIZES = (2, 3, 31, 33, 64, 129, 700, 1024)


def _layer(**kw: object) -> mh.MultiHeadAttention:
    torch.random.default_generator.manual_seed(0)
    return mh.MultiHeadAttention(64, 4, **kw).eval()


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, num_kv_heads=2, rope=mh.RoPE(16)),
                                dict(causal=True, window=8)], ids=["bidirectional", "causal", "gqa-rope", "window"])
def test_export_holds_over_the_whole_range(kw: dict[str, object]) -> None:
    layer = _layer(**kw)
    program = export(layer, (torch.randn(1, 16, 64),), dynamic_shapes=({1: Dim("s", min=2, max=1024)},))
    run = program.module()
    for s in SIZES:
        x = torch.randn(1, s, 64)
        with torch.no_grad():
            torch.testing.assert_close(run(x), layer(x), atol=2e-5, rtol=1e-5)


def test_export_with_dynamic_batch_and_padding() -> None:
    layer = _layer(causal=True)
    b, s = Dim("b", min=1, max=8), Dim("s", min=2, max=512)
    program = export(layer, (torch.randn(2, 16, 64),), {"key_mask": torch.ones(2, 16, dtype=torch.bool)},
                     dynamic_shapes={"x": {0: b, 1: s}, "key_mask": {0: b, 1: s}})
    for batch, seq in ((1, 2), (3, 40), (5, 300)):
        x, key_mask = torch.randn(batch, seq, 64), torch.ones(batch, seq, dtype=torch.bool)
        key_mask[-1, seq // 2:] = False  # the last row padded
        with torch.no_grad():
            want = layer(x, key_mask=key_mask)
        got = program.module()(x, key_mask=key_mask)
        torch.testing.assert_close(got[key_mask], want[key_mask], atol=2e-5, rtol=1e-5)


def test_eager_decisions_are_unchanged() -> None:
    q = torch.randn(1, 1, 8, 32)
    assert mh.backends.auto.auto_path(q, q, q) == "sdpa"  # sizes are ints: the measured rules decide (64 scores)
    assert not ops.symbolic(q)


@pytest.mark.parametrize("rows", [1, 8, 40])
def test_the_operator_picks_its_loop_when_told_none(rows: int) -> None:
    q, k, v = torch.randn(1, 4, rows, 32), torch.randn(1, 2, 300, 32), torch.randn(1, 2, 300, 32)
    decode = rows * 2 <= mh.native.DECODE_ROWS  # what the router would pick
    chosen, _ = torch.ops.multihead.attention(q, k, v, None, 0.2, True, None, None)
    given, _ = torch.ops.multihead.attention(q, k, v, None, 0.2, True, None, decode)
    assert torch.equal(chosen, given)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, num_kv_heads=2, rope=mh.RoPE(16))],
                         ids=["bidirectional", "causal-gqa-rope"])
def test_compile_dynamic_makes_one_graph_for_every_size(kw: dict[str, object]) -> None:
    """torch.compile(dynamic=True): sizes crossing every threshold of the rules recompile nothing."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer = _layer(**kw)
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for s in SIZES:
            x = torch.randn(1, s, 64)
            torch.testing.assert_close(compiled(x), layer(x), atol=2e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
