"""``multihead bench --generate-jobs --curve``: the decode rate of one row against the prompt's length.

Notation: P prompt tokens (the cache's length when decoding starts), V vocabulary.

The model of :data:`multihead.tools.bench_generate.MODELS` (a 0.5B Llama or Qwen3 with random
weights, float32, sdpa), one row. For each prompt length P (shortest first): each way
(:data:`WAYS`) prefills the same (1, P) prompt into its own cache, then decodes :data:`WARM` untimed
and ``steps`` timed tokens, one forward each, the ways taking turns at every step
(round-robin: the machine's drift hits them alike). Every way is fed the same token at each
step (``HF, DynamicCache``'s greedy one), so all caches hold the same tokens; the other ways'
greedy tokens are compared with it (``tokens_equal``). Per way and P: the median step time with
its spread, tokens/s, and the speed-up over ``HF, DynamicCache`` of the medians and paired per
step (:func:`~multihead.tools.bench.paired_speedup`). :func:`plot` draws tokens/s against P.

* ``HF, DynamicCache``: the unpatched model, transformers' default cache;
* ``HF, StaticCache``: the unpatched model on a ``StaticCache`` of P + the steps (eager);
* ``patched + KVCacheAdapter``: :func:`multihead.hf.patch`, on a
  :class:`multihead.hf.KVCacheAdapter` of the same size (its paths are reported).
"""

from __future__ import annotations

import os
import statistics
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .bench import paired_speedup, save_figure
from .bench_generate import MODELS, QUICK_MODELS, make_models

__all__ = ["run_decode_curve", "format_decode_curve", "plot", "LENGTHS", "QUICK_LENGTHS", "STEPS", "WARM", "WAYS"]

#: Prompt lengths of a full run, and of ``quick``.
LENGTHS = (256, 512, 1024, 2048, 4096)
QUICK_LENGTHS = (8, 16)
#: Timed decoding steps per way and length (``quick``: 2), after :data:`WARM` untimed ones.
STEPS = 16
WARM = 2
WAYS = ("HF, DynamicCache", "HF, StaticCache", "patched + KVCacheAdapter")
BASE = WAYS[0]


class _Way:
    """One way's model and cache on one prompt: ``prefill`` then ``step`` a token at a time."""

    def __init__(self, model: Any, cache: Any) -> None:
        self.model, self.cache, self.length = model, cache, 0

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (1, P) -> the last position's logits (1, V)."""
        return self._forward(ids)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """token (1, 1) -> its logits (1, V)."""
        return self._forward(token)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        at = torch.arange(self.length, self.length + ids.shape[1])
        with torch.no_grad():
            out = self.model(input_ids=ids, cache=self.cache, use_cache=True, cache_position=at,
                             position_ids=at[None], logits_to_keep=1)
        self.length += ids.shape[1]
        return out.logits[:, -1]


def _ways(hf: Any, patched: Any, capacity: int) -> dict[str, _Way]:
    """The :data:`WAYS`, each with a fresh cache of room for ``capacity`` tokens."""
    from transformers import DynamicCache, StaticCache

    from ..interop.hf_cache import KVCacheAdapter

    return {WAYS[0]: _Way(hf, DynamicCache(config=hf.config)),
            WAYS[1]: _Way(hf, StaticCache(config=hf.config, max_cache_len=capacity)),
            WAYS[2]: _Way(patched, KVCacheAdapter(patched, max_len=capacity))}


def _length(hf: Any, patched: Any, prompt: int, steps: int, vocab: int) -> dict[str, Any]:
    """One prompt length: every way prefilled, then the steps round-robin; per way its times and agreement."""
    ids = torch.randint(1, vocab, (1, prompt), generator=torch.Generator().manual_seed(prompt))
    ways = _ways(hf, patched, prompt + WARM + steps)
    tokens = {name: way.prefill(ids).argmax(-1, keepdim=True) for name, way in ways.items()}  # (1, 1) each
    times: dict[str, list[float]] = {name: [] for name in ways}
    equal = {name: True for name in ways}
    for i in range(WARM + steps):
        feed = tokens[BASE]  # every cache holds the same tokens
        for name, way in ways.items():
            equal[name] &= bool(torch.equal(tokens[name], feed))
            start = time.perf_counter()
            tokens[name] = way.step(feed).argmax(-1, keepdim=True)
            if i >= WARM:
                times[name].append(time.perf_counter() - start)
    rows = {name: _row(times[name], times[BASE], equal[name]) for name in ways}
    paths = sorted(set(map(str, ways[WAYS[2]].cache.paths)))
    return {"prompt": prompt, "ways": rows, "adapter_paths": paths}


def _row(times: list[float], base: list[float], equal: bool) -> dict[str, Any]:
    """A way's step times -> median, spread, tokens/s and the speed-ups over the base way's."""
    median = statistics.median(times)
    return {"median_s": median, "min_s": min(times), "max_s": max(times), "times_s": times,
            "tokens_per_s": 1.0 / median, "speedup": statistics.median(base) / median,
            "paired_speedup": paired_speedup({"times_s": times}, {"times_s": base}), "tokens_equal": equal}


def run_decode_curve(*, model: str = "llama", lengths: Sequence[int] | None = None, steps: int | None = None,
                     quick: bool = False, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Decode tokens/s of one row against the prompt's length, the :data:`WAYS` (see the module's docstring).

    Args:
        model: a name of :data:`~multihead.tools.bench_generate.MODELS`.
        lengths: prompt lengths (default :data:`LENGTHS`; ``quick``: :data:`QUICK_LENGTHS`), run shortest first.
        steps: timed decoding steps per way and length (default :data:`STEPS`; ``quick``: 2).
        quick: the tiny model of :data:`~multihead.tools.bench_generate.QUICK_MODELS` (seconds).
        progress: called with a short line before each length.

    Returns:
        ``{"case", "machine", "threads", "model", "sizes", "steps", "warm", "others_cpu_share",
        "load_average", "lengths": [{"prompt", "adapter_paths", "ways": {way: {"median_s", "min_s",
        "max_s", "times_s", "tokens_per_s", "speedup", "paired_speedup", "tokens_equal"}}}]}``.

    Raises:
        ValueError: an unknown model, a length or step count that is not a positive integer.
    """
    from . import machine

    table = QUICK_MODELS if quick else MODELS
    if model not in table:
        raise ValueError(f"model must be one of {sorted(table)}, got {model!r}")
    plan = sorted(set(lengths if lengths is not None else (QUICK_LENGTHS if quick else LENGTHS)))
    n = steps if steps is not None else (2 if quick else STEPS)
    if not plan or any(not isinstance(p, int) or p < 1 for p in [*plan, n]):
        raise ValueError(f"lengths and steps must be positive integers, got {plan!r} and {n!r}")
    say = progress or (lambda line: None)
    say(f"building two {table[model]['arch']} models ({table[model]['layers']} layers, E={table[model]['embed_dim']})")
    hf, patched = make_models(table[model])
    result: dict[str, Any] = {"case": "decode_curve", "machine": machine.machine_info(),
                              "threads": torch.get_num_threads(), "model": model, "sizes": table[model],
                              "steps": n, "warm": WARM, "lengths": []}
    with machine.OthersLoad() as load:
        for prompt in plan:
            say(f"{model}: a prompt of {prompt} tokens, {n} timed steps each way")
            result["lengths"].append(_length(hf, patched, prompt, n, table[model]["vocab"]))
    result.update(others_cpu_share=load.share, load_average=list(os.getloadavg()))
    return result


def format_decode_curve(result: dict[str, Any]) -> str:
    """The table: per prompt length, each way's step time (spread), tokens/s and speed-ups."""
    from .machine import load_note

    m, s = result["machine"], result["sizes"]
    lines = [f"decode rate against the prompt's length, one row, float32, {result['threads']} torch threads, "
             f"{m.get('cpu', 'CPU')}; {result['steps']} timed steps per way and length after {result['warm']}",
             f"{result['model']}: {s['arch']} L={s['layers']} E={s['embed_dim']} H={s['heads']} Hkv={s['kv_heads']} "
             f"D={s['head_dim']}; {load_note(result['others_cpu_share'])}", "",
             f"  {'prompt':>6}  {'way':<26} {'step ms (min-max)':>22} {'tok/s':>6} {'vs HF':>6} {'paired':>6}  tokens"]
    for point in result["lengths"]:
        for name, row in point["ways"].items():
            spread = f"{row['median_s'] * 1e3:.1f} ({row['min_s'] * 1e3:.1f}-{row['max_s'] * 1e3:.1f})"
            lines.append(f"  {point['prompt']:>6}  {name:<26} {spread:>22} {row['tokens_per_s']:>6.1f} "
                         f"{row['speedup']:>5.2f}x {row['paired_speedup']:>5.2f}x  "
                         f"{'equal' if row['tokens_equal'] else 'DIFFER'}")
    paths = sorted({p for point in result["lengths"] for p in point["adapter_paths"]})
    lines += ["", f"adapter's paths: {paths}"]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """PNG: decode tokens/s against the prompt's length (log scale), one line per way, and beside it
    each way's speed-up over ``HF, DynamicCache``, paired per step (steady where the machine drifts)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    fig, (rate, ratio) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in WAYS:
        wide = 2.5 if name == WAYS[2] else 1.5
        for ax, key in ((rate, "tokens_per_s"), (ratio, "paired_speedup")):
            points = [(p["prompt"], p["ways"][name][key]) for p in result["lengths"]]
            ax.plot(*zip(*points), marker="o", label=name, linewidth=wide)
    rate.set_ylabel("decode tokens/s (one row)")
    ratio.set_ylabel("speed-up over HF, DynamicCache (paired)")
    for ax in (rate, ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens held when decoding starts)")
        ax.grid(alpha=0.3)
    rate.set_ylim(bottom=0)
    rate.legend(fontsize=8)
    m, s = result["machine"], result["sizes"]
    title = (f"{s['arch']} ({s['layers']} layers, d={s['embed_dim']}, {s['heads']}/{s['kv_heads']} heads), float32, "
             f"one row — {m.get('cpu', 'CPU')}, {result['threads']} threads")
    fig.suptitle(textwrap.fill(title, 110), fontsize=10)
    return save_figure(fig, path)
