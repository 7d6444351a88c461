"""The documentation cannot drift: every code block of the docs and the README runs here.

Each page's ``python`` blocks run in order in one namespace, from the repository root (the
docs use its ``tests/data/configs``); a ``text`` block right after one is its printed output
and must match (numbers to within one unit of the last digit shown, since the last bit of a
float32 sum depends on the CPU's vector width). ``pycon`` blocks are doctests. Every command
line of a ``bash`` block that starts with ``multihead`` must parse with the CLI's own parser.
The README stays short, speaks to users, and starts with the two commands ``.ci/run`` runs.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import blocks, normalise, run_block

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
#: Block languages a page may use: run (python, pycon), compared (text), parsed (bash).
LANGUAGES = {"python", "pycon", "text", "bash"}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
README_MAX_LINES = 300
#: Words of a lab notebook, not of user documentation.
HISTORY = re.compile(r"\b(this|previous|last|earlier|later|next) (round|session)\b|\bissue #?\d+|the issue'?s?\b"
                     r"|\bround \d+\b", re.I)


def _numbers_close(expected: str, got: str) -> bool:
    """Equal text, numbers allowed one unit of their last shown digit apart."""
    if NUMBER.sub("#", expected) != NUMBER.sub("#", got):
        return False
    for e, g in zip(NUMBER.findall(expected), NUMBER.findall(got)):
        decimals = len(e.split(".")[1].split("e")[0]) if "." in e else 0
        if "e" in e.lower() or abs(float(e) - float(g)) > 1.01 * 10.0 ** -decimals:
            if e != g:
                return False
    return True


def test_numbers_close_is_strict_enough() -> None:
    assert _numbers_close("spread 8.05, x 1.01", "spread 8.06, x 1.00")
    assert not _numbers_close("spread 8.05", "spread 8.07")
    assert not _numbers_close("same: True", "same: False")
    assert not _numbers_close("a 1.0e-5", "a 2.0e-5")


@pytest.mark.parametrize("page", [p for p in PAGES if any(b.lang in ("python", "pycon")
                                                           for b in blocks((ROOT / p).read_text("utf-8")))])
def test_code_blocks_run_and_print_what_the_page_shows(page: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in blocks((ROOT / page).read_text("utf-8")):
        if block.lang not in ("python", "pycon"):
            continue
        out = run_block(block, namespace, page)
        if block.expected is not None:
            want, got = normalise(block.expected), normalise(out)
            assert want == got or _numbers_close(want, got), (
                f"{page}:{block.line}: the block printed\n{got}\n--- but the page shows\n{want}")


def test_output_blocks_are_filled() -> None:
    """An empty output block would compare against nothing useful: each shows output."""
    for page in PAGES:
        for block in blocks((ROOT / page).read_text("utf-8")):
            assert block.expected is None or block.expected.strip(), f"{page}:{block.line}: empty output block"


def test_every_block_has_a_known_language() -> None:
    for page in PAGES:
        for block in blocks((ROOT / page).read_text("utf-8")):
            assert block.lang in LANGUAGES, f"{page}:{block.line}: block language {block.lang!r} is not checked"


def test_command_lines_parse() -> None:
    from multihead.tools.cli import build_parser

    parser = build_parser()
    seen = 0
    for page in PAGES:
        for block in blocks((ROOT / page).read_text("utf-8")):
            if block.lang != "bash":
                continue
            for line in block.source.replace("\\\n", " ").splitlines():  # continued lines joined
                words = shlex.split(line, comments=True)
                if not words or words[0] != "multihead" or words[1:2] in (["--version"], ["--help"]):
                    continue
                seen += 1
                try:
                    parser.parse_args(words[1:])
                except SystemExit as exit_:
                    raise AssertionError(f"{page}: `{line.strip()}` does not parse") from exit_
    assert seen >= 15


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text("utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES
    first_block = blocks("\n".join(lines) + "\n")[0]
    commands = [c for c in first_block.source.splitlines() if c and not c.startswith("#")]
    assert len(commands) == 2
    main_job, tests = commands
    assert main_job.endswith("multihead run") and '".[models]"' in main_job
    ci = (ROOT / ".ci" / "run").read_text("utf-8")
    assert tests in ci.splitlines()  # .ci/run runs exactly the README's test command


@pytest.mark.parametrize("page", PAGES)
def test_pages_speak_to_users(page: str) -> None:
    text = (ROOT / page).read_text("utf-8")
    found = HISTORY.search(text)
    assert found is None, f"{page}: {found.group(0)!r} is history, which belongs in git and the CHANGELOG"


def test_version_everywhere() -> None:
    import multihead

    out = subprocess.run([sys.executable, "-m", "multihead", "--version"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"multihead {multihead.__version__}"
    from importlib.metadata import version

    assert version("multihead") == multihead.__version__  # pyproject reads it from the package
    assert (ROOT / "src" / "multihead" / "py.typed").exists()
    assert f"## {multihead.__version__}" in (ROOT / "CHANGELOG.md").read_text("utf-8")
