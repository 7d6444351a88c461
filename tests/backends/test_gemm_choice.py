"""The projections' GEMM is this machine's faster one, measured once and kept (gemm_choice).

The rest of the suite runs with ``MULTIHEAD_GEMM=onednn`` (tests/conftest.py); here the
other choice runs the layer end to end, and the measurement, its record in the cache
folder and the setting are checked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import multihead as mh
from multihead.linear import linear
from multihead.backends import gemm

from conftest import reference_layer

needs_onednn = pytest.mark.skipif(gemm.onednn_gemm() is None, reason="this torch has no oneDNN GEMM")


@pytest.fixture(autouse=True)
def _setting_read_again() -> Iterator[None]:
    """``$MULTIHEAD_GEMM`` is read once per process (gemm.gemm_setting): each test here reads it
    again after changing it (:func:`setenv`), and the next test reads the environment restored
    (this fixture, set up before ``monkeypatch``, is torn down after it)."""
    gemm.refresh_settings()
    yield
    gemm.refresh_settings()


def setenv(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """``$MULTIHEAD_GEMM = value`` for this test, read again now."""
    monkeypatch.setenv("MULTIHEAD_GEMM", value)
    gemm.refresh_settings()


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No setting, an empty cache folder, and no verdict remembered by this process."""
    monkeypatch.delenv("MULTIHEAD_GEMM", raising=False)
    gemm.refresh_settings()
    monkeypatch.setenv("MULTIHEAD_CACHE_DIR", str(tmp_path / "cache"))
    gemm._measured_choice.cache_clear()
    yield tmp_path / "cache"
    gemm._measured_choice.cache_clear()


def _gemm_ops(fn) -> set[str]:  # type: ignore[no-untyped-def]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name in ("aten::addmm", "aten::mm", "mkldnn::_linear_pointwise")}


def test_a_setting_other_than_the_two_gemms_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, "mkl")
    with pytest.raises(ValueError, match=r"MULTIHEAD_GEMM must be one of \('onednn', 'torch'\), got 'mkl'"):
        gemm.gemm_choice()
    with pytest.raises(ValueError, match="MULTIHEAD_GEMM"):  # before the layer computes anything
        mh.MultiHeadAttention(64, 4)(torch.randn(1, 300, 64))


def test_onednn_disabled_means_torch_whatever_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, "onednn")
    with torch.backends.mkldnn.flags(enabled=False):
        assert gemm.gemm_choice() == "torch" and not gemm.onednn_available()
        x, w = torch.randn(200, 256), torch.randn(256, 256)
        with torch.no_grad():
            assert _gemm_ops(lambda: linear(x, w)) == {"aten::mm"}


@needs_onednn
def test_the_measurement_times_both_and_picks_by_the_paired_ratio() -> None:
    found = gemm.gemm_measurement(rounds=3)
    assert set(found) == {"choice", "torch_over_onednn", "onednn_ms", "torch_ms"}
    assert found["onednn_ms"] > 0 and found["torch_ms"] > 0 and found["torch_over_onednn"] > 0
    if found["torch_over_onednn"] >= gemm.TORCH_WINS_BELOW:
        assert found["choice"] == "onednn"


@pytest.mark.parametrize("ratios, choice", [
    ([0.8] * 11, "torch"),
    ([0.9, 0.9, 0.93, 0.94, 0.94, 0.94, 0.96, 0.97, 0.98, 0.99, 0.99], "torch"),  # median 0.94, 3/4 faster
    ([0.96] * 11, "onednn"),  # within 5%: the default stays
    ([0.5] * 6 + [1.1] * 5, "onednn"),  # median 0.5 but slower in 5 rounds of 11: a busy machine
    ([1.2] * 11, "onednn"),
])
def test_torch_matmul_is_chosen_only_when_clearly_faster(ratios: list, choice: str) -> None:
    assert gemm._verdict(ratios) == choice


@needs_onednn
def test_the_measurement_times_real_kernels_when_first_asked_inside_a_tracer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked first while export traces (fake tensors), it still times real GEMMs on real tensors."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    seen = []

    def op(x: torch.Tensor, w: torch.Tensor, *rest: object) -> torch.Tensor:
        seen.append(isinstance(x, FakeTensor) or isinstance(w, FakeTensor))
        return torch.matmul(x, w.t())

    monkeypatch.setattr(gemm, "onednn_gemm", lambda: op)
    with FakeTensorMode():
        found = gemm.gemm_measurement(rounds=2)
    assert seen == [False] * 4 and found["onednn_ms"] > 0  # two warm-up rounds, two timed


@needs_onednn
def test_the_verdict_is_measured_once_per_machine_and_kept(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first process measures and writes the record (mode 0600); later processes read it
    without timing anything, so every process on the machine uses the same GEMM."""
    calls = []

    def measured(rounds: int = 7) -> dict:
        calls.append(rounds)
        return {"choice": "torch", "torch_over_onednn": 0.8, "onednn_ms": 10.0, "torch_ms": 8.0}

    monkeypatch.setattr(gemm, "gemm_measurement", measured)
    assert gemm.gemm_choice() == "torch" and not gemm.onednn_available()
    assert calls == [7]
    record = fresh / "gemm-choice.json"
    assert record.stat().st_mode & 0o777 == 0o600
    kept = json.loads(record.read_text())
    assert list(kept.values()) == [measured()] and f"torch={torch.__version__}" in next(iter(kept))
    calls.clear()
    gemm._measured_choice.cache_clear()  # as a new process

    def must_not_run(rounds: int = 7) -> dict:
        raise AssertionError("measured again")

    monkeypatch.setattr(gemm, "gemm_measurement", must_not_run)
    assert gemm.gemm_choice() == "torch"
    # Measured again on purpose (multihead bench does, first): replaced, and used from now on.
    monkeypatch.setattr(gemm, "gemm_measurement", lambda rounds=11: {"choice": "onednn"})
    assert gemm.keep_gemm_measurement() == {"choice": "onednn"}
    assert gemm.gemm_choice() == "onednn" and list(json.loads(record.read_text()).values()) == [{"choice": "onednn"}]


@needs_onednn
@pytest.mark.parametrize("damage", ["not json", "wrong choice", "others may write"])
def test_a_damaged_or_unsafe_record_is_measured_again(fresh: Path, monkeypatch: pytest.MonkeyPatch,
                                                      damage: str) -> None:
    fresh.mkdir(mode=0o700, parents=True)
    record = fresh / "gemm-choice.json"
    key = gemm._machine_key()
    record.write_text("{" if damage == "not json" else
                      json.dumps({key: {"choice": "mkl" if damage == "wrong choice" else "torch"}}))
    os.chmod(record, 0o666 if damage == "others may write" else 0o600)
    monkeypatch.setattr(gemm, "gemm_measurement", lambda rounds=7: {"choice": "onednn"})
    assert gemm.gemm_choice() == "onednn"


def test_the_layer_on_torch_matmul_trains_against_the_float64_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch.matmul chosen the projections are F.linear's, forward and backward (no oneDNN
    call), and the layer's output and every parameter's gradient meet the accuracy criterion."""
    setenv(monkeypatch, "torch")
    torch.random.default_generator.manual_seed(0)
    layer = mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, rope=mh.RoPE(16, 10000.0))
    x = torch.randn(2, 300, 64)
    grad = torch.randn(2, 300, 64)
    with torch.no_grad():
        assert _gemm_ops(lambda: layer(x)) == {"aten::addmm"}
    assert _gemm_ops(lambda: layer(x).backward(grad)) == {"aten::addmm", "aten::mm"}
    want = torch.from_numpy(reference_layer(layer, x)[0])  # float64 reference (B, S, E)
    double = mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, rope=mh.RoPE(16, 10000.0)).double()
    naive = mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, rope=mh.RoPE(16, 10000.0),
                                  backend="explicit")
    double.load_state_dict(layer.state_dict())
    naive.load_state_dict(layer.state_dict())
    layer.zero_grad()
    outs = [m(x.to(dtype)) for m, dtype in ((layer, torch.float32), (naive, torch.float32), (double, torch.float64))]
    for y in outs:
        y.backward(grad.to(y.dtype))
    got, plain = outs[0].detach().double(), outs[1].detach().double()
    assert (got - want).abs().max() <= 2 * (plain - want).abs().max() + 1e-6
    for (name, p), n, d in zip(layer.named_parameters(), naive.parameters(), double.parameters()):
        err, naive_err = (p.grad.double() - d.grad).abs().max(), (n.grad.double() - d.grad).abs().max()
        assert err <= 3 * naive_err + 1e-6, (name, err, naive_err)


def test_compiled_layer_on_torch_matmul_has_no_graph_break_and_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    setenv(monkeypatch, "torch")
    layer = mh.MultiHeadAttention(128, 8, num_kv_heads=2, causal=True, rope=mh.RoPE(16, 10000.0)).eval()
    x = torch.randn(2, 256, 128)
    with torch.no_grad():
        want = layer(x)
        torch._dynamo.reset()
        explain = torch._dynamo.explain(layer)(x)
        got = torch.compile(layer, fullgraph=True)(x)
    torch._dynamo.reset()  # later tests compile with their own choice
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
