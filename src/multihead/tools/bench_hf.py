"""``multihead bench --hf-generate``: a whole transformers model's prefill and decoding step, three ways.

Notation: B batch (1), P prompt tokens, L layers, E embed_dim, H heads, Hkv key/value heads.

A Llama-architecture ``LlamaForCausalLM`` with random weights (L=8, E=1024, H=16, Hkv=4,
vocab 32000, MLP 2816; float32, ``attn_implementation="sdpa"``) on a P=1536 prompt:

* ``HF``: unpatched, transformers' ``DynamicCache`` (its default in ``generate``);
* ``patched + DynamicCache``: :func:`multihead.hf.patch`, the same cache (our layers run
  around ``cache.update``; the cache concatenates every step);
* ``patched + KVCacheAdapter``: :class:`multihead.hf.KVCacheAdapter`, our KVCache written
  in place; the decoding step is the fused native step where
  :func:`multihead.decode.why_not_fused` allows (else the reason is reported and the
  wrapper's step writes in place through ``update``).

With ``compiled=True`` (``--compiled``) the decoding step is timed two more ways, each model's
``forward`` compiled by ``torch.compile`` after the prompt is written: ``HF + StaticCache,
compiled`` (transformers' recipe for fast decoding) and ``patched + KVCacheAdapter, compiled``.

And, for the prefill only, its floor: ``FLOOR``, the unpatched model with every attention
module reduced to its four projections (q, k, v from the input, the output projection on q;
no positions, scores or cache): the GEMMs every way runs, below which no attention kernel
can take the prompt. What each way takes beyond it is the attention's own work (RoPE, the cache, the
scores and the glue), reported as ``beyond_floor_s`` and as a ratio to HF's.

Timed: the prefill (a fresh cache each call, ``logits_to_keep=1``) and one decoding step
after the prompt (rolled back with ``crop(-1)`` between calls), interleaved round-robin
with :func:`multihead.tools.bench.time_interleaved`, so machine noise hits all three alike;
medians, tokens/s and ratios to ``HF`` are reported (of the medians, and "paired": the median
of the per-round ratios, which a machine drifting between rounds disturbs less). It takes minutes at full size (hence
its own flag, outside the suite); ``quick`` runs tiny sizes in seconds.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

from .bench import Fn, paired_speedup, time_interleaved

__all__ = ["run_hf_generate", "format_hf_generate", "FULL", "QUICK"]

#: Model and prompt sizes: (layers, embed_dim, heads, kv_heads, vocab, intermediate, prompt).
FULL = {"layers": 8, "embed_dim": 1024, "heads": 16, "kv_heads": 4, "vocab": 32000, "intermediate": 2816,
        "prompt": 1536}
QUICK = {"layers": 2, "embed_dim": 64, "heads": 4, "kv_heads": 2, "vocab": 128, "intermediate": 128, "prompt": 32}
WAYS = ("HF", "patched + DynamicCache", "patched + KVCacheAdapter")
#: The decoding step's compiled ways (``compiled=True``): each model's ``forward`` compiled by
#: ``torch.compile``, transformers' ``StaticCache`` (its recipe for compiled decoding) and ours.
COMPILED = ("HF + StaticCache, compiled", "patched + KVCacheAdapter, compiled")
FLOOR = "HF, attention = projections only"


class _ProjectionsOnly(torch.nn.Module):
    """Stands in for a Llama attention module in the prefill's floor: its four projections
    at the prompt's shapes and nothing else. Returns ``(o_proj(q), None)`` as the module does."""

    def __init__(self, attn: Any) -> None:
        super().__init__()
        self.q_proj: torch.nn.Module = attn.q_proj
        self.k_proj: torch.nn.Module = attn.k_proj
        self.v_proj: torch.nn.Module = attn.v_proj
        self.o_proj: torch.nn.Module = attn.o_proj

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """hidden_states (B, P, E) -> ((B, P, E), None)."""
        self.k_proj(hidden_states)
        self.v_proj(hidden_states)
        return self.o_proj(self.q_proj(hidden_states)), None


def _floor_model(hf: Any) -> Any:
    """A copy of ``hf`` whose attention modules are :class:`_ProjectionsOnly`."""
    floor = copy.deepcopy(hf)
    for layer in floor.model.layers:
        layer.self_attn = _ProjectionsOnly(layer.self_attn)
    return floor


def _models(sizes: dict[str, int]) -> tuple[Any, Any]:
    """(unpatched, patched) LlamaForCausalLM with the same random weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ..interop.hf_patch import patch

    config = LlamaConfig(hidden_size=sizes["embed_dim"], num_attention_heads=sizes["heads"],
                         num_key_value_heads=sizes["kv_heads"], num_hidden_layers=sizes["layers"],
                         vocab_size=sizes["vocab"], intermediate_size=sizes["intermediate"],
                         max_position_embeddings=max(4096, 2 * sizes["prompt"]))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    return hf, patch(copy.deepcopy(hf))


def run_hf_generate(*, quick: bool = False, reps: int | None = None, compiled: bool = False,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time prefill and one decoding step three ways; return plain dicts (see the module docstring).

    Args:
        quick: :data:`QUICK` sizes instead of :data:`FULL`.
        reps: timed repetitions of each (default 7 for prefill and 15 for a step; quick: 2, 3).
        compiled: also time the decoding step the :data:`COMPILED` ways, among the others (each
            compiled before the timing; minutes at full size).
        progress: called with a short line before each phase.

    Returns:
        ``{"sizes", "paths", "prefill": {way: stats}, "decode": {way: stats}, "same_logits",
        "compiled_same_logits" (the compiled steps' logits equal HF's; None unless ``compiled``),
        "prefill_floor"}``, stats as :func:`time_interleaved`'s plus ``tokens_per_s`` and ``vs_hf``
        (time ratio); ``prefill_floor``: the :data:`FLOOR` model's times, timed among the prefill's
        ways, and ``beyond_floor_s`` per way (its median less the floor's).
    """
    from transformers import DynamicCache

    from ..interop import hf_cache

    adapter = hf_cache.KVCacheAdapter
    say = progress or (lambda line: None)
    sizes = QUICK if quick else FULL
    p = sizes["prompt"]
    say(f"building two Llama models ({sizes['layers']} layers, E={sizes['embed_dim']})")
    hf, patched = _models(sizes)
    ids = torch.randint(0, sizes["vocab"], (1, p), generator=torch.Generator().manual_seed(1))
    step_ids = ids[:, -1:]
    models = dict(zip(WAYS, (hf, patched, patched)))

    def new_cache(way: str) -> Any:
        return adapter(patched, max_len=p + 1) if way == WAYS[2] else DynamicCache(config=hf.config)

    def prefill(way: str, cache: Any) -> Any:
        return models[way](input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits

    with torch.no_grad():
        caches = {way: new_cache(way) for way in WAYS}
        logits = {way: prefill(way, caches[way]) for way in WAYS}
        say(f"prefill P={p}, interleaved")
        prefill_fns: dict[str, Fn] = {way: functools.partial(lambda w: prefill(w, new_cache(w)), way)
                                      for way in WAYS}
        prefill_fns[FLOOR] = functools.partial(_floor_model(hf), input_ids=ids, use_cache=False, logits_to_keep=1)
        pre = time_interleaved(prefill_fns, reps=reps or (2 if quick else 7), warmup=0)
        floor = pre.pop(FLOOR)
        say("decoding step after the prompt, interleaved")
        step_fns: dict[str, Fn] = {way: functools.partial(models[way], input_ids=step_ids, cache=caches[way],
                                                          use_cache=True) for way in WAYS}
        resets: dict[str, Fn] = {way: functools.partial(_roll_back, caches[way], p) for way in WAYS}
        compiled_same = None
        if compiled:
            say("compiling the decoding step two ways")
            step_logits = hf(input_ids=step_ids, cache=caches["HF"], use_cache=True).logits
            resets["HF"]()
            compiled_same = True
            for way, (step, reset, got) in _compiled_steps(hf, ids, step_ids).items():
                step_fns[way], resets[way] = step, reset
                compiled_same = compiled_same and torch.allclose(got, step_logits, rtol=1e-4, atol=1e-4)
        dec = time_interleaved(step_fns, reps=reps or (3 if quick else 15), warmup=2 if compiled else 1,
                               resets=resets)
    same = all(torch.allclose(logits[w], logits["HF"], rtol=1e-4, atol=1e-4) for w in WAYS)
    return {"sizes": dict(sizes), "threads": torch.get_num_threads(), "paths": caches[WAYS[2]].paths,
            "same_logits": same, "compiled_same_logits": compiled_same, "prefill": _rated(pre, p),
            "decode": _rated(dec, 1),
            "prefill_floor": {"median_s": floor["median_s"], "min_s": floor["min_s"], "times_s": floor["times_s"],
                              "beyond_floor_s": {way: st["median_s"] - floor["median_s"] for way, st in pre.items()}}}


def _compiled_steps(hf: Any, ids: torch.Tensor, step_ids: torch.Tensor) -> dict[str, tuple[Fn, Fn, torch.Tensor]]:
    """Per :data:`COMPILED` way: (the decoding step after the prompt ``ids`` (1, P), its reset, its
    logits), on a copy of ``hf`` whose ``forward`` is compiled after the prompt is written (eagerly, once)."""
    from transformers import StaticCache

    from ..interop import hf_cache
    from ..interop.hf_patch import patch

    p = ids.shape[1]
    out: dict[str, tuple[Fn, Fn, torch.Tensor]] = {}
    for way in COMPILED:
        model = copy.deepcopy(hf)
        if way == COMPILED[0]:
            cache: Any = StaticCache(config=hf.config, max_cache_len=p + 1)
            reset: Fn = functools.partial(_roll_back_static, cache, p)
        else:
            model = patch(model)
            cache = hf_cache.KVCacheAdapter(model, max_len=p + 1)
            reset = functools.partial(_roll_back, cache, p)
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)  # the prompt, written once, eager
        model.forward = torch.compile(model.forward)  # the step's graph only
        logits = model(input_ids=step_ids, cache=cache, use_cache=True).logits  # compiles the step
        step: Fn = functools.partial(model, input_ids=step_ids, cache=cache, use_cache=True)
        reset()
        out[way] = (step, reset, logits)
    return out


def _roll_back_static(cache: Any, held: int) -> None:
    """A ``StaticCache`` back to ``held`` tokens: each layer writes at its ``cumulative_length`` (the
    step's slot is written again by the next call)."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(held)


def _roll_back(cache: Any, held: int) -> None:
    """Back to ``held`` tokens (a step appended one)."""
    extra = cache.get_seq_length() - held
    if extra > 0:
        cache.crop(-extra)


def _rated(stats: dict[str, dict[str, Any]], tokens: int) -> dict[str, dict[str, Any]]:
    """Per way: medians, tokens/s, ``vs_hf`` (ratio of medians) and ``paired_vs_hf`` (the median
    of the per-round ratios, steadier on a drifting machine: :func:`~multihead.tools.bench.paired_speedup`)."""
    base = stats["HF"]
    return {way: {"median_s": st["median_s"], "min_s": st["min_s"], "tokens_per_s": tokens / st["median_s"],
                  "vs_hf": st["median_s"] / base["median_s"], "paired_vs_hf": paired_speedup(base, st)}
            for way, st in stats.items()}


def format_hf_generate(result: dict[str, Any]) -> str:
    """The two tables (prefill, decoding step) as text."""
    s = result["sizes"]
    lines = [f"LlamaForCausalLM, random weights: L={s['layers']} E={s['embed_dim']} H={s['heads']} "
             f"Hkv={s['kv_heads']} vocab={s['vocab']} MLP={s['intermediate']}; prompt P={s['prompt']}; "
             f"float32, {result['threads']} threads; first logits agree: {result['same_logits']}"
             + ("" if result.get("compiled_same_logits") is None
                else f"; compiled steps' logits agree: {result['compiled_same_logits']}"),
             f"adapter's decoding path per layer: {sorted(set(map(str, result['paths'])))}"]
    for phase, unit in (("prefill", "prompt tokens/s"), ("decode", "tokens/s")):
        lines += ["", f"{phase}:", f"  {'way':<38}{'median ms':>12}{unit:>18}{'time vs HF':>12}{'paired':>8}"]
        for way, st in result[phase].items():
            lines.append(f"  {way:<38}{st['median_s'] * 1e3:>12.2f}{st['tokens_per_s']:>18.1f}{st['vs_hf']:>12.3f}"
                         f"{st['paired_vs_hf']:>8.3f}")
        if phase == "prefill" and "prefill_floor" in result:
            lines += _floor_lines(result["prefill_floor"])
    return "\n".join(lines)


def _floor_lines(floor: dict[str, Any]) -> list[str]:
    """The prefill's floor and each way's time beyond it (its attention's own work), as a ratio to HF's."""
    beyond = floor["beyond_floor_s"]
    rest = ", ".join(f"{way} {s * 1e3:.1f} ms" + ("" if way == "HF" else f" ({s / beyond['HF']:.3f}x HF's)")
                     for way, s in beyond.items())
    return [f"  floor, {FLOOR}: {floor['median_s'] * 1e3:.2f} ms (no attention kernel can take the prompt below it);",
            f"  beyond it (the attention's own work): {rest}"]
