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


def _rate(way: dict) -> str:
    """A way's decode rate as the README's generate table writes it: median (min–max)."""
    d = way["decode_tokens_per_s"]
    return f"{d['median']:.1f} tokens/s ({d['min']:.1f}–{d['max']:.1f})"


def _ttft(way: dict) -> str:
    """A way's time to first token as the README's generate table writes it: median (min–max)."""
    d = way["ttft_s"]
    return f"{d['median']:.2f} s ({d['min']:.2f}–{d['max']:.2f})"


def test_the_readme_generate_table_is_its_results_file() -> None:
    """Each figure of the README's whole-generate table: the medians, spreads and ratios of the file it cites."""
    import json

    readme = (ROOT / "README.md").read_text("utf-8")
    result = json.loads((ROOT / "docs" / "results" / "generate_jobs" / "amd-epyc-zen3-avx2-llama-512.json")
                        .read_text("utf-8"))
    ours, hf = "patched + KVCacheAdapter", "HF, DynamicCache"
    for job in result["jobs"]:
        ways, b = job["ways"], job["batch"]
        kind = "batch 1" if b == 1 else f"batch {b}, left-padded"
        decode = (f"| {kind}: decode | {_rate(ways[ours])} | {_rate(ways[hf])} | {ways[ours]['decode_speedup']:.2f}× "
                  f"({ways[ours]['decode_paired_speedup']:.2f}× paired) |")
        ttft = (f"| {kind}: time to first token | {_ttft(ways[ours])} | {_ttft(ways[hf])} | "
                f"{ways[ours]['ttft_speedup']:.2f}× ({ways[ours]['ttft_paired_speedup']:.2f}× paired) |")
        assert decode in readme and ttft in readme, (decode, ttft)


def test_the_readme_flex_table_is_its_results_file() -> None:
    """Each ratio of the README's table against FlexAttention and SDPA: the paired ratios of the file it cites."""
    import json

    from multihead.tools.bench_flex import _ratio

    readme = (ROOT / "README.md").read_text("utf-8")
    result = json.loads((ROOT / "docs" / "results" / "flex" / "intel-xeon-amx.json").read_text("utf-8"))
    flex, sdpa = "FlexAttention (compiled)", "SDPA, dense mask"
    names = {"T5 bias": "T5 bias (its table learned in training)"}
    shown = 0
    for case in result["cases"]:
        impls, ours = case["impls"], case["impls"]["multihead"]
        if case["seq"] != 2048 or sdpa not in impls or case["case"] == "every tile full":
            continue
        row = (f"| {names.get(case['case'], case['case'])} | {_ratio(ours['forward'], impls[flex]['forward'])} | "
               f"{_ratio(ours['forward'], impls[sdpa]['forward'])} | {_ratio(ours['train'], impls[sdpa]['train'])} |")
        assert row in readme, row
        shown += 1
    assert shown == 6


def test_the_performance_page_families_block_is_its_results_file() -> None:
    """The per-family decoding table on the performance page: its JSON as ``multihead bench --hf-generate
    --families`` prints it, every family's logits and greedy tokens equal to Hugging Face's."""
    import json

    from multihead.tools.bench_hf_families import format_hf_families

    result = json.loads((ROOT / "docs" / "results" / "hf_generate_families" / "intel-xeon-amx.json")
                        .read_text("utf-8"))
    page = (ROOT / "docs" / "performance.md").read_text("utf-8")
    assert f"```text\n{format_hf_families(result)}\n```" in page
    assert not result["mismatches"] and not result["failed"]


def test_the_readme_decode_curve_is_its_results_file() -> None:
    """The README's ratios of one row's decode rate against the prompt's length: the paired speed-ups
    of the file whose picture it shows."""
    import json

    readme = (ROOT / "README.md").read_text("utf-8")
    name = "docs/results/generate_jobs/amd-epyc-zen3-avx2-llama-curve"
    result = json.loads((ROOT / f"{name}.json").read_text("utf-8"))
    paired = {p["prompt"]: p["ways"]["patched + KVCacheAdapter"]["paired_speedup"] for p in result["lengths"]}
    words = (f"{paired[256]:.2f}× HF's `DynamicCache` at 256 tokens, {paired[2048]:.2f}× at 2,048, "
             f"{paired[4096]:.2f}× at 4,096 (paired per step)")
    assert words in " ".join(readme.split())  # wherever the paragraph's lines break
    assert f"]({name}.png)" in readme and (ROOT / f"{name}.png").exists()


def _sentences(way: dict, texts: int) -> str:
    """A way's sentences/s as the README's embedding table writes it: median (slowest–fastest call)."""
    return f"{way['sentences_per_s']:.1f} ({texts / way['max_s']:.1f}–{texts / way['min_s']:.1f})"


def test_the_readme_embedding_table_is_its_results_files() -> None:
    """Each row of the README's embedding table (2 threads, 1 thread, 2 threads beside a competing process;
    batches of 32 and 128): the sentences/s, spreads and ratios of the files it is made of."""
    import json

    readme = (ROOT / "README.md").read_text("utf-8")
    settings = {"": "2 threads", "-1thread": "1 thread", "-competing": "2 threads + a competing process"}
    for suffix, label in settings.items():
        result = json.loads((ROOT / "docs" / "results" / "embed" / f"amd-epyc-zen3-avx2-peers{suffix}.json")
                            .read_text("utf-8"))
        assert result["machine"]["cpu"] in readme and result["competing"] is (suffix == "-competing")
        assert result["threads"] == (1 if suffix == "-1thread" else 2)
        texts = result["corpus"]["texts"]
        for run in result["runs"]:
            ways = run["ways"]
            ours = ways["multihead embed"]
            row = (f"| {label}, {run['batch_size']} | {_sentences(ours, texts)} | "
                   f"{_sentences(ways['sentence-transformers'], texts)} | {ours['speedup']:.2f}× "
                   f"({ours['paired_speedup']:.2f}× paired) | {_sentences(ways['ST backend=onnx'], texts)} | "
                   f"{_sentences(ways['ST backend=openvino'], texts)} |")
            assert row in readme, row


def test_the_readme_llama_cpp_ratios_are_their_results_files() -> None:
    """The README's ratios against llama.cpp: the medians of the two files the performance page shows."""
    import json

    readme = " ".join((ROOT / "README.md").read_text("utf-8").split())
    ours, f32, q8 = "patched + KVCacheAdapter", "llama.cpp, F32 GGUF", "llama.cpp, Q8_0 GGUF"
    ratios: dict[str, list[float]] = {"decode": [], "first": [], "q8": []}
    for name in ("llama", "qwen3"):
        path = ROOT / "docs" / "results" / "generate_jobs" / f"amd-epyc-zen3-avx2-{name}-512-llamacpp.json"
        result = json.loads(path.read_text("utf-8"))
        (job,) = result["jobs"]
        assert result["machine"]["cpu"] == "AMD EPYC" and job["batch"] == 1 and job["prompt"] == 512
        rows = {**job["ways"], **job["peers"]}
        rate = {way: rows[way]["decode_tokens_per_s"]["median"] for way in (ours, f32, q8)}
        ratios["decode"].append(rate[f32] / rate[ours])
        ratios["first"].append(rows[f32]["ttft_s"]["median"] / rows[ours]["ttft_s"]["median"])
        ratios["q8"].append(rate[q8] / rate[ours])
    llama, qwen3 = (f"{x:.2f}" for x in ratios["decode"])
    assert f"decodes the Llama at {llama}× our rate and the Qwen3 at {qwen3}×" in readme
    assert "our first tokens come {:.2f}× and {:.2f}× sooner".format(*ratios["first"]) in readme
    assert "Q8_0 files decode {:.2f}× and {:.2f}× faster than our float32".format(*ratios["q8"]) in readme
    settings = []
    for name in ("1thread", "competing"):
        path = ROOT / "docs" / "results" / "generate_jobs" / f"amd-epyc-zen3-avx2-llama-512-llamacpp-{name}.json"
        result = json.loads(path.read_text("utf-8"))
        assert result["threads"] == (1 if name == "1thread" else 2) and result["competing"] == (name == "competing")
        (job,) = result["jobs"]
        rows = {**job["ways"], **job["peers"]}
        settings.append(rows[f32]["decode_tokens_per_s"]["median"] / rows[ours]["decode_tokens_per_s"]["median"])
    assert "the Llama at {:.2f}× at one thread and {:.2f}× beside a competing process".format(*settings) in readme


def test_the_readme_auto_threads_ratios_are_their_results_file() -> None:
    """The README's first-token ratios beside a competing process, with ``mh.auto_threads`` and
    without: the paired speed-ups of the Qwen3 run the performance page shows."""
    import json

    readme = " ".join((ROOT / "README.md").read_text("utf-8").split())
    path = ROOT / "docs" / "results" / "generate_jobs" / "amd-epyc-zen3-avx2-qwen3-512-auto-competing.json"
    result = json.loads(path.read_text("utf-8"))
    (job,) = result["jobs"]
    assert result["machine"]["cpu"] == "AMD EPYC" and result["competing"] and job["batch"] == 1
    auto, plain = (job["ways"][w]["ttft_paired_speedup"] for w in
                   ("patched + KVCacheAdapter, threads auto", "patched + KVCacheAdapter"))
    assert f"first token came {auto:.2f}× sooner than HF's (paired; {plain:.2f}× without it)" in readme
