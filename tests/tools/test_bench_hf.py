"""``multihead bench --hf-generate`` at tiny sizes: it runs the three ways and reports them.

Times are not checked (the machine is shared); the structure, the agreement of the three
ways' logits and the report are.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from multihead.tools import bench_hf  # noqa: E402


def test_quick_run_reports_prefill_and_decoding_three_ways() -> None:
    result = bench_hf.run_hf_generate(quick=True, reps=1)
    assert result["same_logits"] is True
    for phase in ("prefill", "decode"):
        assert list(result[phase]) == list(bench_hf.WAYS)
        assert result[phase]["HF"]["vs_hf"] == result[phase]["HF"]["paired_vs_hf"] == 1.0
        assert all(st["tokens_per_s"] > 0 for st in result[phase].values())
    assert len(result["paths"]) == bench_hf.QUICK["layers"]
    assert all(path == "fused" or path.startswith("update (not fused: ") for path in result["paths"])
    text = bench_hf.format_hf_generate(result)
    assert "prefill:" in text and "decode:" in text and "patched + KVCacheAdapter" in text


def test_cli_flag_runs_it_and_writes_json(tmp_path, capsys: pytest.CaptureFixture) -> None:
    import json

    from multihead.tools.cli import main

    assert main(["bench", "--hf-generate", "--quick", "--out", str(tmp_path), "--json"]) == 0
    written = json.loads((tmp_path / "hf_generate.json").read_text(encoding="utf-8"))
    assert set(written) >= {"sizes", "prefill", "decode", "paths"} and written["sizes"] == bench_hf.QUICK
    assert json.loads(capsys.readouterr().out)["decode"].keys() == set(bench_hf.WAYS)
