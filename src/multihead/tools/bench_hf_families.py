"""``multihead bench --hf-generate --families``: one decoding step of each family, HF against ours.

Notation: B batch (1), P prompt tokens, L layers, E embed_dim, H heads, Hkv key/value heads,
D head_dim.

For each model type of :data:`FAMILIES` (default: all those the installed transformers has), a
model built from its config class with random weights at one common size (:data:`FULL`: L=4,
E=512, H=8, Hkv=4, D=64, vocab 8000, MLP 1024, mixtures of 4 experts routing each token to 2,
experts' MLP 256; float32, ``attn_implementation="sdpa"``) takes a P=256 prompt, then its
decoding step is timed two ways, interleaved round-robin with
:func:`multihead.tools.bench.time_interleaved` and rolled back between calls as
:mod:`~multihead.tools.bench_hf` does:

* ``HF``: unpatched, transformers' ``DynamicCache``;
* ``patched + KVCacheAdapter``: :func:`multihead.hf.patch` and :class:`multihead.hf.KVCacheAdapter`,
  whose path per layer is reported (``"fused"``, or the reason
  :func:`multihead.decode.why_not_fused` gives).

Reported per family: the medians, ``paired_speedup`` (HF's time / ours, the median of the
per-round ratios: above 1 is faster than HF), the adapter's paths, whether the prompt's and
the step's logits equal HF's, and whether greedy ``generate`` on a left-padded batch of 2
(:func:`multihead.tools.bench_generate.make_prompts`, N=8 new tokens) gives HF's tokens (a
mismatch is listed under ``MISMATCHES`` and the command exits with 1). Config fields that
differ per family are set in :data:`FAMILIES`, one entry each; a family that cannot be timed
says why (:data:`NOT_TIMED`) rather than being faked. ``quick`` runs tiny sizes in seconds.
"""

from __future__ import annotations

import copy
import functools
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .bench import Fn, paired_speedup, time_interleaved
from .bench_hf import WAYS, _rated, _roll_back

__all__ = ["run_hf_families", "format_hf_families", "FAMILIES", "NOT_TIMED", "FULL", "QUICK", "TIMED_WAYS"]

#: Sizes every family is built at: (layers, embed_dim, heads, kv_heads, head_dim, vocab, intermediate,
#: experts, top_k, expert_intermediate, prompt, new_tokens of the greedy check).
FULL = {"layers": 4, "embed_dim": 512, "heads": 8, "kv_heads": 4, "head_dim": 64, "vocab": 8000,
        "intermediate": 1024, "experts": 4, "top_k": 2, "expert_intermediate": 256, "prompt": 256, "new_tokens": 8}
QUICK = {"layers": 2, "embed_dim": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 128,
         "intermediate": 128, "experts": 4, "top_k": 2, "expert_intermediate": 32, "prompt": 32, "new_tokens": 4}
#: The two ways timed (names as in :data:`multihead.tools.bench_hf.WAYS`).
TIMED_WAYS = (WAYS[0], WAYS[2])
#: The tolerance of "logits equal HF's", as :func:`~multihead.tools.bench_hf.run_hf_generate`'s.
RTOL = ATOL = 1e-4

Sizes = dict[str, int]
Overrides = Callable[[Sizes], dict[str, Any]]


def _none(sizes: Sizes) -> dict[str, Any]:
    """No field beyond the common ones: the family's config defaults (partial rotary factor, no-RoPE
    layers, sliding-window pattern...) are its real checkpoints'."""
    return {}


def _moe(experts: str, expert_mlp: str, **more: Any) -> Overrides:
    """A mixture of ``sizes["experts"]`` experts, ``top_k`` per token, each an MLP of
    ``expert_intermediate``, under the config's names ``experts`` and ``expert_mlp``."""
    return lambda s: {experts: s["experts"], "num_experts_per_tok": s["top_k"], expert_mlp: s["expert_intermediate"],
                      **more}


def _mrope(sizes: Sizes) -> dict[str, Any]:
    """Qwen2-VL's M-RoPE: D/2 frequency slots split 1:1.5:1.5 among the time, height and width rows
    (its checkpoints' [16, 24, 24] for D=128)."""
    half = sizes["head_dim"] // 2
    t = half // 4
    h = (half - t) // 2
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [t, h, half - t - h]}}


#: Model type -> its config fields beyond the common ones (a function of the sizes). Order: the families'.
FAMILIES: dict[str, Overrides] = {
    "qwen3_moe": _moe("num_experts", "moe_intermediate_size"),
    "smollm3": _none,  # every 4th layer without RoPE (no_rope_layer_interval)
    "phi": _none,  # half of D rotates (partial_rotary_factor 0.5)
    "glm": _none,  # half of D rotates, interleaved pairs
    "glm4": _none,
    "stablelm": _none,  # a quarter of D rotates
    "cohere2": _none,  # 3 sliding-window layers : 1 global
    "olmo3": _none,  # 3 sliding-window layers : 1 global
    "granite": _none,
    "granitemoe": _moe("num_local_experts", "intermediate_size"),
    # experts every other layer, the others a dense MLP; chunked attention, every 4th layer without RoPE
    "llama4_text": lambda s: {**_moe("num_local_experts", "intermediate_size")(s),
                              "intermediate_size_mlp": s["intermediate"], "interleave_moe_layer_step": 2},
    "modernbert": _none,
    "qwen2_vl_text": _mrope,
    "qwen2_5_vl_text": _mrope,
    "exaone4": _none,  # 3 sliding-window layers : 1 global
    "ernie4_5": _none,
    "hunyuan_v1_dense": _none,
    "phimoe": _moe("num_local_experts", "intermediate_size"),
    "arcee": _none,
    "apertus": _none,
    "seed_oss": _none,
}
#: Model types whose decoding step is not timed, and why.
NOT_TIMED = {"modernbert": "an encoder (bidirectional, no KV cache): it has no decoding step"}
#: Model types with no causal LM class of their own: their text model takes (3, B, S) M-RoPE
#: positions, which the whole model computes; built as this image-text-to-text model, fed text only.
WHOLE_MODEL = {"qwen2_vl_text": "qwen2_vl", "qwen2_5_vl_text": "qwen2_5_vl"}


def available() -> list[str]:
    """The :data:`FAMILIES` the installed transformers has, in order."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return [t for t in FAMILIES if t in CONFIG_MAPPING_NAMES]


def _config(model_type: str, sizes: Sizes) -> Any:
    """The family's config at ``sizes`` (its text config inside the whole model's, for :data:`WHOLE_MODEL`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fields = {"hidden_size": sizes["embed_dim"], "num_attention_heads": sizes["heads"],
              "num_key_value_heads": sizes["kv_heads"], "head_dim": sizes["head_dim"],
              "num_hidden_layers": sizes["layers"], "intermediate_size": sizes["intermediate"],
              "vocab_size": sizes["vocab"], "max_position_embeddings": max(4096, 2 * sizes["prompt"]),
              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **FAMILIES[model_type](sizes)}
    if model_type not in WHOLE_MODEL:
        return CONFIG_MAPPING[model_type](**fields)
    e = sizes["embed_dim"]  # a one-layer vision tower; only its merger's output width must be E
    vision = {"depth": 1, "embed_dim": 64, "num_heads": 4, "hidden_size": e, "out_hidden_size": e,
              "intermediate_size": 128}
    v = sizes["vocab"]  # image and video tokens at the vocabulary's end: the prompt draws below them
    whole: Any = CONFIG_MAPPING[WHOLE_MODEL[model_type]]  # a config class with a text and a vision config
    return whole(text_config=fields, vision_config=vision, image_token_id=v - 1, video_token_id=v - 2,
                 vision_start_token_id=v - 3)


def _models(model_type: str, sizes: Sizes) -> tuple[Any, Any]:
    """(unpatched, patched) models of the family with the same random weights."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from ..interop.hf_patch import patch

    auto = AutoModelForImageTextToText if model_type in WHOLE_MODEL else AutoModelForCausalLM
    torch.manual_seed(0)
    hf = auto.from_config(_config(model_type, sizes), attn_implementation="sdpa").eval()
    return hf, patch(copy.deepcopy(hf))


def run_hf_families(families: Sequence[str] | None = None, *, quick: bool = False, reps: int | None = None,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time each family's decoding step, HF against ours; return plain dicts (see the module docstring).

    Args:
        families: model types of :data:`FAMILIES` (default: :func:`available`).
        quick: :data:`QUICK` sizes instead of :data:`FULL`.
        reps: timed steps of each way per family (default 15; quick: 2).
        progress: called with a short line before each family.

    Returns:
        ``{"sizes", "threads", "reps", "families": {type: entry}, "mismatches", "failed"}``; an entry is
        ``{"status": "timed", "model_class", "shape", "paths", "same_logits", "max_abs_diff",
        "decode": {way: stats}, "paired_speedup", "greedy"}`` (stats as
        :func:`~multihead.tools.bench_hf.run_hf_generate`'s; ``greedy``: ``rows`` (the batch's real
        tokens) and :mod:`~multihead.tools.bench_generate`'s agreement, ``tokens_equal`` first),
        ``{"status": "not timed", "reason"}`` or ``{"status": "failed", "error"}``; ``mismatches``
        and ``failed`` list the types whose logits or greedy tokens differ from HF's and that raised.

    Raises:
        ValueError: a type not in :data:`FAMILIES`, or one the installed transformers lacks (before any work).
    """
    have = available()
    chosen = list(families) if families else have
    unknown = [t for t in chosen if t not in have]
    if unknown:
        raise ValueError(f"--families: unknown or not in this transformers: {unknown}; choose from {have}")
    say = progress or (lambda line: None)
    sizes = QUICK if quick else FULL
    reps = reps or (2 if quick else 15)
    out: dict[str, Any] = {}
    for model_type in chosen:
        if model_type in NOT_TIMED:
            out[model_type] = {"status": "not timed", "reason": NOT_TIMED[model_type]}
            continue
        say(f"{model_type}: decoding step after P={sizes['prompt']}, interleaved")
        try:
            out[model_type] = _time_family(model_type, sizes, reps)
        except Exception as e:  # noqa: BLE001 - one family's failure is reported, the sweep goes on
            out[model_type] = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                               "traceback": traceback.format_exc(limit=-3)}
    return {"sizes": dict(sizes), "threads": torch.get_num_threads(), "reps": reps, "families": out,
            "mismatches": [t for t, r in out.items()
                           if r["status"] == "timed" and not (r["same_logits"] and r["greedy"]["tokens_equal"])],
            "failed": [t for t, r in out.items() if r["status"] == "failed"]}


def _time_family(model_type: str, sizes: Sizes, reps: int) -> dict[str, Any]:
    """One family: its prompt written both ways, the logits compared, the step timed."""
    from transformers import DynamicCache

    from ..interop import hf_cache

    hf, patched = _models(model_type, sizes)
    p = sizes["prompt"]
    # token ids below the last 3 (image and video tokens of the WHOLE_MODEL ones)
    ids = torch.randint(3, sizes["vocab"] - 3, (1, p), generator=torch.Generator().manual_seed(1))
    step_ids = ids[:, -1:]
    models = dict(zip(TIMED_WAYS, (hf, patched)))
    caches = {TIMED_WAYS[0]: DynamicCache(config=hf.config),
              TIMED_WAYS[1]: hf_cache.KVCacheAdapter(patched, max_len=p + 1)}
    with torch.no_grad():
        prompt = {w: models[w](input_ids=ids, cache=caches[w], use_cache=True, logits_to_keep=1).logits
                  for w in TIMED_WAYS}
        step = {w: models[w](input_ids=step_ids, cache=caches[w], use_cache=True).logits for w in TIMED_WAYS}
        fns: dict[str, Fn] = {w: functools.partial(models[w], input_ids=step_ids, cache=caches[w], use_cache=True)
                              for w in TIMED_WAYS}
        resets: dict[str, Fn] = {w: functools.partial(_roll_back, caches[w], p) for w in TIMED_WAYS}
        stats = time_interleaved(fns, reps=reps, warmup=1, resets=resets)
    hf_way, ours = TIMED_WAYS
    diff = max(float((prompt[ours] - prompt[hf_way]).abs().max()), float((step[ours] - step[hf_way]).abs().max()))
    same = all(torch.allclose(got[ours], got[hf_way], rtol=RTOL, atol=ATOL) for got in (prompt, step))
    text = hf.config.get_text_config(decoder=True)
    attn = next(m for n, m in hf.named_modules() if n.endswith("self_attn"))
    shape = {"layers": text.num_hidden_layers, "heads": text.num_attention_heads,
             "kv_heads": getattr(text, "num_key_value_heads", text.num_attention_heads),
             "head_dim": getattr(attn, "head_dim", None)}
    return {"status": "timed", "model_class": type(hf).__name__, "shape": shape, "paths": caches[ours].paths,
            "same_logits": same, "max_abs_diff": diff, "decode": _rated(stats, 1),
            "paired_speedup": paired_speedup(stats[ours], stats[hf_way]), "greedy": _greedy(hf, patched, sizes)}


def _greedy(hf: Any, patched: Any, sizes: Sizes) -> dict[str, Any]:
    """Greedy ``generate`` of ``new_tokens`` on a left-padded batch of 2: the patched model with a
    KVCacheAdapter against HF's default (DynamicCache); the rows' real tokens and the agreement."""
    from ..interop import hf_cache
    from .bench_generate import _agreement, make_prompts

    p, n = sizes["prompt"], sizes["new_tokens"]
    ids, mask = make_prompts(sizes["vocab"] - 3, p, 2)  # (2, P): below the WHOLE_MODEL's image and video tokens
    greedy = {"attention_mask": mask, "max_new_tokens": n, "min_new_tokens": n, "do_sample": False, "num_beams": 1,
              "pad_token_id": 0}
    with torch.no_grad():
        want = hf.generate(input_ids=ids, **greedy)
        got = patched.generate(input_ids=ids, cache=hf_cache.KVCacheAdapter(patched, max_len=p + n), **greedy)
    return {"rows": mask.sum(dim=1).tolist(), **_agreement(got, want)}


def format_hf_families(result: dict[str, Any]) -> str:
    """One row per family: medians, HF / ours (paired), logits, the adapter's paths; then the others."""
    s = result["sizes"]
    hf_way, ours = TIMED_WAYS
    lines = [f"decoding step after a {s['prompt']}-token prompt, batch 1, float32, {result['threads']} threads, "
             f"{result['reps']} steps each way; greedy: {s['new_tokens']} tokens of a left-padded batch of 2",
             f"random weights: L={s['layers']} E={s['embed_dim']} H={s['heads']} Hkv={s['kv_heads']} D={s['head_dim']} "
             f"vocab={s['vocab']} MLP={s['intermediate']}, experts {s['experts']} top-{s['top_k']} "
             f"MLP={s['expert_intermediate']}",
             f"HF: {hf_way} (DynamicCache); ours: {ours}; HF/ours > 1: ours is faster", ""]
    bad = [*(f"MISMATCH {t}: {_mismatch(result['families'][t])}" for t in result["mismatches"]),
           *(f"FAILED {t}: {result['families'][t]['error']}" for t in result["failed"])]
    if bad:
        lines += ["MISMATCHES / FAILURES:", *(f"  {line}" for line in bad), ""]
    lines.append(f"  {'model type':<18}{'HF ms':>9}{'ours ms':>9}{'HF/ours':>9}  {'logits':<8}{'greedy':<8}"
                 "adapter's path per layer")
    others = []
    for t, r in result["families"].items():
        if r["status"] != "timed":
            others.append(f"  {t}: {r['status']}: {r.get('reason', r.get('error'))}")
            continue
        dec = r["decode"]
        paths = ", ".join(f"{n}x {p}" for p, n in _counted(r["paths"]))
        lines.append(f"  {t:<18}{dec[hf_way]['median_s'] * 1e3:>9.2f}{dec[ours]['median_s'] * 1e3:>9.2f}"
                     f"{r['paired_speedup']:>9.3f}  {'equal' if r['same_logits'] else 'DIFFER':<8}"
                     f"{'equal' if r['greedy']['tokens_equal'] else 'DIFFER':<8}{paths}")
    whole = [t for t in result["families"] if t in WHOLE_MODEL and result["families"][t]["status"] == "timed"]
    if whole:
        others.append(f"  {', '.join(whole)}: built as the whole image-text-to-text model (its text model takes "
                      "(3, B, S) M-RoPE positions, which the whole model computes), fed text only")
    return "\n".join(lines + ([""] + others if others else []))


def _mismatch(entry: dict[str, Any]) -> str:
    """What differs from HF's in a timed family: the logits, the greedy tokens, or both."""
    said = [] if entry["same_logits"] else [f"logits differ from HF's (max |diff| {entry['max_abs_diff']:.2e})"]
    g = entry["greedy"]
    if not g["tokens_equal"]:
        said.append(f"greedy tokens of the left-padded batch (rows {g['rows']}) differ from HF's: "
                    f"{g['differing_tokens']} tokens, the first at (row, column) {g['first_difference']}")
    return "; ".join(said)


def _counted(paths: list[str | None]) -> list[tuple[str, int]]:
    """Each distinct path with its number of layers, in first-seen order."""
    counts: dict[str, int] = {}
    for p in map(str, paths):
        counts[p] = counts.get(p, 0) + 1
    return list(counts.items())
