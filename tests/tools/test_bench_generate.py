"""``multihead bench --generate-jobs`` at tiny sizes: whole generate calls, each way's tokens checked.

Times are not checked (the machine is shared); the structure, the tokens' agreement with HF's,
the report of a way that differs, and the CLI's options are. The compiled ways are left out here
(compiling takes minutes); they run the same code with a compiled forward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from multihead.tools import bench_generate  # noqa: E402
from multihead.tools.cli import main  # noqa: E402

#: The ways of a run without compiling; "threads auto" needs more than one torch thread (xdist's
#: workers have two or more: tests/conftest.py).
EAGER_WAYS = [w for w in bench_generate.WAYS if not w.endswith("compiled")]


def test_quick_run_times_whole_generate_calls_and_every_way_equals_hf() -> None:
    """Both models, batch 1 and a left-padded batch of 3: per way the time to first token and the
    decode rate with their spreads and speed-ups, and tokens equal to HF's DynamicCache's."""
    result = bench_generate.run_generate_jobs(quick=True, compiled=False)
    quick = bench_generate.QUICK
    assert list(result["models"]) == ["llama", "qwen3"] and result["mismatches"] == []
    assert all(info["parameters"] > 0 for info in result["models"].values())
    jobs = result["jobs"]
    assert [(j["model"], j["prompt"], j["batch"]) for j in jobs] == [
        (m, p, b) for m in ("llama", "qwen3") for p in quick["prompts"] for b in quick["batches"]]
    for job in jobs:
        assert list(job["ways"]) == EAGER_WAYS
        assert job["row_lengths"][0] == job["prompt"] and len(job["row_lengths"]) == job["batch"]
        for row in job["ways"].values():
            assert row["tokens_equal"] is True and row["differing_tokens"] == 0
            assert len(row["ttft_s"]["values"]) == quick["reps"]
            assert row["ttft_s"]["min"] <= row["ttft_s"]["median"] <= row["ttft_s"]["max"]
            assert row["decode_tokens_per_s"]["median"] > 0
        assert job["ways"][bench_generate.BASE]["decode_speedup"] == 1.0
    padded = [j for j in jobs if j["batch"] > 1]
    assert padded and all(min(j["row_lengths"]) < j["prompt"] for j in padded)  # left padding in play
    assert jobs[0]["adapter_paths"] == ["fused"]  # Llama, one row: our fused step inside generate
    text = bench_generate.format_generate_jobs(result)
    assert "mismatches: none: every way's tokens equal HF's" in text and "TTFT ms (min-max)" in text
    assert f"{result['models']['qwen3']['parameters']:,} parameters" in text


def test_a_way_whose_tokens_differ_is_reported_as_a_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted way that changes HF's last token: reported in the way's row, the mismatches and the table."""
    made = bench_generate._ways

    def with_planted(*args: Any) -> tuple[dict[str, Any], Any]:
        ways, adapter = made(*args)
        honest = ways[bench_generate.BASE]

        def planted(stamp: Any) -> torch.Tensor:
            tokens = honest(stamp).clone()
            tokens[0, -1] += 1
            return tokens

        return {**ways, "planted": planted}, adapter

    monkeypatch.setattr(bench_generate, "_ways", with_planted)
    result = bench_generate.run_generate_jobs(quick=True, compiled=False, models=["llama"], batches=[1])
    job = result["jobs"][0]
    row = job["ways"]["planted"]
    assert row["tokens_equal"] is False and row["differing_tokens"] == 1
    assert row["first_difference"] == [0, job["prompt"] + result["new_tokens"] - 1]
    assert all(job["ways"][w]["tokens_equal"] for w in EAGER_WAYS)
    assert len(result["mismatches"]) == 1 and "planted's tokens differ from HF's: 1 tokens" in result["mismatches"][0]
    text = bench_generate.format_generate_jobs(result)
    assert "MISMATCHES (1):" in text and "DIFFER" in text


def test_prompts_are_seeded_and_left_padded_to_different_lengths() -> None:
    ids, mask = bench_generate.make_prompts(100, 16, 4)
    again, _ = bench_generate.make_prompts(100, 16, 4)
    assert torch.equal(ids, again) and ids.shape == mask.shape == (4, 16)
    lengths = mask.sum(1)
    assert lengths[0] == 16 and len(set(lengths.tolist())) > 1
    for row, n in zip(range(4), lengths.tolist()):  # padding first, then the row's tokens
        assert mask[row, 16 - n:].all() and not mask[row, :16 - n].any()
        assert (ids[row, :16 - n] == 0).all() and (ids[row, 16 - n:] > 0).all()


def test_a_competing_run_times_beside_the_process_and_says_so() -> None:
    result = bench_generate.run_generate_jobs(quick=True, compiled=False, models=["llama"], batches=[1],
                                              competing=True)
    assert result["competing"] is True and result["jobs"][0]["others_cpu_share"] is not None
    text = bench_generate.format_generate_jobs(result)
    assert "competing process: one CPU-bound" in text and "(the competing process included)" in text


@pytest.mark.parametrize("kwargs, named", [({"models": ["gpt2"]}, "models"), ({"new_tokens": 1}, "new_tokens"),
                                           ({"batches": [0]}, "batches")])
def test_bad_arguments_are_refused_by_name(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        bench_generate.run_generate_jobs(quick=True, compiled=False, **kwargs)


def test_cli_runs_the_chosen_subset_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--generate-jobs", "--quick", "--no-compile", "--model", "llama", "--prompt", "8", "6",
            "--batch", "2", "--new-tokens", "3", "--reps", "1", "--out", str(tmp_path), "--json"]
    assert main(argv) == 0
    written = json.loads((tmp_path / "generate_jobs.json").read_text(encoding="utf-8"))
    assert [(j["model"], j["prompt"], j["batch"]) for j in written["jobs"]] == [("llama", 6, 2), ("llama", 8, 2)]
    assert written["new_tokens"] == 3 and written["reps"] == 1 and written["competing"] is False
    assert json.loads(capsys.readouterr().out)["mismatches"] == []


@pytest.mark.parametrize("flag", [["--prompt", "8"], ["--batch", "2"], ["--competing"], ["--model", "llama"],
                                  ["--curve"],
                                  ["--no-compile"], ["--new-tokens", "4"], ["--reps", "2"]])
def test_cli_refuses_generate_options_without_generate_jobs(flag: list[str],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--quick", *flag])
    assert exit_.value.code == 2 and f"{flag[0]} applies to --generate-jobs only" in capsys.readouterr().err


def test_cli_refuses_an_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--generate-jobs", "--model", "gpt2"])
    assert "invalid choice: 'gpt2'" in capsys.readouterr().err


# -- --curve: one row's decode rate against the prompt's length ---------------------------------------


def test_quick_curve_times_each_way_at_each_length_with_hf_tokens(tmp_path: Path) -> None:
    """Per prompt length (shortest first) every way's step times, tokens/s and speed-ups, the
    same greedy tokens as HF's DynamicCache, the adapter on its fused step; the table and the picture."""
    from multihead.tools import bench_decode_curve as curve

    result = curve.run_decode_curve(quick=True, lengths=[16, 8])
    assert [p["prompt"] for p in result["lengths"]] == [8, 16] and result["steps"] == 2
    for point in result["lengths"]:
        assert list(point["ways"]) == list(curve.WAYS) and point["adapter_paths"] == ["fused"]
        for row in point["ways"].values():
            assert row["tokens_equal"] is True and len(row["times_s"]) == 2
            assert row["min_s"] <= row["median_s"] <= row["max_s"] and row["tokens_per_s"] > 0
        assert point["ways"][curve.BASE]["speedup"] == 1.0
    text = curve.format_decode_curve(result)
    assert "decode rate against the prompt's length" in text and "DIFFER" not in text
    assert curve.plot(result, tmp_path / "curve.png").stat().st_size > 0


def test_a_curve_way_whose_tokens_differ_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted adapter way whose greedy token differs from HF's is reported, in the row and the table."""
    from multihead.tools import bench_decode_curve as curve

    step = curve._Way.step

    def planted(self: Any, token: torch.Tensor) -> torch.Tensor:
        logits = step(self, token)
        if type(self.cache).__name__ == "KVCacheAdapter":
            logits = logits.clone()
            logits[:, 0] = logits.max() + 1  # token 0 wins
        return logits

    monkeypatch.setattr(curve._Way, "step", planted)
    result = curve.run_decode_curve(quick=True, lengths=[8])
    rows = result["lengths"][0]["ways"]
    assert rows[curve.WAYS[2]]["tokens_equal"] is False and rows[curve.BASE]["tokens_equal"] is True
    assert "DIFFER" in curve.format_decode_curve(result)


def test_cli_curve_writes_json_and_refuses_whole_call_options(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--generate-jobs", "--curve", "--quick", "--prompt", "6", "--reps", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    written = json.loads((tmp_path / "decode_curve.json").read_text(encoding="utf-8"))
    assert [p["prompt"] for p in written["lengths"]] == [6] and written["steps"] == 1
    assert (tmp_path / "decode_curve.png").exists()
    for flag in (["--batch", "2"], ["--new-tokens", "3"], ["--competing"], ["--no-compile"]):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "--generate-jobs", "--curve", "--quick", *flag])
        assert exit_.value.code == 2 and f"{flag[0]} does not apply to --curve" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--quick", "--curve"])
    assert "--curve applies to --generate-jobs only" in capsys.readouterr().err
