"""``multihead bench --embed``: the embedding job, a corpus of texts through the bundled model, against
sentence-transformers.

Notation: N texts, E embed_dim (384 for the bundled all-MiniLM-L6-v2).

The corpus is made here, the same on every machine: N sentences (512; ``quick``: 24; ``texts``) of 4
to 120 words drawn from a fixed word list, their lengths spread like a real corpus (most between 8
and 40 words, a long tail). Each way embeds the whole corpus per call, at each batch size asked
(default 32):

* ``sentence-transformers``: ``SentenceTransformer(bundled).encode(texts)``, its defaults (it sorts
  texts by length, pads each batch, and runs transformers' BERT with ``sdpa``);
* ``sentence-transformers + mh.hf.patch``: the same object with its BERT patched
  (:func:`multihead.hf.patch`): multihead's attention layers on the padded batches;
* ``multihead embed``: :func:`multihead.tools.embed.Embedder` (what ``multihead embed`` runs):
  sorted batches run on their real tokens only (:func:`multihead.hf.pack_padding`);
* ``multihead embed, threads auto``: the same with ``threads="auto"`` (``--threads auto``): torch's
  threads or one, batch by batch, whichever runs faster (:class:`multihead.threads.ThreadChooser`);
* ``multihead embed, bfloat16``: the same with the encoder in bfloat16 (``--dtype bfloat16``), the
  precision OpenVINO picks by default on a CPU with AMX; its least cosine says what it costs;
* the peers (:data:`multihead.tools.bench_embed_peers.PEERS`), when ``peers_python`` names the
  Python of their own environment: sentence-transformers with ``backend="onnx"`` (ONNX Runtime,
  float32, its default) and ``backend="openvino"`` as it runs by default (bf16 on a CPU with AMX)
  and held to float32 (``INFERENCE_PRECISION_HINT="f32"``). Each runs in a worker process
  (:mod:`multihead.tools.embed_peer`) with the same thread count as this process's torch; its
  calls are timed here, wall clock around the request. A peer that cannot start is a row that
  says why (so is each peer when no ``peers_python`` is given).

The peers' environment, a separate venv because their optimum packages pin older transformers
(the versions that were run are in ``benchmarks/peers-constraints.txt``)::

    python3.11 -m venv .peers
    .peers/bin/pip install -c benchmarks/peers-constraints.txt torch==2.13.0 "sentence-transformers[onnx,openvino]"
    multihead bench --embed --peers-python .peers/bin/python --texts 2000 --batch-size 32 128

The model is exported to ONNX and OpenVINO from the bundled folder, offline, the first time, and
kept (:func:`multihead.tools.bench_embed_peers.default_cache_dir`).

Timed round-robin (:func:`multihead.tools.bench.time_interleaved`), one round-robin per batch size,
so machine noise hits every way alike: sentences/s of the median and the spread (slowest and
fastest call), the speed-up over sentence-transformers of the medians and paired per round, and the
share of the CPUs other processes used meanwhile (:class:`multihead.tools.machine.OthersLoad`; the
peers' workers count as this run's). ``competing=True`` runs one CPU-bound process beside each
round-robin (:func:`multihead.tools.machine.competing_process`), to see the ways under load.
Every way's embeddings are compared with sentence-transformers' at the same batch size (the
least cosine).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import statistics
import tempfile
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .bench import time_interleaved

if TYPE_CHECKING:
    from .bench_embed_peers import Peer

__all__ = ["corpus", "run_embed", "format_embed", "WAYS"]

WAYS = ("sentence-transformers", "sentence-transformers + mh.hf.patch", "multihead embed",
        "multihead embed, bfloat16", "multihead embed, threads auto")
_BASE = "sentence-transformers"
_WORDS = ("attention", "model", "token", "head", "query", "key", "value", "layer", "vector", "matrix", "the",
          "a", "of", "and", "to", "in", "is", "that", "for", "with", "language", "learns", "pattern", "each",
          "weights", "softmax", "position", "rotary", "cache", "sequence", "text", "sentence", "embedding",
          "meaning", "word", "reads", "writes", "computes", "fast", "exact", "small", "large", "every",
          "which", "between", "over", "from", "their", "its", "one", "two", "many", "projection", "scale")


def corpus(n: int, seed: int = 0) -> list[str]:
    """``n`` sentences of 4 to 120 words (log-normal lengths, median about 18 words), seeded."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        words = min(120, max(4, int(rng.lognormvariate(2.9, 0.6))))
        texts.append(" ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + ".")
    return texts


def _ways(texts: list[str]) -> tuple[dict[str, Callable[[int], np.ndarray]], dict[str, str], dict[str, Any]]:
    """The ways of :data:`WAYS`, each embedding ``texts`` when called with a batch size; those not run
    here, each with why (bfloat16 on a CPU without bfloat16 instructions: :func:`embed.bf16_emulated`);
    facts about the corpus."""
    import torch
    from sentence_transformers import SentenceTransformer

    import multihead as mh

    from . import embed, models

    path = str(models.bundled_model_dir())
    plain = SentenceTransformer(path, device="cpu")
    patched = SentenceTransformer(path, device="cpu")
    bert: Any = patched[0].auto_model  # the transformers model inside sentence-transformers' first module
    mh.hf.patch(bert)
    ours = embed.Embedder(path)
    ways: dict[str, Callable[[int], np.ndarray]] = {
        WAYS[0]: lambda batch: plain.encode(texts, batch_size=batch),
        WAYS[1]: lambda batch: patched.encode(texts, batch_size=batch),
        WAYS[2]: lambda batch: ours.embed(texts, batch_size=batch).vectors,
        WAYS[4]: lambda batch: ours.embed(texts, batch_size=batch, threads="auto").vectors,
    }
    skipped: dict[str, str] = {}
    if (why := embed.bf16_emulated()) is None:
        ours16 = embed.Embedder(path, dtype=torch.bfloat16)
        ways[WAYS[3]] = lambda batch: ours16.embed(texts, batch_size=batch).vectors
    else:
        skipped[WAYS[3]] = why
    tokens = [len(ids) for ids in plain.tokenizer(texts)["input_ids"]]
    return ways, skipped, {"texts": len(texts), "tokens": sum(tokens), "longest": max(tokens),
                           "median_tokens": statistics.median(tokens)}


def run_embed(*, quick: bool = False, reps: int | None = None, batch_sizes: Sequence[int] = (32,),
              texts: int | None = None, peers_python: str | os.PathLike[str] | None = None,
              peers_cache: str | os.PathLike[str] | None = None, competing: bool = False,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Embed the corpus each way of :data:`WAYS` and :data:`~multihead.tools.bench_embed_peers.PEERS`
    (see the module's docstring); returns the results as JSON data.

    Args:
        quick: a small corpus (24 texts) and 2 timed calls: seconds, a check that every way runs.
        reps: timed calls of each way per batch size (default 7; ``quick``: 2).
        batch_sizes: one timed round-robin per batch size, in this order.
        texts: the corpus's size (default 512; ``quick``: 24).
        peers_python: the peers' environment's interpreter (None: the peers are listed as skipped).
        peers_cache: where the peers keep the exported models (default
            :func:`~multihead.tools.bench_embed_peers.default_cache_dir`).
        competing: one CPU-bound process beside each round-robin's timing.

    Raises:
        ImportError: sentence-transformers or the bundled model's package is not installed.
        multihead.tools.bench_embed_peers.PeerError: a peer failed after it had loaded.
    """
    import torch

    from . import bench_embed_peers, machine, models

    say = progress or (lambda line: None)
    corpus_texts = corpus(texts or (24 if quick else 512))
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="multihead-embed-") as tmp, contextlib.ExitStack() as stack:
        corpus_path = os.path.join(tmp, "corpus.json")
        with open(corpus_path, "w", encoding="utf-8") as f:
            json.dump(corpus_texts, f)
        peers, infos, skipped = bench_embed_peers.start_peers(
            peers_python, model=str(models.bundled_model_dir()), corpus=corpus_path, threads=threads,
            cache_dir=peers_cache, progress=say)
        for peer in peers.values():
            stack.callback(peer.close)
        say(f"loading the bundled model {len(WAYS)} ways, {len(corpus_texts)} texts")
        ours, not_run, facts = _ways(corpus_texts)
        runs = [_run_batch(ours, peers, {**not_run, **skipped}, batch, reps or (2 if quick else 7), competing, say)
                for batch in batch_sizes]
    return {"case": "embed", "corpus": facts, "threads": threads, "competing": competing,
            "machine": machine.machine_info(),
            "peers": {"python": None if peers_python is None else os.fspath(peers_python), "info": infos},
            "runs": runs}


def _run_batch(ours: dict[str, Callable[[int], np.ndarray]], peers: dict[str, Peer], skipped: dict[str, str],
               batch: int, reps: int, competing: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """One timed round-robin of every way at batch size ``batch`` (beside a competing process where
    ``competing``): its rows and the machine's load."""
    import torch

    from . import machine

    fns: dict[str, Callable[[], object]] = {name: functools.partial(fn, batch) for name, fn in ours.items()}
    fns.update({name: functools.partial(peer.time, batch) for name, peer in peers.items()})
    with torch.inference_mode():
        outputs = {name: np.asarray(fn(batch)) for name, fn in ours.items()}
        outputs.update({name: peer.embeddings(batch) for name, peer in peers.items()})
        say(f"timing, batches of {batch}")
        first = {name: len(peer.seconds) for name, peer in peers.items()}
        with machine.competing_process(competing), \
                machine.OthersLoad(helpers=[peer.pid for peer in peers.values()]) as load:
            stats = time_interleaved(fns, reps=reps, warmup=1)
    base = stats[_BASE]["times_s"]
    rows: dict[str, dict[str, Any]] = {}
    for name, st in stats.items():
        times = st["times_s"]
        rows[name] = {"median_s": st["median_s"], "min_s": min(times), "max_s": max(times),
                      "sentences_per_s": len(outputs[_BASE]) / st["median_s"],
                      "speedup": stats[_BASE]["median_s"] / st["median_s"],
                      "paired_speedup": statistics.median(b / t for b, t in zip(base, times)),
                      "least_cosine": float(_cosines(outputs[name], outputs[_BASE]).min())}
        if name in peers:  # the worker's own clock, its warm-up call left out
            rows[name]["peer_median_s"] = statistics.median(peers[name].seconds[first[name] + 1:])
    rows.update({name: {"skipped": reason} for name, reason in skipped.items()})
    return {"batch_size": batch, "others_cpu_share": load.share, "ways": rows}


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N,) cosine of each row of ``a`` (N, E) with the same row of ``b``."""
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def format_embed(result: dict[str, Any]) -> str:
    """The result of :func:`run_embed` as a table per batch size (a result of one batch size with its
    ways at the top level, as earlier versions wrote, reads too)."""
    from .machine import load_note

    c = result["corpus"]
    runs = result.get("runs") or [{k: result.get(k) for k in ("batch_size", "others_cpu_share", "ways")}]
    lines = [f"the bundled all-MiniLM-L6-v2 on {c['texts']} texts ({c['tokens']} tokens, median "
             f"{c['median_tokens']:g}, longest {c['longest']}), {result['threads']} threads, "
             f"{result['machine'].get('cpu', 'this CPU')}"
             + ("; beside one competing CPU-bound process:" if result.get("competing") else ":")]
    for run in runs:
        lines += ["", f"batches of {run['batch_size']}:", *_format_rows(run["ways"])]
        share = run.get("others_cpu_share")
        if share is not None:
            lines.append(load_note(share, bool(result.get("competing"))))
    lines += _format_peers(result.get("peers") or {})
    return "\n".join(lines)


def _format_rows(ways: dict[str, dict[str, Any]]) -> list[str]:
    """The table's header and one line per way (a skipped peer: its reason)."""
    lines = [f"{'way':<38} {'sentences/s':>12} {'spread (s)':>16} {'vs ST':>7} {'paired':>7} {'least cos':>10}"]
    for name, r in ways.items():
        if "skipped" in r:
            lines.append(f"{name:<38} skipped: {r['skipped']}")
            continue
        lines.append(f"{name:<38} {r['sentences_per_s']:>12.1f} {r['min_s']:>7.3f}–{r['max_s']:<8.3f} "
                     f"{r['speedup']:>6.2f}× {r['paired_speedup']:>6.2f}× {r['least_cosine']:>10.7f}")
    return lines


def _format_peers(peers: dict[str, Any]) -> list[str]:
    """What ran each peer: its precision, threads and packages."""
    infos = peers.get("info") or {}
    if not infos:
        return []
    versions = next(iter(infos.values()))["versions"]
    lines = ["", f"peers ({peers.get('python')}, Python {next(iter(infos.values()))['python']}): "
             + ", ".join(f"{k} {v}" for k, v in versions.items())]
    lines += [f"  {name}: {info['precision']}, {info['threads']} threads" for name, info in infos.items()]
    return lines
