"""``multihead bench --generate-jobs``: whole ``model.generate`` calls, as users run them, six ways.

Notation: B batch, P prompt tokens (the longest row), N new tokens, L layers, E embed_dim, H heads,
Hkv key/value heads, D head_dim, V vocabulary.

Two models of about 0.5B parameters with random weights from their configs, float32,
``attn_implementation="sdpa"`` (:data:`MODELS`: a Llama and a Qwen3 architecture; the exact sizes
and parameter counts are in the output). Each job is one ``generate`` call: a (B, P) prompt
(B > 1: rows of different lengths, left-padded, seeded), N new tokens, greedy, ``min_new_tokens``
= ``max_new_tokens`` = N. Six ways (:data:`WAYS`):

* ``HF, DynamicCache``: the unpatched model, transformers' default cache;
* ``HF, StaticCache``: ``cache_implementation="static"``;
* ``HF, StaticCache, compiled``: the same with ``model.forward = torch.compile(model.forward)``,
  transformers' recipe for static caches (default mode: CUDA graphs do not apply on a CPU);
* ``patched + KVCacheAdapter``: :func:`multihead.hf.patch` and ``cache=`` a
  :class:`multihead.hf.KVCacheAdapter` of ``max_len`` P + N (our in-place cache);
* ``patched + KVCacheAdapter, compiled``: the same with the patched model's forward compiled;
* ``patched + KVCacheAdapter, threads auto``: the eager way inside :func:`multihead.auto_threads`
  (each layer call on torch's threads or one, whichever runs faster now), a fresh one each call;
  only where torch has more than one thread.

Per way, from each call: the time to first token (from the call to the first token's logits: the
prefill) and the decode rate, B·(N − 1) tokens over the rest of the call; medians with their
spread (fastest and slowest of the repetitions) and the speed-up over ``HF, DynamicCache``, of
the medians and paired per round (:func:`~multihead.tools.bench.paired_speedup`). The ways are
timed round-robin (:func:`~multihead.tools.bench.time_interleaved`), so machine noise hits them
alike, after two untimed calls each (one without the compiled ways): the compiled ways compile
there, afresh for each job (``torch.compiler.reset()``: its few graphs stay within torch's
recompile limit, and reaching it raises rather than running a forward uncompiled), and a
compiled way that would compile again while timed raises. Every call's tokens, the untimed
ones too, are compared with those of ``HF, DynamicCache``'s first call: a difference is reported
(``mismatches``), never hidden.

The load: the share of the CPUs other processes used while a job was timed
(:class:`~multihead.tools.machine.OthersLoad`) and the load average. ``competing=True`` runs one
CPU-bound process beside each job's timing (:func:`~multihead.tools.machine.competing_process`).

``llama_bench`` (the path of llama.cpp's ``llama-bench``) adds llama.cpp as a peer of each job of
one row (:mod:`multihead.tools.bench_llama_cpp`): the same model written as a GGUF file, float32 and
Q8_0, timed by ``llama-bench`` straight after the job (beside a competing process if the job had one), its
ratios to ``HF, DynamicCache``'s medians; its tokens are not compared.

Prompts run in increasing length: transformers sizes a static cache to the longest it has made
for the model, so a shorter prompt after a longer one would attend over a longer cache.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..threads import auto_threads
from .bench import paired_speedup, spread, time_interleaved

__all__ = ["run_generate_jobs", "make_prompts", "make_models", "format_generate_jobs", "MODELS", "QUICK_MODELS", "WAYS",
           "PROMPTS", "BATCHES", "NEW_TOKENS", "FULL", "QUICK"]

#: The models' sizes: about 0.5B parameters each (Llama-3's vocabulary untied; Qwen3-0.6B's widths, tied).
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "Llama", "layers": 24, "embed_dim": 1024, "heads": 16, "kv_heads": 4, "head_dim": 64,
              "intermediate": 2816, "vocab": 128256, "tied": False},
    "qwen3": {"arch": "Qwen3", "layers": 24, "embed_dim": 1024, "heads": 16, "kv_heads": 8, "head_dim": 128,
              "intermediate": 3072, "vocab": 151936, "tied": True},
}
_TINY = {"layers": 2, "embed_dim": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128, "vocab": 128}
#: ``quick``: the same architectures at tiny sizes (seconds).
QUICK_MODELS: dict[str, dict[str, Any]] = {name: {**sizes, **_TINY} for name, sizes in MODELS.items()}
PROMPTS = (512, 2048)
BATCHES = (1, 8)
NEW_TOKENS = 128
REPS = 3
#: The jobs of a full run (each model, each prompt and batch) and of ``quick``.
FULL: dict[str, Any] = {"prompts": PROMPTS, "batches": BATCHES, "new_tokens": NEW_TOKENS, "reps": REPS}
QUICK: dict[str, Any] = {"prompts": (12,), "batches": (1, 3), "new_tokens": 4, "reps": 1}
WAYS = ("HF, DynamicCache", "HF, StaticCache", "HF, StaticCache, compiled", "patched + KVCacheAdapter",
        "patched + KVCacheAdapter, compiled", "patched + KVCacheAdapter, threads auto")
BASE = WAYS[0]
#: Untimed calls of each way first, without and with the compiled ways: a compiled forward compiles
#: in the first call and again in the second (where our adapter reuses the buffers the first made).
_WARMUP = {False: 1, True: 2}
_PAD = 0  # the pad token id; prompts draw from 1 .. V - 1

Way = Callable[[Any], torch.Tensor]  # a logits processor (the first-token stamp) -> tokens (B, P + N)


def _config(sizes: dict[str, Any]) -> Any:
    """The transformers config of ``sizes`` (:data:`MODELS`' rows)."""
    from transformers import LlamaConfig, Qwen3Config

    cls = {"Llama": LlamaConfig, "Qwen3": Qwen3Config}[sizes["arch"]]
    return cls(hidden_size=sizes["embed_dim"], num_attention_heads=sizes["heads"],
               num_key_value_heads=sizes["kv_heads"], head_dim=sizes["head_dim"],
               num_hidden_layers=sizes["layers"], intermediate_size=sizes["intermediate"],
               vocab_size=sizes["vocab"], tie_word_embeddings=sizes["tied"], max_position_embeddings=8192,
               pad_token_id=_PAD, bos_token_id=1, eos_token_id=2)


def make_models(sizes: dict[str, Any]) -> tuple[Any, Any]:
    """(unpatched, patched) causal LMs of ``sizes`` with the same random weights (seed 0)."""
    import copy

    from transformers import AutoModelForCausalLM

    from ..interop.hf_patch import patch

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config(sizes), attn_implementation="sdpa").eval()
    return hf, patch(copy.deepcopy(hf))


def make_prompts(vocab: int, prompt: int, batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, P) and attention mask (B, P): row 0 holds P tokens, the others P/2 .. P (seeded),
    left-padded with the pad id 0."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, prompt), generator=gen)
    real = torch.randint(max(1, prompt // 2), prompt + 1, (batch,), generator=gen)  # (B,) each row's tokens
    real[0] = prompt
    mask = torch.arange(prompt).expand(batch, prompt) >= (prompt - real)[:, None]  # (B, P)
    return ids.masked_fill(~mask, _PAD), mask.long()


class _FirstToken:
    """A logits processor that keeps the time of its first call (the first token's logits) and changes nothing."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """input_ids (B, S), scores (B, V) -> scores."""
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, stamp: _FirstToken,
              forward: Callable[..., Any] | None = None, **kwargs: Any) -> torch.Tensor:
    """``model.generate`` greedy for exactly ``new_tokens``, ``forward`` (a compiled one) in place of the model's."""
    from transformers import LogitsProcessorList

    if forward is not None:
        model.forward = forward
    try:
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, num_beams=1, pad_token_id=_PAD,
                              logits_processor=LogitsProcessorList([stamp]), **kwargs)
    finally:
        if forward is not None:
            del model.forward  # the class's forward again


def _ways(hf: Any, patched: Any, compiled: dict[str, Callable[..., Any]] | None, ids: torch.Tensor,
          mask: torch.Tensor, new_tokens: int) -> tuple[dict[str, Way], Any]:
    """The :data:`WAYS` on one job (the compiled ones where ``compiled`` gives the models' compiled
    forwards), each a call ``way(stamp) -> tokens (B, P + N)``, and the eager adapter (its ``paths``)."""
    from ..interop import hf_cache

    max_len = ids.shape[1] + new_tokens
    adapter = hf_cache.KVCacheAdapter(patched, max_len=max_len)
    adapter_compiled = hf_cache.KVCacheAdapter(patched, max_len=max_len)

    def way(model: Any, forward: Callable[..., Any] | None = None, **kwargs: Any) -> Way:
        return lambda stamp: _generate(model, ids, mask, new_tokens, stamp, forward, **kwargs)

    ways = {WAYS[0]: way(hf), WAYS[1]: way(hf, cache_implementation="static")}
    if compiled is not None:
        ways[WAYS[2]] = way(hf, compiled["hf"], cache_implementation="static")
    ways[WAYS[3]] = way(patched, cache=adapter)
    if compiled is not None:
        ways[WAYS[4]] = way(patched, compiled["patched"], cache=adapter_compiled)
    if torch.get_num_threads() > 1:
        adapter_auto = hf_cache.KVCacheAdapter(patched, max_len=max_len)

        def auto(stamp: _FirstToken) -> torch.Tensor:
            with auto_threads(patched):
                return _generate(patched, ids, mask, new_tokens, stamp, cache=adapter_auto)

        ways[WAYS[5]] = auto
    return ways, adapter


def _job(ways: dict[str, Way], batch: int, new_tokens: int, reps: int, competing: bool,
         warmup: int) -> dict[str, Any]:
    """Time ``ways`` round-robin on one job; per way its stats (:func:`_stats`) and every call's
    agreement with the tokens of :data:`BASE`'s first call."""
    from . import machine

    stamps: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in ways}

    def timed(name: str) -> None:
        stamp = _FirstToken()
        start = time.perf_counter()
        tokens = ways[name](stamp)
        end = time.perf_counter()
        first = stamp.at if stamp.at is not None else end
        stamps[name].append((first - start, end - first))
        outputs[name].append(tokens)

    fns = {name: (lambda n=name: timed(n)) for name in ways}
    with machine.competing_process(competing), _loud_recompile_limit():
        for _ in range(warmup):  # the compiled ways compile here
            for fn in fns.values():
                fn()
        with _no_recompiles(), machine.OthersLoad() as load:
            time_interleaved(fns, reps=reps, warmup=0)
    rows = {name: _stats(stamps[name][warmup:], batch * (new_tokens - 1)) for name in ways}
    reference = outputs[BASE][0]
    for name, row in rows.items():
        row.update(_ratios(row, rows[BASE]))
        row.update(_worst([_agreement(tokens, reference) for tokens in outputs[name]]))
    return {"ways": rows, "others_cpu_share": load.share, "load_average": list(os.getloadavg())}


def _loud_recompile_limit() -> contextlib.AbstractContextManager[Any]:
    """Past torch's recompile limit a compiled forward would run uncompiled, silently: raise instead."""
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, "fail_on_recompile_limit_hit"):  # older torch: the per-job reset only
        return contextlib.nullcontext()
    return dynamo_config.patch(fail_on_recompile_limit_hit=True)


def _no_recompiles() -> contextlib.AbstractContextManager[Any]:
    """A compiled way that would compile again while it is timed raises instead of timing the compiler:
    ``torch.compiler.set_stance("fail_on_recompile")``."""
    stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return stance("fail_on_recompile") if stance is not None else contextlib.nullcontext()


def _agreement(tokens: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """How ``tokens`` (B, P + N) differ from ``reference``: the count and the first (row, column), or equal."""
    if tokens.shape != reference.shape:
        return {"tokens_equal": False, "differing_tokens": None, "first_difference": None,
                "shape": list(tokens.shape)}
    differ = (tokens != reference).nonzero()
    return {"tokens_equal": len(differ) == 0, "differing_tokens": len(differ),
            "first_difference": differ[0].tolist() if len(differ) else None}


def _worst(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Over a way's calls: equal only if every call was; else the first call that differed."""
    bad = [call for call in calls if not call["tokens_equal"]]
    return bad[0] if bad else calls[0]


def _stats(stamps: list[tuple[float, float]], decode_tokens: int) -> dict[str, Any]:
    """Per call (time to first token, the rest) -> their medians and spreads, the decode rate in tokens/s."""
    ttft = [first for first, _ in stamps]
    rates = [decode_tokens / rest for _, rest in stamps]
    return {"ttft_s": spread(ttft), "decode_tokens_per_s": spread(rates),
            "total_s": spread([first + rest for first, rest in stamps])}


def _ratios(row: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    """Speed-ups over ``base`` (above 1: faster), of the medians and paired per round."""
    ttft, base_ttft = row["ttft_s"], base["ttft_s"]
    rate, base_rate = row["decode_tokens_per_s"], base["decode_tokens_per_s"]
    return {"ttft_speedup": base_ttft["median"] / ttft["median"],
            "ttft_paired_speedup": paired_speedup({"times_s": ttft["values"]}, {"times_s": base_ttft["values"]}),
            "decode_speedup": rate["median"] / base_rate["median"],
            "decode_paired_speedup": paired_speedup({"times_s": base_rate["values"]}, {"times_s": rate["values"]})}


def _positive(name: str, values: Sequence[int]) -> None:
    if not values or any(not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name} must be positive integers, got {list(values)!r}")


def _plan(default: dict[str, Any], prompts: Sequence[int] | None, batches: Sequence[int] | None,
          new_tokens: int | None, reps: int | None) -> tuple[list[int], list[int], int, int]:
    """(prompt lengths ascending, batch sizes, new tokens, reps): the given ones, else ``default``'s; checked."""
    lengths = sorted(set(prompts if prompts is not None else default["prompts"]))
    sizes_b = list(batches if batches is not None else default["batches"])
    n = new_tokens if new_tokens is not None else default["new_tokens"]
    r = reps if reps is not None else default["reps"]
    for what, values in (("prompts", lengths), ("batches", sizes_b), ("reps", [r])):
        _positive(what, values)
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"new_tokens must be an integer of at least 2 (a first token and a decode), got {n!r}")
    return lengths, sizes_b, n, r


def run_generate_jobs(*, models: Sequence[str] | None = None, prompts: Sequence[int] | None = None,
                      batches: Sequence[int] | None = None, new_tokens: int | None = None, reps: int | None = None,
                      competing: bool = False, compiled: bool = True, quick: bool = False,
                      llama_bench: str | None = None,
                      progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time whole ``generate`` calls the :data:`WAYS` (see the module's docstring); the results as JSON data.

    Args:
        models: names of :data:`MODELS` (default: both).
        prompts: prompt lengths P (default :data:`PROMPTS`; run shortest first).
        batches: batch sizes B (default :data:`BATCHES`).
        new_tokens: N, at least 2 (default :data:`NEW_TOKENS`).
        reps: timed calls of each way per job (default 3), after one untimed call (two with the compiled ways).
        competing: run one CPU-bound process beside each job's timing.
        compiled: also the two compiled ways (each compiles in its untimed calls: minutes at full size).
        quick: :data:`QUICK_MODELS` and :data:`QUICK`'s prompts, batches, tokens and reps (seconds),
            where not given.
        llama_bench: llama.cpp's ``llama-bench``, timed on each job of one row (see the module's docstring).
        progress: called with a short line before each job.

    Returns:
        ``{"case", "machine", "threads", "competing", "new_tokens", "reps", "untimed", "models": {name: {"sizes",
        "parameters"}}, "jobs": [{"model", "prompt", "batch", "row_lengths", "others_cpu_share",
        "load_average", "adapter_paths", "ways": {way: stats}, "peers": {name: rates} (with
        ``llama_bench``, B = 1)}], "mismatches": [line]}``.

    Raises:
        ValueError: an unknown model name, a size that is not a positive integer, ``new_tokens`` < 2.
        FileNotFoundError: ``llama_bench`` is not an executable file (before any work).
    """
    from . import machine
    from .bench_llama_cpp import check_binary

    if llama_bench is not None:
        check_binary(llama_bench)

    table = QUICK_MODELS if quick else MODELS
    names = list(models) if models is not None else list(table)
    for name in names:
        if name not in table:
            raise ValueError(f"models must be among {sorted(table)}, got {name!r}")
    lengths, sizes_b, n, r = _plan(QUICK if quick else FULL, prompts, batches, new_tokens, reps)
    say = progress or (lambda line: None)
    result: dict[str, Any] = {"case": "generate_jobs", "machine": machine.machine_info(),
                              "threads": torch.get_num_threads(), "competing": competing, "new_tokens": n,
                              "reps": r, "untimed": _WARMUP[compiled], "models": {}, "jobs": [], "mismatches": []}
    for name in names:
        _run_model(name, table[name], lengths, sizes_b, n, r, competing, compiled, say, result, llama_bench)
    return result


def _run_model(name: str, sizes: dict[str, Any], lengths: list[int], batches: list[int], new_tokens: int,
               reps: int, competing: bool, compiled: bool, say: Callable[[str], None], result: dict[str, Any],
               llama_bench: str | None = None) -> None:
    """Every job of one model, appended to ``result``."""
    say(f"building two {sizes['arch']} models ({sizes['layers']} layers, E={sizes['embed_dim']})")
    hf, patched = make_models(sizes)
    result["models"][name] = {"sizes": dict(sizes), "parameters": sum(p.numel() for p in hf.parameters())}
    forwards = {"hf": torch.compile(hf.forward), "patched": torch.compile(patched.forward)} if compiled else None
    peer = _LlamaCpp(llama_bench, hf) if llama_bench is not None else None
    with torch.inference_mode(), peer if peer is not None else contextlib.nullcontext():
        for p in lengths:
            for b in batches:
                say(f"{name}: P={p}, B={b}, N={new_tokens}, {reps} timed calls each way after "
                    f"{_WARMUP[compiled]} untimed")
                if compiled:  # each job compiles afresh: its graphs stay within torch's recompile limit
                    torch.compiler.reset()
                ids, mask = make_prompts(sizes["vocab"], p, b)
                ways, adapter = _ways(hf, patched, forwards, ids, mask, new_tokens)
                job = _job(ways, b, new_tokens, reps, competing, _WARMUP[compiled])
                job = {"model": name, "prompt": p, "batch": b, "row_lengths": mask.sum(1).tolist(),
                       "adapter_paths": sorted(set(map(str, adapter.paths))), **job}
                if peer is not None and b == 1:
                    say(f"{name}: P={p}, llama.cpp's llama-bench, {reps} repetitions")
                    job["peers"] = peer.rates(job, new_tokens, reps, competing)
                result["jobs"].append(job)
                result["mismatches"] += _mismatch_lines(job)


class _LlamaCpp:
    """llama.cpp on one model (:mod:`multihead.tools.bench_llama_cpp`): its GGUF files, written once in
    a folder that lasts as long as this context, timed on each job it is given."""

    def __init__(self, llama_bench: str, model: Any) -> None:
        self.binary, self.model = llama_bench, model
        self.files: dict[str, Path] = {}

    def __enter__(self) -> "_LlamaCpp":
        import tempfile

        self.work = tempfile.TemporaryDirectory(prefix="multihead-gguf-")
        return self

    def __exit__(self, *exc: object) -> None:
        self.work.cleanup()

    def rates(self, job: dict[str, Any], new_tokens: int, reps: int, competing: bool) -> dict[str, Any]:
        """llama.cpp's rates on ``job``'s prompt (:func:`~multihead.tools.bench_llama_cpp.llama_cpp_rates`),
        each with its ratios to the medians of :data:`BASE` (``ttft_speedup``, ``decode_speedup``)."""
        from . import machine
        from .bench_llama_cpp import llama_cpp_rates, make_ggufs

        threads = torch.get_num_threads()
        if not self.files:
            self.files = make_ggufs(self.binary, self.model, self.work.name, threads)
        with machine.competing_process(competing):
            peers = llama_cpp_rates(self.binary, self.files, prompt=job["prompt"], new_tokens=new_tokens,
                                    threads=threads, reps=reps)
        base = job["ways"][BASE]
        for r in peers.values():
            r["ttft_speedup"] = base["ttft_s"]["median"] / r["ttft_s"]["median"]
            r["decode_speedup"] = r["decode_tokens_per_s"]["median"] / base["decode_tokens_per_s"]["median"]
        return peers


def _mismatch_lines(job: dict[str, Any]) -> list[str]:
    """One line per way whose tokens differ from HF's in ``job``."""
    where = f"{job['model']} P={job['prompt']} B={job['batch']}"
    return [f"{where}: {way}'s tokens differ from HF's: {row['differing_tokens']} tokens, first at (row, column) "
            f"{row['first_difference']}" + (f", shape {row['shape']}" if "shape" in row else "")
            for way, row in job["ways"].items() if not row["tokens_equal"]]


def format_generate_jobs(result: dict[str, Any]) -> str:
    """The result of :func:`run_generate_jobs` as tables, one per job, then the mismatches."""
    lines = [f"whole generate calls, float32, {result['threads']} torch threads, "
             f"{result['machine'].get('cpu', 'this CPU')}, {result['new_tokens']} new tokens (greedy), "
             f"{result['reps']} timed calls per way after {result['untimed']} untimed; competing process: "
             f"{'one CPU-bound' if result['competing'] else 'none'}"]
    for name, info in result["models"].items():
        s = info["sizes"]
        lines.append(f"{name}: {s['arch']} L={s['layers']} E={s['embed_dim']} H={s['heads']} Hkv={s['kv_heads']} "
                     f"D={s['head_dim']} MLP={s['intermediate']} V={s['vocab']} "
                     f"({'tied' if s['tied'] else 'untied'} embeddings), {info['parameters']:,} parameters")
    for job in result["jobs"]:
        lines += ["", *_job_lines(job, result["competing"])]
    lines += ["", "mismatches: none: every way's tokens equal HF's" if not result["mismatches"]
              else f"MISMATCHES ({len(result['mismatches'])}):", *(f"  {m}" for m in result["mismatches"])]
    return "\n".join(lines)


def _job_lines(job: dict[str, Any], competing: bool) -> list[str]:
    """One job's header (its rows, the load) and a row per way."""
    from .machine import load_note

    rows = job["row_lengths"]
    head = [f"{job['model']} P={job['prompt']} B={job['batch']} (rows {min(rows)}..{max(rows)} tokens"
            f"{', left-padded' if min(rows) < max(rows) else ''}); {load_note(job['others_cpu_share'], competing)}, "
            f"load average {job['load_average'][0]:.2f}; adapter's paths {job['adapter_paths']}",
            f"  {'way':<37}{'TTFT ms (min-max)':>26}{'vs HF':>7}{'paired':>7}"
            f"{'decode tok/s (min-max)':>27}{'vs HF':>7}{'paired':>7}  tokens"]
    for way, r in job["ways"].items():
        ttft, rate = _cells(r)
        head.append(f"  {way:<37}{ttft:>26}{r['ttft_speedup']:>6.2f}x{r['ttft_paired_speedup']:>6.2f}x"
                    f"{rate:>27}{r['decode_speedup']:>6.2f}x{r['decode_paired_speedup']:>6.2f}x  "
                    + ("equal" if r["tokens_equal"] else "DIFFER"))
    for peer, r in job.get("peers", {}).items():  # timed after the job, not round-robin: no paired ratio
        ttft, rate = _cells(r)
        head.append(f"  {peer:<37}{ttft:>26}{r['ttft_speedup']:>6.2f}x{'-':>7}"
                    f"{rate:>27}{r['decode_speedup']:>6.2f}x{'-':>7}  not compared")
    return head


def _cells(r: dict[str, Any]) -> tuple[str, str]:
    """A row's time to first token in ms and decode rate in tokens/s, each median (min-max)."""
    t, d = r["ttft_s"], r["decode_tokens_per_s"]
    return (f"{t['median'] * 1e3:.1f} ({t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f})",
            f"{d['median']:.1f} ({d['min']:.1f}-{d['max']:.1f})")
