"""The code blocks of a Markdown page, and running them as the reader would.

A page's ``python`` blocks run in order in one namespace (a later block may use what an
earlier one made). A ``text`` block right after a ``python`` block is that block's printed
output, compared line by line (trailing spaces ignored). ``pycon`` blocks are doctests
(``>>>`` prompts, expected output or traceback below), run in the same namespace.

``python tests/docs/doc_blocks.py PAGE.md`` prints each block's output; with ``--write`` it
puts each output into the page's ``text`` block after it (for writing a page: read the diff).
"""

from __future__ import annotations

import contextlib
import doctest
import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


@dataclass
class Block:
    """One fenced block: its language, its source, the line it starts on, and the
    ``text`` block that follows it directly (its expected output), if any."""

    lang: str
    source: str
    line: int
    expected: str | None = None


def blocks(text: str) -> list[Block]:
    """The fenced blocks of ``text``, each ``python`` block paired with its output block."""
    found: list[Block] = []
    last_end = -1
    for m in FENCE.finditer(text):
        lang, source, line = m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1
        between = text[last_end:m.start()] if last_end >= 0 else "x"
        if lang == "text" and found and found[-1].lang == "python" and found[-1].expected is None \
                and not between.strip():
            found[-1].expected = source
        else:
            found.append(Block(lang, source, line))
        last_end = m.end()
    return found


def normalise(out: str) -> str:
    """Output compared without trailing spaces or trailing blank lines."""
    return "\n".join(line.rstrip() for line in out.rstrip().splitlines())


def run_block(block: Block, namespace: dict[str, object], page: str) -> str:
    """Run one block in ``namespace``; its printed output (python) or the doctest report (pycon)."""
    if block.lang == "pycon":
        test = doctest.DocTestParser().get_doctest(block.source, namespace, page, page, block.line)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        report = io.StringIO()
        runner.run(test, out=report.write, clear_globs=False)
        if runner.failures:
            raise AssertionError(f"{page}:{block.line}: doctest failed\n{report.getvalue()}")
        return ""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.source, f"{page}:{block.line}", "exec"), namespace)  # noqa: S102 - the docs' own code
    return out.getvalue()


def runnable(page_blocks: list[Block]) -> list[Block]:
    """The blocks a test runs: python and pycon."""
    return [b for b in page_blocks if b.lang in ("python", "pycon")]


def main(argv: list[str]) -> int:
    """Print each block's output, or (``--write``) write it into the page's output blocks."""
    write = "--write" in argv
    path = Path([a for a in argv if a != "--write"][0])
    text = path.read_text(encoding="utf-8")
    namespace: dict[str, object] = {"__name__": "__docs__"}
    outputs: dict[int, str] = {}
    for block in runnable(blocks(text)):
        out = run_block(block, namespace, str(path))
        print(f"--- line {block.line} ({block.lang}){' [has output block]' if block.expected is not None else ''}")
        print(out, end="")
        if block.expected is not None:
            outputs[block.line] = normalise(out) + "\n"
    if write:
        lines = text.splitlines(keepends=True)
        for block in sorted((b for b in blocks(text) if b.line in outputs), key=lambda b: -b.line):
            start = block.line + block.source.count("\n") + 1  # the python block's closing fence (0-based)
            j = start + 1
            while not lines[j].startswith("```text"):
                j += 1
            end = j + 1 + (block.expected or "").count("\n")
            lines[j + 1:end] = [outputs[block.line]]
        path.write_text("".join(lines), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
