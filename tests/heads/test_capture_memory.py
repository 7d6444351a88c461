"""mh.heads.capture(limit_bytes=...): checked per layer from that layer's own shapes, counting
what the backend computes meanwhile; the memory a capture takes, measured with the profiler's
allocation events (torch's CPU allocator reports each allocation and free), stays under it.

Notation: B batch, S queries, Sk keys, H heads, E embed_dim.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import multihead as mh

E, H = 32, 4


def peak_bytes(fn: Callable[[], object]) -> int:
    """The highest total of live bytes allocated by torch on the CPU while ``fn`` runs (from 0)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = top = 0
    for _, n in events:
        live += n
        top = max(top, live)
    return top


class TwoTowers(nn.Module):
    """A short text through one tower, a long one through the other."""

    def __init__(self) -> None:
        super().__init__()
        self.short = mh.MultiHeadAttention(E, H)
        self.long = mh.MultiHeadAttention(E, H)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.short(a), self.long(b)


class Decoder(nn.Module):
    """Self-attention over a few tokens, then cross-attention to a long memory."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = mh.MultiHeadAttention(E, H)
        self.cross = mh.MultiHeadAttention(E, H)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.cross(self.self_attn(x), memory)


def _capture(model: nn.Module, run: Callable[[], object], what: tuple[str, ...], limit: int) -> mh.heads.Capture:
    with torch.no_grad(), mh.heads.capture(model, what=what, limit_bytes=limit) as cap:
        run()
    return cap


@pytest.mark.parametrize("case", ["two towers", "cross-attention"])
def test_a_layer_whose_own_shapes_pass_the_limit_is_refused_by_name(case: str) -> None:
    torch.random.default_generator.manual_seed(0)
    if case == "two towers":
        model: nn.Module = TwoTowers()
        a, b = torch.randn(1, 8, E), torch.randn(1, 256, E)
        run: Callable[[], object] = lambda: model(a, b)  # noqa: E731
        big, s, sk = "long", 256, 256
        limit = 2_000_000  # records 1,083,392 bytes fit; with the 3,145,728 bytes of workspace they do not
    else:
        model = Decoder()
        x, memory = torch.randn(1, 8, E), torch.randn(1, 2048, E)
        run = lambda: model(x, memory)  # noqa: E731
        big, s, sk = "cross", 8, 2048
        limit = 500_000  # records 266,752 bytes fit; with the 786,432 bytes of workspace they do not
    what = ("weights", "heads")
    with torch.no_grad():
        taken = peak_bytes(lambda: _capture(model, run, what, 1 << 40)) - peak_bytes(run)
    assert taken > limit  # the case is one that would go over
    with torch.no_grad(), mh.heads.capture(model, what=what, limit_bytes=limit) as cap:
        with pytest.raises(ValueError, match=rf"layer '{big}' .*B=1, S={s} queries, Sk={sk} keys.*"
                                             rf"limit_bytes={limit:,}"):
            run()
    assert big not in cap.weights  # refused before it computed


def test_a_capture_within_the_limit_takes_no_more_memory_than_the_limit() -> None:
    torch.random.default_generator.manual_seed(0)
    model = TwoTowers()
    a, b = torch.randn(1, 8, E), torch.randn(1, 256, E)
    what = ("weights", "heads")
    with torch.no_grad():
        with mh.heads.capture(model, what=what) as probe:
            need = sum(sum(probe.call_bytes(n, 1, s, s, torch.float32)) for n, s in (("short", 8), ("long", 256)))
        plain = peak_bytes(lambda: model(a, b))
        taken = peak_bytes(lambda: _capture(model, lambda: model(a, b), what, need)) - plain
    assert 0 < taken <= need


def test_a_one_head_capture_states_its_bound_and_stays_under_it() -> None:
    """The backend computes every head's weights; the capture keeps one head's, counts them all,
    and the memory measured during the call is within that bound (and not far under it)."""
    torch.random.default_generator.manual_seed(0)
    layer = mh.MultiHeadAttention(E, H)
    b, s = 1, 384
    x = torch.randn(b, s, E)
    with torch.no_grad():
        plain = peak_bytes(lambda: layer(x))
        with mh.heads.capture(layer, heads=[2], what=("weights",)) as probe:
            kept, workspace = probe.call_bytes("", b, s, s, torch.float32)
        assert kept == b * 1 * s * s * 4  # one head's weights are kept
        assert workspace == mh.heads.WORKSPACE_COPIES * b * H * s * s * 4  # every head's are computed
        with mh.heads.capture(layer, heads=[2], what=("weights",), limit_bytes=kept + workspace) as cap:
            taken = peak_bytes(lambda: layer(x)) - plain
        assert cap.weights[""].shape == (b, 1, s, s)
        assert kept + workspace // 2 < taken <= kept + workspace
        with mh.heads.capture(layer, heads=[2], what=("weights",), limit_bytes=kept + workspace - 1) as cap:
            with pytest.raises(ValueError, match=rf"layer '' would need {kept + workspace:,} bytes.*1 of {H} heads"):
                layer(x)
        assert cap.nbytes == 0
