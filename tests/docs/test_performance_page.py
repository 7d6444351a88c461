"""The performance figures in the docs and the README are the suite's JSON files, regenerated.

Each ``docs/results/NAME.json`` (what ``multihead bench`` wrote, on the machine it names) has
its section on the performance page; the README's table is the headline of the file its
marker names. Nothing typed in by hand can drift from what was measured.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from multihead.tools import bench_page

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "docs" / "results").glob("*.json"))


def test_there_are_results() -> None:
    assert RESULTS, "docs/results/ holds no results of `multihead bench`"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.stem)
def test_the_performance_page_shows_each_results_file(path: Path) -> None:
    page = (ROOT / "docs" / "performance.md").read_text("utf-8")
    suite = bench_page.load(path)
    want = bench_page.section(path.stem, suite, path.with_suffix(".png").exists())
    assert bench_page.replace_between(page, f"results:{path.stem}", want) == page
    assert not suite.get("quick"), f"{path.name} is a --quick smoke run, not a measurement"


def test_the_readme_tables_are_results_files() -> None:
    readme = (ROOT / "README.md").read_text("utf-8")
    names = re.findall(r"<!-- headline:([\w.-]+) -->", readme)
    assert names, "the README names no results file"
    for name in names:
        suite = bench_page.load(ROOT / "docs" / "results" / f"{name}.json")
        assert bench_page.replace_between(readme, f"headline:{name}", bench_page.headline(suite)) == readme
        assert suite["machine"]["cpu"] in readme  # the table names the CPU it was measured on


def test_replace_between_refuses_missing_markers() -> None:
    with pytest.raises(ValueError, match="markers"):
        bench_page.replace_between("no markers here", "results:x", "body")
