"""Hostile config.json files are refused with a ValueError naming the file (issue #14, item 8).

Runtime: under 2 s.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import multihead as mh

REPO = Path(__file__).resolve().parents[2]


def _deep(tmp_path: Path, depth: int = 100_000) -> Path:
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 64, "x": ' + "[" * depth + "]" * depth + "}")
    return path


def test_deeply_nested_config_is_a_value_error_naming_the_file(tmp_path: Path) -> None:
    path = _deep(tmp_path)
    with pytest.raises(ValueError, match="config.json: nested too deeply"):
        mh.AttentionConfig.from_hf(path)


def test_deeply_nested_text_config_is_a_value_error(tmp_path: Path) -> None:
    cfg: dict = {"model_type": "llama"}
    for _ in range(50):
        cfg = {"text_config": cfg}
    with pytest.raises(ValueError, match="text_config nested more than"):
        mh.AttentionConfig.from_hf(cfg)


def test_cli_exits_2_with_one_line_on_a_deeply_nested_config(tmp_path: Path) -> None:
    path = _deep(tmp_path)
    done = subprocess.run([sys.executable, "-m", "multihead.tools.cli", "cost", str(path)], capture_output=True,
                          text=True, env={"PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert str(path) in done.stderr and "nested too deeply" in done.stderr
