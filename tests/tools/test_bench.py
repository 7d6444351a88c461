"""The benchmark suite runs end to end in its tiny ``quick`` mode and writes JSON + PNG.

No timing is asserted (speed is measured by the suite, on a quiet machine, not by unit
tests); these tests check that every case runs, produces well-formed results, and that
the report, the files and the command-line script work.
"""

from __future__ import annotations

import importlib.util
import json
import copy
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

import multihead as mh
from multihead import bench
from multihead.tools import bench_overhead as overhead

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def suite() -> dict[str, Any]:
    lines: list[str] = []
    result = bench.run_suite(quick=True, progress=lines.append, memory_seq=256)
    result["progress"] = lines
    return result


def test_limits_are_positive_rates(suite: dict[str, Any]) -> None:
    lim = suite["limits"]
    assert lim["sgemm_gflops"] > 0 and lim["copy_gbps"] > 0
    assert lim["gemm_peak_gflops"] >= lim["sgemm_gflops"]
    assert suite["machine"]["torch_threads"] == torch.get_num_threads()


def test_every_case_has_ours_and_a_peer(suite: dict[str, Any]) -> None:
    cases = {r["case"] for r in suite["results"]}
    assert cases == {"core/full", "core/causal", "core/bf16", "layer/prefill", "layer/decode", "layer/decode-bf16",
                     "core/train", "layer/train", "memory", "call/attention", "layer/bundled"}
    for case in cases:
        impls = {r["impl"] for r in suite["results"] if r["case"] == case}
        assert "multihead" in impls and len(impls) >= 2, (case, impls)


def test_bf16_cases_compare_with_our_float32_and_sdpa_in_bf16(suite: dict[str, Any]) -> None:
    def impls(case: str) -> set[str]:
        return {r["impl"] for r in suite["results"] if r["case"] == case}
    assert {"multihead", "multihead float32", "torch sdpa bf16"} <= impls("core/bf16")
    assert {"multihead", "multihead float32"} <= impls("layer/decode-bf16")
    ours = {r["case"]: r for r in suite["results"] if r["impl"] == "multihead"}
    assert 2 * ours["layer/decode-bf16"]["kv_bytes"] == ours["layer/decode"]["kv_bytes"]  # bf16: half the bytes


def test_timed_results_carry_medians_and_rates(suite: dict[str, Any]) -> None:
    for row in suite["results"]:
        if row["case"] == "memory":
            assert row["peak_increase_bytes"] >= 0 and row["io_bytes"] > 0
            continue
        assert 0 < row["min_s"] <= row["median_s"]
        assert len(row["times_s"]) >= 2
        assert math.isfinite(row["times_limit"]) and row["times_limit"] > 0
        assert ("gflops" in row) != ("gbps" in row)
        if "gflops" in row:  # compute-bound: also rated against the best GEMM timed in its own loop
            probe = row["gemm_loop_times_s"]
            assert row["gemm_loop_gflops"] > 0 and len(probe) == len(row["times_s"])
            ratios = [g / t for g, t in zip(probe, row["times_s"])]
            paired = row["flops"] / row["gemm_loop_flops"] * statistics.median(ratios)
            assert row["frac_gemm_loop"] == pytest.approx(paired)
        if "gbps" in row:  # bandwidth-bound: rated against a copy and a plain read timed in its own loop
            assert row["copy_gbps"] > 0 and row["read_s"] > 0
            assert row["times_read"] == pytest.approx(row["median_s"] / row["read_s"])
    assert not {"(copy)", "(read)", "(gemm)"} & {row["impl"] for row in suite["results"]}  # probes are not peers


def test_peers_from_transformers_are_included_when_installed(suite: dict[str, Any]) -> None:
    pytest.importorskip("transformers")
    impls = {r["impl"] for r in suite["results"]}
    assert {"HF BERT sdpa", "HF GPT-2 eager", "HF Llama sdpa", "HF Llama sdpa StaticCache",
            "HF Llama eager DynamicCache"} <= impls


def test_report_has_a_table_per_case(suite: dict[str, Any]) -> None:
    text = bench.format_report(suite)
    for case in ("core/full", "core/causal", "core/bf16", "layer/prefill", "layer/decode", "layer/decode-bf16",
                 "core/train", "layer/train", "memory", "call/attention", "layer/bundled", "start-up"):
        assert f"== {case}" in text
    assert "torch threads" in text and "speedup" in text


def test_report_gives_each_rows_spread_and_the_load_and_flags_busy_cases(suite: dict[str, Any]) -> None:
    """Every timed row shows both sides' least and largest round; the report says how much of the
    CPUs other processes used, and under a case whose rounds ran on a busy machine, that they did."""
    timed = [r for r in suite["results"] if r["case"] != "memory"]
    assert all(r["others_cpu_share"] is None or 0 <= r["others_cpu_share"] <= 1 for r in timed)
    text = bench.format_report(suite)
    ours = next(r for r in timed if r["is_ours"] and r["case"] == "core/full")
    spread = f"{min(ours['times_s']) * 1e3:.2f}-{max(ours['times_s']) * 1e3:.2f}"
    assert "ours ms (min-max)" in text and spread in text
    busy = copy.deepcopy(suite)
    for r in busy["results"]:
        r["others_cpu_share"] = 0.45 if r["case"] == "core/full" else 0.0
    text = bench.format_report(busy)
    assert ("load, in the busiest case's rounds: other processes used 45% of the CPUs meanwhile "
            "(busy: these figures are not a verdict)") in text
    flagged = [line for line in text.splitlines() if line.startswith("  (") and "busy" in line]
    assert len(flagged) == len({bench._label(r) for r in busy["results"] if r["case"] == "core/full"})


def test_small_calls_are_timed_against_sdpa_and_the_bundled_layer_against_hf_bert(suite: dict[str, Any]) -> None:
    calls = [r for r in suite["results"] if r["case"] == "call/attention"]
    assert {r["shape"] for r in calls} == {"(1,12,16,32)", "(1,32,1,128)"}
    assert {"multihead", "torch SDPA"} <= {r["impl"] for r in calls}
    paths = {rule.path for rule in mh.backends.auto.AUTO_RULES}
    assert all(r["path"] in paths for r in calls)  # the path "auto" took
    bundled = {r["impl"] for r in suite["results"] if r["case"] == "layer/bundled"}
    assert bundled == {"multihead", overhead.PACKED, "HF BertAttention sdpa", "HF BertAttention eager",
                       overhead.GEMMS_ONLY}


def test_start_up_is_measured_in_fresh_processes(suite: dict[str, Any]) -> None:
    start = suite["startup"]
    assert set(start) == {"python", "import torch", "import multihead", "multihead --help", "first mh.attention"}
    assert all(t > 0 for t in start.values())
    assert start["import multihead"] >= start["python"] and start["import torch"] >= start["python"]


def test_json_and_png_are_written(suite: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    data = json.loads(bench.write_json(suite, tmp_path / "out" / "bench.json").read_text())
    assert data["results"] and data["limits"]
    png = bench.plot(suite, tmp_path / "out" / "bench.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_interleaved_runs_resets_before_every_call() -> None:
    calls: list[str] = []
    stats = bench.time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                   reps=3, resets={"a": lambda: calls.append("reset")})
    assert calls.count("a") == 4 and calls.count("b") == 4  # 1 warm-up + 3
    assert calls.count("reset") == 4
    assert set(stats) == {"a", "b"} and len(stats["a"]["times_s"]) == 3


def test_paired_speedup_is_the_median_of_per_round_ratios() -> None:
    """Round 2 ran while the machine was slow for the peer only, round 3 for us only: the
    ratio of medians (20x) follows the drift, the per-round ratios (2, 20, 0.2 -> 2x) do not."""
    ours, peer = {"times_s": [1.0, 1.0, 10.0]}, {"times_s": [2.0, 20.0, 2.0]}
    assert bench.paired_speedup(ours, peer) == 2.0


def test_run_script_prints_the_report_and_writes_files(suite: dict[str, Any], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(bench, "run_suite", lambda **kw: suite)  # the suite itself ran in the fixture
    assert module.main(["bench", "--quick", "--out", str(tmp_path)]) == 0  # run.py is `multihead bench`
    captured = capsys.readouterr()
    assert "torch threads" in captured.err and "== core/causal ==" in captured.out
    assert (tmp_path / "bench.json").exists() and (tmp_path / "bench.png").exists()


def test_train_case_reports_its_projection_gemm_floor(suite: dict[str, Any]) -> None:
    """layer/train (causal and not) times its floor, the step's projection GEMMs alone (9 of
    2·S·E² FLOPs), among its peers; every row carries the floor's share of its step, which the
    report prints apart from the peers' rows, with what each step takes beyond the floor."""
    rows = [r for r in suite["results"] if r["case"] == "layer/train"]
    assert sorted({r["causal"] for r in rows}) == [False, True]
    text = bench.format_report(suite)
    section = text[text.index("== layer/train =="):text.index("== memory ==")].splitlines()
    assert not any(line.startswith("seq=") and "(projection GEMMs only)" in line for line in section)
    shares = [line for line in section if "their share of each step" in line]
    beyond = [line for line in section if "each step beyond them" in line]
    assert len(shares) == len(beyond) == 2
    for causal, share, rest in zip((False, True), shares, beyond):
        group = [r for r in rows if r["causal"] is causal]
        floor = next(r for r in group if r["impl"] == "(projection GEMMs only)")
        assert not floor["is_ours"] and floor["flops"] == 9 * 2.0 * floor["seq"] * floor["embed_dim"] ** 2
        assert floor["gflops"] == pytest.approx(floor["flops"] / floor["median_s"] / 1e9)
        ours = next(r for r in group if r["is_ours"])
        for row in group:
            assert row["gemm_fraction"] == pytest.approx(floor["median_s"] / row["median_s"])
            if row is not floor:
                assert f"{row['impl']} {100 * row['gemm_fraction']:.0f}%" in share
                extra = (row["median_s"] - floor["median_s"]) * 1e3
                assert f"{row['impl']} {extra:.2f} ms" in rest
                if row is not ours:
                    ratio = (row["median_s"] - floor["median_s"]) / (ours["median_s"] - floor["median_s"])
                    assert f"({ratio:.2f}x ours)" in rest


def test_bundled_case_reports_its_projection_gemm_floor(suite: dict[str, Any]) -> None:
    """layer/bundled times its floor too, the layer's four projections alone (4 GEMMs of 2·B·S·E²
    FLOPs per call), among its peers but apart from their rows in the report, with each row's share."""
    rows = [r for r in suite["results"] if r["case"] == "layer/bundled"]
    floor = next(r for r in rows if r["impl"] == "(projection GEMMs only)")
    assert not floor["is_ours"]
    assert floor["flops"] == floor["calls"] * 4 * 2.0 * floor["batch"] * floor["seq"] * floor["embed_dim"] ** 2
    for row in rows:
        assert row["gemm_fraction"] == pytest.approx(floor["median_s"] / row["median_s"])
    text = bench.format_report(suite)
    section = text[text.index("== layer/bundled =="):].split("\n== ")[0].splitlines()
    assert not any(line.startswith("batch=") and "(projection GEMMs only)" in line for line in section)
    assert any("the step's 4 projection GEMMs alone" in line for line in section)
    (share,) = [line for line in section if "their share of each step" in line]
    assert all(f"{r['impl']} {100 * r['gemm_fraction']:.0f}%" in share for r in rows if r is not floor)


def test_core_train_case_times_the_same_gradients_and_counts_flash_attention_2s_flops() -> None:
    """core/train: ours and SDPA's forward + backward give the same gradients of q, k, v (the
    two rows time the same work, and nothing accumulates between calls); FLOPs 3.5 × the forward's."""
    for causal in (False, True):
        spec, fns = bench._core_train_case(96, causal, h=2, d=16)
        pairs = 96 * 97 / 2 if causal else 96 * 96
        assert spec["flops"] == 3.5 * 4.0 * 2 * 16 * pairs and spec["causal"] is causal
        ours, again, peer = fns["multihead"](), fns["multihead"](), fns["torch sdpa"]()
        assert len(ours) == 3
        for a, b, c in zip(ours, again, peer):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


def test_train_floor_runs_the_gemms_of_the_layer_step_and_nothing_else() -> None:
    """The floor calls as many GEMMs as the layer's step does (its 9: the native backend's
    attention runs none of torch's)."""
    _, fns, resets = bench._train_case(True, 64, 4, 128)
    gemm_ops = {"mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm"}

    def gemms(name: str) -> int:
        fns[name]()  # warm-up (first-call work is not the step's)
        resets[name]()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fns[name]()
        return sum(e.name in gemm_ops for e in prof.events())

    assert gemms("(projection GEMMs only)") == gemms("multihead backend=native") == 9
