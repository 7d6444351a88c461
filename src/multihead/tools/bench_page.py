"""The benchmark suite's results as Markdown, for the docs' performance page and the README.

``multihead bench`` writes ``bench.json``; the docs keep one per machine in ``docs/results/``
and show them through :func:`markdown` (every case, ours against each peer) and
:func:`headline` (the few rows the README shows). A test regenerates both from the JSON
files, so the pages always show what was measured, never figures typed in by hand.

    python -m multihead.tools.bench_page docs/results/NAME.json [--headline]
    python -m multihead.tools.bench_page docs/results/NAME.json --write   # the pages, in place

The performance page holds one section per results file, between ``<!-- results:NAME -->``
and ``<!-- /results:NAME -->`` (a picture ``NAME.png`` beside the JSON is shown with it); the
README's table is the headline of the file named in its ``<!-- headline:NAME -->`` marker.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["markdown", "headline", "machine_line", "load", "HEADLINE", "section", "replace_between"]

Result = dict[str, Any]

#: The README's rows: (case, keys that must hold in our row's label, the peer, the words), in order;
#: an ``impl`` key names our row where it is not the group's ``multihead`` one.
HEADLINE: tuple[tuple[str, dict[str, Any], str, str], ...] = (
    ("core/full", {"seq": 1024}, "torch sdpa", "attention core, no mask, S=1024 (H=12, D=64)"),
    ("core/causal", {"seq": 1024}, "torch sdpa", "attention core, causal, S=1024"),
    ("core/train", {"seq": 1024, "causal": True}, "torch sdpa", "core forward + backward, causal, S=1024"),
    ("layer/prefill", {"causal": False}, "HF BERT sdpa", "layer prefill, d=768, S=1024"),
    ("layer/prefill", {"causal": True}, "HF Llama sdpa", "layer prefill, causal"),
    ("layer/prefill", {"causal": False}, "torch MHA", "layer prefill"),
    ("layer/decode", {}, "HF Llama sdpa StaticCache", "decoding one token, d=2048, 32/8 heads, 4096 cached"),
    ("layer/bundled", {}, "HF BertAttention sdpa", "the bundled model's layer, B=3, S=24, d=384"),
    ("layer/bundled", {"impl": "multihead, packed (52 real tokens)"}, "HF BertAttention sdpa",
     "the same, its 52 real tokens packed (as the patched model runs it)"),
    ("call/attention", {"keys": 16}, "torch SDPA", "a small call, (1, 12, 16, 32), 1 thread"),
)
_LABEL_KEYS = ("shape", "keys", "batch", "seq", "causal", "embed_dim", "heads", "kv_heads", "cached", "path")


def load(path: str | Path) -> dict[str, Any]:
    """A suite's results as ``multihead bench`` wrote them."""
    suite = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(suite, dict) or "machine" not in suite or "results" not in suite:
        raise ValueError(f"{path}: not the JSON of `multihead bench` (no 'machine' and 'results')")
    return suite


def machine_line(suite: dict[str, Any]) -> str:
    """Which CPU, build, torch and threads the figures come from."""
    m, lim = suite["machine"], suite["limits"]
    features = ", ".join(m.get("vector_features") or []) or "no vector features listed"
    return (f"{m['cpu']} ({features}), {m['cores']} cores, torch {m['torch']}, {m['torch_threads']} threads, "
            f"the `{m.get('native_build') or 'no'}` build of the kernels; sgemm {lim['sgemm_gflops']:.0f} GFLOP/s "
            f"at the start of the run")


def _label(row: Result) -> str:
    return ", ".join(f"{k}={row[k]}" for k in _LABEL_KEYS if k in row)


def paired(ours: Result, peer: Result) -> float:
    """The median over rounds of the peer's time over ours, timed back to back in each round."""
    return statistics.median(p / o for p, o in zip(peer["times_s"], ours["times_s"]))


def _groups(suite: dict[str, Any]) -> list[tuple[str, str, Result, list[Result]]]:
    """(case, label, our row, the peers' rows) per measured point, in the suite's order."""
    found: dict[tuple[str, str], list[Result]] = {}
    for row in suite["results"]:
        if "median_s" in row:
            found.setdefault((row["case"], _label(row)), []).append(row)
    out = []
    for (case, label), rows in found.items():
        ours = next((r for r in rows if r["is_ours"]), None)
        if ours is not None:
            out.append((case, label, ours, [r for r in rows if not r["is_ours"]]))
    return out


def _per_call(row: Result) -> float:
    """Seconds of one call: a small case's sample is ``calls`` calls in a row."""
    return float(row["median_s"]) / int(row.get("calls", 1))


def _time(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def markdown(suite: dict[str, Any]) -> str:
    """Every measured point as one table row per peer: times, the paired ratio, and our rate
    as a share of the best GEMM timed in the same loop where the suite measured it."""
    lines = [machine_line(suite) + ".", "",
             "| case | point | multihead | peer | peer's time | peer / ours (paired) | ours % of the GEMM |",
             "|---|---|---|---|---|---|---|"]
    for case, label, ours, peers in _groups(suite):
        share = f"{100 * ours['frac_gemm_loop']:.0f}%" if "frac_gemm_loop" in ours else ""
        for peer in peers:
            lines.append(f"| {case} | {label} | {_time(_per_call(ours))} | {peer['impl']} | "
                         f"{_time(_per_call(peer))} | {paired(ours, peer):.2f}× | {share} |")
    return "\n".join(lines)


def _find(suite: dict[str, Any], case: str, where: dict[str, Any], peer: str) -> tuple[Result, Result] | None:
    for c, _, ours, peers in _groups(suite):
        mine = next((r for r in (ours, *peers) if r["impl"] == where.get("impl", ours["impl"])), None)
        if c == case and mine is not None and all(mine.get(k) == v for k, v in where.items()):
            match = next((p for p in peers if p["impl"] == peer), None)
            if match is not None:
                return mine, match
    return None


def headline(suite: dict[str, Any]) -> str:
    """The README's table: the :data:`HEADLINE` rows found in this run, ours against the peer."""
    lines = [f"Measured on {machine_line(suite)}, with `multihead bench`; a ratio above 1 means multihead "
             "took less time than the peer.", "",
             "| case | multihead | peer | peer / ours (paired) |", "|---|---|---|---|"]
    for case, where, peer, words in HEADLINE:
        pair = _find(suite, case, where, peer)
        if pair is not None:
            ours, other = pair
            lines.append(f"| {words} | {_time(_per_call(ours))} | {peer} {_time(_per_call(other))} "
                         f"| {paired(ours, other):.2f}× |")
    return "\n".join(lines)


def section(name: str, suite: dict[str, Any], picture: bool) -> str:
    """The performance page's section of one results file ``docs/results/NAME.json``."""
    lines = [f"### {suite['machine']['cpu']}: `{name}`", ""]
    if picture:
        lines += [f"![throughput against sequence length, {suite['machine']['cpu']}](results/{name}.png)", ""]
    return "\n".join(lines) + "\n" + markdown(suite)


def replace_between(text: str, marker: str, body: str) -> str:
    """``text`` with what lies between ``<!-- marker -->`` and ``<!-- /marker -->`` replaced by ``body``.

    Raises:
        ValueError: the markers are missing (named)."""
    start, end = f"<!-- {marker} -->\n", f"\n<!-- /{marker} -->"
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"the markers {start.strip()} ... {end.strip()} are missing")
    return text[:i + len(start)] + body + text[j:]


def _write(path: Path) -> None:
    """Put one results file's section into docs/performance.md (and the README's headline
    if the README names that file)."""
    name, suite = path.stem, load(path)
    docs = path.parent.parent
    page = docs / "performance.md"
    text = page.read_text(encoding="utf-8")
    marker = f"results:{name}"
    if f"<!-- {marker} -->" not in text:  # a new machine: its markers before the closing one
        text = text.replace("<!-- /results -->", f"<!-- {marker} -->\n<!-- /{marker} -->\n<!-- /results -->")
    page.write_text(replace_between(text, marker, section(name, suite, path.with_suffix(".png").exists())),
                    encoding="utf-8")
    readme = docs.parent / "README.md"
    text = readme.read_text(encoding="utf-8")
    if f"<!-- headline:{name} -->" in text:
        readme.write_text(replace_between(text, f"headline:{name}", headline(suite)), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the Markdown of a results file (``--headline``: the README's rows), or write it
    into the pages (``--write``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    flags = {a for a in args if a.startswith("--")}
    paths = [a for a in args if not a.startswith("--")]
    if len(paths) != 1 or not flags <= {"--headline", "--write"}:
        sys.stderr.write("usage: python -m multihead.tools.bench_page RESULTS.json [--headline | --write]\n")
        return 2
    if "--write" in flags:
        _write(Path(paths[0]))
        return 0
    suite = load(paths[0])
    sys.stdout.write((headline(suite) if "--headline" in flags else markdown(suite)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
