"""``multihead bench --hf-generate`` at tiny sizes: it runs the three ways and reports them.

Times are not checked (the machine is shared); the structure, the agreement of the three
ways' logits and the report are.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from multihead.tools import bench_hf  # noqa: E402


def test_quick_run_reports_prefill_and_decoding_three_ways_and_the_compiled_steps() -> None:
    """The three ways, and (``compiled=True``) HF's StaticCache and our adapter with each model's forward
    compiled, timed among the decoding step's ways; the compiled steps' logits equal HF's eager step."""
    result = bench_hf.run_hf_generate(quick=True, reps=1, compiled=True)
    assert result["same_logits"] is True and result["compiled_same_logits"] is True
    assert list(result["prefill"]) == list(bench_hf.WAYS)
    assert list(result["decode"]) == [*bench_hf.WAYS, *bench_hf.COMPILED]
    for phase in ("prefill", "decode"):
        assert result[phase]["HF"]["vs_hf"] == result[phase]["HF"]["paired_vs_hf"] == 1.0
        assert all(st["tokens_per_s"] > 0 for st in result[phase].values())
    assert len(result["paths"]) == bench_hf.QUICK["layers"]
    assert all(path == "fused" or path.startswith("update (not fused: ") for path in result["paths"])
    floor = result["prefill_floor"]
    assert len(floor["times_s"]) == 1 and floor["median_s"] > 0
    for way, extra in floor["beyond_floor_s"].items():
        assert extra == pytest.approx(result["prefill"][way]["median_s"] - floor["median_s"])
    text = bench_hf.format_hf_generate(result)
    assert "prefill:" in text and "decode:" in text and "patched + KVCacheAdapter" in text
    assert f"floor, {bench_hf.FLOOR}" in text and "beyond it (the attention's own work): HF " in text
    assert "compiled steps' logits agree: True" in text and bench_hf.COMPILED[0] in text


def test_the_prefill_floor_runs_the_four_projections_and_nothing_else_of_attention() -> None:
    """The floor model's attention modules call q, k, v and o projections once each, at the
    prompt's shapes, and no attention kernel; the rest of the model is HF's, unchanged."""
    import torch

    hf, _ = bench_hf._models(bench_hf.QUICK)
    floor = bench_hf._floor_model(hf)
    assert all(isinstance(layer.self_attn, bench_hf._ProjectionsOnly) for layer in floor.model.layers)
    assert not any(isinstance(layer.self_attn, bench_hf._ProjectionsOnly) for layer in hf.model.layers)
    ids = torch.randint(0, bench_hf.QUICK["vocab"], (1, bench_hf.QUICK["prompt"]))
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = floor(input_ids=ids, use_cache=False).logits
    assert logits.shape == (1, bench_hf.QUICK["prompt"], bench_hf.QUICK["vocab"])
    names = [e.name for e in prof.events()]
    assert not any("scaled_dot_product" in n or "softmax" in n for n in names)
    linears = sum(n == "aten::linear" for n in names)
    mlp = 3  # gate, up, down per layer; and the head once
    assert linears == bench_hf.QUICK["layers"] * (4 + mlp) + 1


def test_cli_flag_runs_it_and_writes_json(tmp_path, capsys: pytest.CaptureFixture) -> None:
    import json

    from multihead.tools.cli import main

    assert main(["bench", "--hf-generate", "--quick", "--out", str(tmp_path), "--json"]) == 0
    written = json.loads((tmp_path / "hf_generate.json").read_text(encoding="utf-8"))
    assert set(written) >= {"sizes", "prefill", "decode", "paths"} and written["sizes"] == bench_hf.QUICK
    assert json.loads(capsys.readouterr().out)["decode"].keys() == set(bench_hf.WAYS)


def test_compiled_without_hf_generate_is_refused(capsys: pytest.CaptureFixture) -> None:
    from multihead import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--compiled"])
    assert e.value.code == 2 and "--compiled applies to --hf-generate only" in capsys.readouterr().err
