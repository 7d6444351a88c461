"""``multihead bench --embed``: the embedding job, a corpus of texts through the bundled model, against
sentence-transformers.

Notation: N texts, E embed_dim (384 for the bundled all-MiniLM-L6-v2).

The corpus is made here, the same on every machine: N sentences (512; ``quick``: 24) of 4 to 120
words drawn from a fixed word list, their lengths spread like a real corpus (most between 8 and
40 words, a long tail). Four ways embed it, each the whole corpus per call, batches of 32:

* ``sentence-transformers``: ``SentenceTransformer(bundled).encode(texts)``, its defaults (it sorts
  texts by length, pads each batch, and runs transformers' BERT with ``sdpa``);
* ``sentence-transformers + mh.hf.patch``: the same object with its BERT patched
  (:func:`multihead.hf.patch`): multihead's attention layers on the padded batches;
* ``multihead embed``: :func:`multihead.tools.embed.Embedder` (what ``multihead embed`` runs):
  sorted batches run on their real tokens only (:func:`multihead.hf.pack_padding`);
* ``multihead embed, bfloat16``: the same with the encoder in bfloat16 (``--dtype bfloat16``), the
  precision OpenVINO picks by default on a CPU with AMX; its least cosine says what it costs.

Timed round-robin (:func:`multihead.tools.bench.time_interleaved`), so machine noise hits all four
alike: sentences/s of the median and the spread (slowest and fastest call), the speed-up over
sentence-transformers of the medians and paired per round, and the share of the CPUs other
processes used meanwhile (:class:`multihead.tools.machine.OthersLoad`). Every way's embeddings are
compared with sentence-transformers' (the least cosine). sentence-transformers' ONNX Runtime and
OpenVINO backends are not among the ways: their optimum packages pin older transformers, so they
need an environment of their own.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from .bench import time_interleaved

__all__ = ["corpus", "run_embed", "format_embed", "WAYS"]

WAYS = ("sentence-transformers", "sentence-transformers + mh.hf.patch", "multihead embed",
        "multihead embed, bfloat16")
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


def _ways(texts: list[str], batch_size: int) -> tuple[dict[str, Callable[[], np.ndarray]], dict[str, Any]]:
    """The ways of :data:`WAYS`, each embedding ``texts`` when called, and facts about the corpus."""
    import torch
    from sentence_transformers import SentenceTransformer

    import multihead as mh

    from . import embed, models

    path = str(models.bundled_model_dir())
    plain = SentenceTransformer(path, device="cpu")
    patched = SentenceTransformer(path, device="cpu")
    bert: Any = patched[0].auto_model  # the transformers model inside sentence-transformers' first module
    mh.hf.patch(bert)
    ours, ours16 = embed.Embedder(path), embed.Embedder(path, dtype=torch.bfloat16)
    ways: dict[str, Callable[[], np.ndarray]] = {
        WAYS[0]: lambda: plain.encode(texts, batch_size=batch_size),
        WAYS[1]: lambda: patched.encode(texts, batch_size=batch_size),
        WAYS[2]: lambda: ours.embed(texts, batch_size=batch_size).vectors,
        WAYS[3]: lambda: ours16.embed(texts, batch_size=batch_size).vectors,
    }
    tokens = [len(ids) for ids in plain.tokenizer(texts)["input_ids"]]
    return ways, {"texts": len(texts), "tokens": sum(tokens), "longest": max(tokens),
                  "median_tokens": statistics.median(tokens)}


def run_embed(*, quick: bool = False, reps: int | None = None, batch_size: int = 32,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Embed the corpus each way of :data:`WAYS` (see the module's docstring); returns the results as JSON data.

    Raises:
        ImportError: sentence-transformers or the bundled model's package is not installed.
    """
    import torch

    from . import machine

    say = progress or (lambda line: None)
    texts = corpus(24 if quick else 512)
    say(f"loading the bundled model {len(WAYS)} ways, {len(texts)} texts")
    ways, facts = _ways(texts, batch_size)
    with torch.inference_mode():
        outputs = {name: np.asarray(fn()) for name, fn in ways.items()}
        say("timing")
        with machine.OthersLoad() as load:
            stats = time_interleaved(ways, reps=reps or (2 if quick else 7), warmup=1)
    base = outputs[_BASE]
    rows = {}
    for name, st in stats.items():
        times = st["times_s"]
        rows[name] = {"median_s": st["median_s"], "min_s": min(times), "max_s": max(times),
                      "sentences_per_s": len(texts) / st["median_s"],
                      "speedup": stats[_BASE]["median_s"] / st["median_s"],
                      "paired_speedup": statistics.median(b / t for b, t in zip(stats[_BASE]["times_s"], times)),
                      "least_cosine": float(_cosines(outputs[name], base).min())}
    return {"case": "embed", "corpus": facts, "batch_size": batch_size, "threads": torch.get_num_threads(),
            "machine": machine.machine_info(), "others_cpu_share": load.share, "ways": rows}


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N,) cosine of each row of ``a`` (N, E) with the same row of ``b``."""
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def format_embed(result: dict[str, Any]) -> str:
    """The result of :func:`run_embed` as a table."""
    c = result["corpus"]
    lines = [f"the bundled all-MiniLM-L6-v2 on {c['texts']} texts ({c['tokens']} tokens, median "
             f"{c['median_tokens']:g}, longest {c['longest']}), batches of {result['batch_size']}, "
             f"{result['threads']} threads, {result['machine'].get('cpu', 'this CPU')}:",
             f"{'way':<38} {'sentences/s':>12} {'spread (s)':>16} {'vs ST':>7} {'paired':>7} {'least cos':>10}"]
    for name, r in result["ways"].items():
        lines.append(f"{name:<38} {r['sentences_per_s']:>12.1f} {r['min_s']:>7.3f}–{r['max_s']:<8.3f} "
                     f"{r['speedup']:>6.2f}× {r['paired_speedup']:>6.2f}× {r['least_cosine']:>10.7f}")
    share = result.get("others_cpu_share")
    if share is not None:
        lines.append(f"other processes used {share:.0%} of the CPUs meanwhile"
                     + (" (busy: these figures are not a verdict)" if share > 0.10 else ""))
    return "\n".join(lines)
