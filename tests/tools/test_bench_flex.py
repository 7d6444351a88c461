"""``multihead bench --flex`` at tiny sizes: every implementation checked against float64, the
table and the JSON written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multihead.tools import bench_flex
from multihead.tools.cli import main


def test_flex_cases_run_and_agree_with_float64() -> None:
    result = bench_flex.run_flex(quick=True, reps=1, only=("4 documents", "T5 bias"))
    assert [c["case"] for c in result["cases"]] == ["4 documents", "T5 bias"]
    for case in result["cases"]:
        assert set(case["impls"]) == {"multihead", "SDPA, dense mask", "FlexAttention (compiled)"}
        for name, impl in case["impls"].items():
            assert impl["max_error"] < 1e-5, (case["case"], name)
            assert impl["forward"]["median_s"] > 0
        assert case["impls"]["multihead"]["train"]["median_s"] > 0
        assert case["impls"]["FlexAttention (compiled)"]["train"] is None  # no CPU backward in this torch
    assert result["cases"][0]["empty_tiles"] == 0.5  # S=256 in 128-tiles: documents 0-1 never see 2-3
    assert result["flex_backward"].startswith("n/a: NotImplementedError")
    text = bench_flex.format_flex(result)
    assert "| 4 documents | 256 |" in text and "| T5 bias | 256 |" in text and "n/a" in text


def test_cli_writes_flex_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    every = bench_flex.cases
    monkeypatch.setattr(bench_flex, "cases", lambda quick, heads: [c for c in every(quick, heads)
                                                                    if c.name == "prefix-LM"])
    assert main(["bench", "--flex", "--quick", "--out", str(tmp_path), "--json"]) == 0
    written = json.loads((tmp_path / "flex.json").read_text(encoding="utf-8"))
    assert [c["case"] for c in written["cases"]] == ["prefix-LM"]


def test_the_sparse_pattern_is_timed_against_the_full_one_in_the_same_rounds() -> None:
    """The 90%-empty pattern's time over every tile full's, paired round by round, in the table."""
    sparse = bench_flex._sparse_over_full(True, 2, 32, 2)
    assert sparse is not None and sparse["ratio"] > 0
    assert len(sparse["sparse"]["times_s"]) == len(sparse["full"]["times_s"]) == 2
    result = {"heads": 2, "head_dim": 32, "threads": 1, "cases": [], "flex_backward": "n/a",
              "sparse_over_full": sparse}
    assert "90% empty tiles against every tile full, paired rounds" in bench_flex.format_flex(result)
