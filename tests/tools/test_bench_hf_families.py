"""``multihead bench --hf-generate --families`` at tiny sizes: each family's decoding step, HF against ours.

Times are not checked (the machine is shared); the structure, the logits' and greedy tokens'
agreement with HF's, the adapter's reported paths, and the loud report of a family that differs or fails are.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("transformers")

from multihead import decode  # noqa: E402
from multihead.tools import bench_hf_families as fam  # noqa: E402
from multihead.tools.cli import main  # noqa: E402

#: Every reason :func:`multihead.decode.why_not_fused` can give.
NOT_FUSED_REASONS = {reason for reason, _ in decode.FUSED_CONDITIONS}


def _real_path(path: object) -> bool:
    """``"fused"``, or ``update`` with one of the fused step's own reasons."""
    return path == "fused" or (isinstance(path, str) and path.startswith("update (not fused: ")
                               and path.removeprefix("update (not fused: ").removesuffix(")") in NOT_FUSED_REASONS)


def test_every_family_of_the_table_is_in_the_installed_transformers() -> None:
    assert fam.available() == list(fam.FAMILIES)
    assert set(fam.NOT_TIMED) <= set(fam.FAMILIES) and set(fam.WHOLE_MODEL) <= set(fam.FAMILIES)


def test_quick_sweep_times_each_family_with_hf_logits_and_real_paths() -> None:
    """A plain decoder (fused), one with sliding windows (update, the reason given), an encoder (not timed)."""
    result = fam.run_hf_families(["arcee", "cohere2", "modernbert"], quick=True, reps=1)
    assert result["sizes"] == fam.QUICK and result["reps"] == 1
    assert result["mismatches"] == [] and result["failed"] == []
    assert list(result["families"]) == ["arcee", "cohere2", "modernbert"]
    for model_type in ("arcee", "cohere2"):
        entry = result["families"][model_type]
        assert entry["status"] == "timed" and entry["same_logits"] is True and entry["max_abs_diff"] < fam.ATOL
        assert list(entry["decode"]) == list(fam.TIMED_WAYS)
        assert entry["decode"]["HF"]["paired_vs_hf"] == 1.0 and entry["paired_speedup"] > 0
        assert entry["shape"] == {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16}
        assert len(entry["paths"]) == fam.QUICK["layers"] and all(map(_real_path, entry["paths"])), entry["paths"]
        greedy = entry["greedy"]
        assert greedy["tokens_equal"] is True and greedy["differing_tokens"] == 0
        assert greedy["rows"][0] == fam.QUICK["prompt"] and greedy["rows"][1] < fam.QUICK["prompt"]  # left-padded
    assert result["families"]["cohere2"]["paths"] == ["fused", "fused"]  # its sliding-window layer too
    assert result["families"]["modernbert"] == {"status": "not timed", "reason": fam.NOT_TIMED["modernbert"]}
    text = fam.format_hf_families(result)
    assert "MISMATCH" not in text and "modernbert: not timed: an encoder" in text
    assert "arcee" in text and "2x fused" in text


def test_a_family_whose_logits_differ_or_that_raises_is_listed_and_the_command_exits_1(
        tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A patched model planted wrong (noise in its head's weights) is a mismatch, of the logits and of the
    greedy tokens; a family whose build raises is a failure; the sweep goes on, writes its JSON, and the
    command exits with 1."""
    import torch

    built = fam._models

    def planted(model_type: str, sizes: dict[str, int]) -> tuple[Any, Any]:
        if model_type == "granite":
            raise RuntimeError("planted failure")
        hf, patched = built(model_type, sizes)
        with torch.no_grad():
            noise = torch.randn(patched.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
            patched.lm_head.weight.add_(noise)
        return hf, patched

    monkeypatch.setattr(fam, "_models", planted)
    code = main(["bench", "--hf-generate", "--families", "arcee", "granite", "--quick", "--reps", "1",
                 "--out", str(tmp_path)])
    assert code == 1
    written = json.loads((tmp_path / "hf_generate_families.json").read_text(encoding="utf-8"))
    assert written["mismatches"] == ["arcee"] and written["failed"] == ["granite"]
    assert written["families"]["arcee"]["same_logits"] is False
    assert written["families"]["arcee"]["greedy"]["tokens_equal"] is False
    assert written["families"]["granite"]["error"] == "RuntimeError: planted failure"
    out = capsys.readouterr().out
    assert "MISMATCH arcee: logits differ from HF's" in out and "greedy tokens of the left-padded batch" in out
    assert "FAILED granite: RuntimeError: planted failure" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--hf-generate", "--families", "llama3"], "--families: unknown or not in this transformers: ['llama3']"),
    (["--families", "arcee"], "--families applies to --hf-generate only, without --compiled"),
    (["--hf-generate", "--compiled", "--families"], "--families applies to --hf-generate only, without --compiled"),
])
def test_families_refused_by_name(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
