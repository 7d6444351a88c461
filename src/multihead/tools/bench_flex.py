"""Programmable attention against compiled FlexAttention and SDPA on the CPU, same inputs, one run.

Notation: B batch (1), H heads, S tokens (Sq = Sk), D head dim.

Each case is one mask_mod and/or score_mod, written once in FlexAttention's signature and given
to each implementation in its own way:

* **multihead**: :func:`multihead.attention` with the block mask multihead builds from the
  mask_mod (:meth:`multihead.BlockMask.from_mask_mod`, once per case, as users would) and the
  score_mod as :mod:`multihead.score_mods`' building block; ``"auto"`` picks the path.
* **FlexAttention**: ``torch.compile(flex_attention, dynamic=False)``, compiled afresh for each
  case (``torch._dynamo.reset()`` first), with its own ``create_block_mask`` of the same mask_mod
  (built once) and the score_mod as a Python function; its compilation is timed apart
  (``flex_compile_s``) and never inside the rounds.
* **SDPA**: ``F.scaled_dot_product_attention`` with the equivalent dense mask (bool, or float with
  the bias added: what a user without either would write).

Every output is checked against the float64 reference on the dense mask and score
(``max_error``). Forward and forward + backward are timed; in forward + backward, T5's bias
table is learned (a leaf: multihead's building block and SDPA's gathered dense bias both give
its gradient). FlexAttention has no CPU backward in this torch, which the report says ("n/a")
after trying it once. Timing is
:func:`multihead.tools.bench.time_interleaved` (round-robin, medians, paired ratios).
Nothing here prints.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["FlexCase", "cases", "run_flex", "format_flex"]

Fn = Callable[[], object]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FlexCase:
    """One pattern: its mask_mod (None: every key), the score_mod for FlexAttention and the
    reference (None: none), and the score_mod object multihead takes (or a ``softcap=``)."""

    name: str
    seq: int
    mask_mod: MaskMod | None = None
    score_fn: ScoreFn | None = None
    ours: dict[str, Any] | None = None  # extra keywords of multihead.attention for the score


def _t5(heads: int, seq: int) -> tuple[ScoreFn, dict[str, Any]]:
    """T5's relative position bias (32 buckets, max distance 128, bidirectional): the same table
    through multihead's building block and through a FlexAttention score_mod."""
    from .. import score_mods

    table = torch.randn(heads, 32) * 0.5  # (H, NB)
    buckets = score_mods.t5_buckets(32, 128, bidirectional=True)
    rel = buckets(torch.arange(seq)[:, None], torch.arange(seq)[None, :])  # (S, S) bucket ids

    def score_fn(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor) -> torch.Tensor:
        return score + table[h, rel[q, k]]

    return score_fn, {"score_mod": score_mods.relative_bias(table, buckets)}


def cases(quick: bool = False, heads: int = 8) -> list[FlexCase]:
    """The suite's patterns: causal, sliding window 256, four documents, prefix-LM, a random
    pattern with 90% of its 128 × 128 tiles empty (the diagonal and random others), the same with
    every tile full (what the sparse one is to cost a tenth of), T5's bias, soft-capping 30
    (quick: S = 256)."""
    s = 256 if quick else 2048
    docs = torch.arange(s) * 4 // s  # (S,) four documents of S/4 tokens
    n = -(-s // 128)
    live = torch.eye(n, dtype=torch.bool)  # (nQ, nK): every query sees a key, then random tiles up to 10%
    off = (~live).flatten().nonzero().flatten()
    extra = max(0, round(0.1 * n * n) - n)
    live.view(-1)[off[torch.randperm(len(off), generator=torch.Generator().manual_seed(0))[:extra]]] = True
    prefix = s // 4

    def causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q >= k

    def window(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q >= k) & (q - k < 256)

    def document(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return docs[q] == docs[k]

    def prefix_lm(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (k < prefix) | (q >= k)

    def sparse(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return live[q // 128, k // 128]

    def every(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q >= 0

    def cap(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return 30.0 * torch.tanh(score / 30.0)

    t5_fn, t5_ours = _t5(heads, s)
    out = [FlexCase("causal", s // 2, causal), FlexCase("causal", s, causal),
           FlexCase("sliding window 256", s, window), FlexCase("4 documents", s, document),
           FlexCase("prefix-LM", s, prefix_lm), FlexCase("90% empty tiles", s, sparse),
           FlexCase("every tile full", s, every),
           FlexCase("T5 bias", s, None, t5_fn, t5_ours), FlexCase("soft-capping 30", s, causal, cap, {"softcap": 30.0})]
    return out


def _dense_mask(case: FlexCase) -> torch.Tensor | None:
    from ..block_mask import evaluate_mask_mod

    if case.mask_mod is None:
        return None
    return evaluate_mask_mod(case.mask_mod, 1, 1, case.seq, case.seq)  # (1, 1, S, S)


def _reference(case: FlexCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
    """float64: softmax(score_mod(q·kᵀ/√D)) masked, times v."""
    qd, kd, vd = (t.double() for t in (q, k, v))
    s = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, S, S)
    if case.score_fn is not None:
        idx = torch.arange(case.seq)
        s = case.score_fn(s, torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(q.shape[1])[None, :, None, None],
                          idx[None, None, :, None], idx[None, None, None, :])
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    return torch.softmax(s, -1) @ vd


def _sdpa_mask(case: FlexCase, mask: torch.Tensor | None, heads: int) -> torch.Tensor | None:
    """What SDPA is given: the bool mask, or (with a score) the float bias with -inf where masked."""
    if case.name != "T5 bias":
        return mask
    assert case.score_fn is not None  # the T5 case has its score
    idx = torch.arange(case.seq)
    zero = torch.zeros(1, heads, case.seq, case.seq)
    bias = case.score_fn(zero, zero.new_zeros(1, 1, 1, 1).long(), torch.arange(heads)[None, :, None, None],
                         idx[None, None, :, None], idx[None, None, None, :])  # (1, H, S, S)
    return bias if mask is None else bias.masked_fill(~mask, -math.inf)


def _implementations(case: FlexCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     flex: Callable[..., torch.Tensor] | None,
                     learned: bool = False) -> tuple[dict[str, Fn], dict[str, Any]]:
    """name -> forward callable, and facts of the case (tiles, build times). ``learned``: a
    relative bias' table is a leaf that gets its gradient, in multihead's building block and in
    the dense bias SDPA is given (gathered from it on every call, as T5 gathers its position bias)."""
    import multihead as mh

    facts: dict[str, Any] = {}
    extra = dict(case.ours or {})
    if learned and isinstance(extra.get("score_mod"), mh.score_mods.RelativeBias):
        return _learned_relative(extra["score_mod"], q, k, v), facts
    mask = _dense_mask(case)
    if case.mask_mod is not None:
        t0 = time.perf_counter()
        block = mh.BlockMask.from_mask_mod(case.mask_mod, None, None, case.seq, case.seq)
        facts["block_mask_build_s"] = time.perf_counter() - t0
        facts["empty_tiles"] = block.sparsity()
        extra["block_mask"] = block
    if case.name == "soft-capping 30":  # ours: the built-in feature with the causal structure
        extra = {"softcap": 30.0, "causal": True}
    fns: dict[str, Fn] = {"multihead": lambda: mh.attention(q, k, v, **extra)}
    sdpa_mask = _sdpa_mask(case, mask, q.shape[1])
    if case.name != "soft-capping 30":  # SDPA has no soft-capping
        fns["SDPA, dense mask"] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask)
    if flex is not None:
        fns["FlexAttention (compiled)"], facts["flex_compile_s"] = _flex_fn(case, q, k, v, flex)
    return fns, facts


def _learned_relative(mod: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Fn]:
    """multihead and SDPA with a learned relative bias table (a leaf of its own, its gradient
    computed by both): multihead's building block, and SDPA's dense bias gathered from the table."""
    import multihead as mh

    table = mod.table.detach().clone().requires_grad_()
    ours = mh.score_mods.relative_bias(table, mod.buckets)
    s = q.shape[2]
    ids = mod.buckets(torch.arange(s)[:, None], torch.arange(s)[None, :])  # (S, S) bucket ids, made once
    return {"multihead": lambda: mh.attention(q, k, v, score_mod=ours),
            "SDPA, dense mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=table[:, ids][None])}


def _flex_fn(case: FlexCase, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             flex: Callable[..., torch.Tensor]) -> tuple[Fn, float]:
    """FlexAttention's call for the case, compiled by its first call (timed: compile + one run)."""
    from torch.nn.attention.flex_attention import create_block_mask

    block = None if case.mask_mod is None else create_block_mask(case.mask_mod, None, None, case.seq, case.seq,
                                                                  device="cpu")
    fn: Fn = lambda: flex(q, k, v, score_mod=case.score_fn, block_mask=block)  # noqa: E731
    t0 = time.perf_counter()
    fn()
    return fn, time.perf_counter() - t0


def _backward_of(fn: Fn, leaves: tuple[torch.Tensor, ...]) -> Fn:
    def step() -> None:
        out = fn()
        assert isinstance(out, torch.Tensor)
        out.sum().backward()
        for t in leaves:
            t.grad = None
    return step


def _flex_backward(case: FlexCase, leaves: tuple[torch.Tensor, ...],
                   flex: Callable[..., torch.Tensor]) -> tuple[Fn | None, str | None]:
    """(FlexAttention's forward, None) if its forward + backward runs here, else (None, why not:
    its error, one line)."""
    try:
        fn, _ = _flex_fn(case, leaves[0], leaves[1], leaves[2], flex)
        _backward_of(fn, leaves)()
    except Exception as error:  # noqa: BLE001  (any failure is the answer: reported, not raised)
        return None, f"n/a: {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    return fn, None


def run_flex(*, quick: bool = False, heads: int = 8, head_dim: int = 64, reps: int | None = None,
             only: tuple[str, ...] | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time every case (forward, then forward + backward): ``{"cases": [...], "flex_backward": ...}``
    (``only``: the cases of these names).

    Each case: name, S, facts (block mask build time, empty tiles, Flex compile time), and per
    implementation ``forward``/``train`` statistics (:func:`time_interleaved`'s) with its
    ``max_error`` against the float64 reference.
    """
    from torch.nn.attention.flex_attention import flex_attention

    from .bench import time_interleaved

    say = progress or (lambda line: None)
    out: list[dict[str, Any]] = []
    flex_backward: str | None = "not tried"
    for case in (c for c in cases(quick, heads) if only is None or c.name in only):
        say(f"flex {case.name} S={case.seq}")
        # A fresh static compilation per case, as a user with one shape gets: one compiled function
        # reused across cases recompiles for sizes as dynamic (and past its limit falls back to eager).
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=False)
        gen = torch.Generator().manual_seed(case.seq)
        q, k, v = (torch.randn(1, heads, case.seq, head_dim, generator=gen) for _ in range(3))
        with torch.no_grad():
            fns, facts = _implementations(case, q, k, v, flex)
            truth = _reference(case, q, k, v, _dense_mask(case))
            errors = {name: (fn().double() - truth).abs().max().item() for name, fn in fns.items()}  # type: ignore[attr-defined]
            forward = time_interleaved(fns, reps=reps or (2 if quick else 7), warmup=1)
        leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
        train_fns, _ = _implementations(case, leaves[0], leaves[1], leaves[2], None, learned=True)
        if flex_backward in ("not tried", None):
            flex_fn, flex_backward = _flex_backward(case, leaves, flex)
            if flex_fn is not None:
                train_fns["FlexAttention (compiled)"] = flex_fn
        train = time_interleaved({n: _backward_of(f, leaves) for n, f in train_fns.items()},
                                 reps=reps or (2 if quick else 5), warmup=1)
        out.append({"case": case.name, "seq": case.seq, **facts,
                    "impls": {name: {"max_error": errors.get(name), "forward": forward.get(name),
                                     "train": train.get(name)} for name in fns}})
    sparse = _sparse_over_full(quick, heads, head_dim, reps) if only is None else None
    from .machine import machine_info

    machine = machine_info()
    features = ", ".join(machine["vector_features"])
    cpu = f"{machine['cpu']} ({features}), {machine['cores']} cores, torch {machine['torch']}"
    return {"cpu": cpu, "machine": machine, "heads": heads, "head_dim": head_dim, "threads": torch.get_num_threads(),
            "cases": out, "flex_backward": flex_backward or "runs", "learned_table": True,
            "sparse_over_full": sparse}


def _sparse_over_full(quick: bool, heads: int, head_dim: int, reps: int | None) -> dict[str, Any] | None:
    """multihead's forward of the 90%-empty pattern against every tile full, timed round-robin in
    the same rounds (the cases' own timings are minutes apart): ``{"ratio": median paired ratio,
    "sparse": stats, "full": stats}``; None where the cases lack either."""
    import multihead as mh

    from .bench import time_interleaved

    by_name = {c.name: c for c in cases(quick, heads)}
    if "90% empty tiles" not in by_name or "every tile full" not in by_name:
        return None
    sparse, full = by_name["90% empty tiles"], by_name["every tile full"]
    gen = torch.Generator().manual_seed(sparse.seq)
    q, k, v = (torch.randn(1, heads, sparse.seq, head_dim, generator=gen) for _ in range(3))
    def call(case: FlexCase) -> Fn:
        assert case.mask_mod is not None  # both patterns are mask_mods
        block = mh.BlockMask.from_mask_mod(case.mask_mod, None, None, case.seq, case.seq)
        return lambda: mh.attention(q, k, v, block_mask=block)

    with torch.no_grad():
        stats = time_interleaved({c.name: call(c) for c in (sparse, full)}, reps=reps or (3 if quick else 11), warmup=1)
    a, b = stats[sparse.name], stats[full.name]
    ratios = sorted(x / y for x, y in zip(a["times_s"], b["times_s"]))
    return {"ratio": ratios[len(ratios) // 2], "sparse": a, "full": b}


def _ms(stats: dict[str, Any] | None) -> str:
    return "—" if stats is None else f"{stats['median_s'] * 1e3:.1f}"


def _ratio(ours: dict[str, Any] | None, peer: dict[str, Any] | None) -> str:
    """The peer's time over ours, paired per round (how many times faster we are)."""
    if ours is None or peer is None:
        return "—"
    ratios = sorted(p / o for o, p in zip(ours["times_s"], peer["times_s"]))
    return f"{ratios[len(ratios) // 2]:.2f}×"


def format_flex(result: dict[str, Any]) -> str:
    """The table: per case, forward ms of each implementation and our speed-up over each, then
    forward + backward against SDPA (and FlexAttention where it has a backward)."""
    flex, sdpa = "FlexAttention (compiled)", "SDPA, dense mask"
    lines = [f"B=1, H={result['heads']}, D={result['head_dim']}, float32, {result['threads']} threads; "
             f"times in ms (medians), speed-ups paired per round",
             "| case | S | empty tiles | multihead | FlexAttention | SDPA | vs Flex | vs SDPA "
             "| train: multihead | train: SDPA | train vs SDPA |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in result["cases"]:
        impls = c["impls"]
        ours, fl, sd = (impls.get(n, {}) for n in ("multihead", flex, sdpa))
        empty = f"{100 * c['empty_tiles']:.0f}%" if "empty_tiles" in c else "—"
        lines.append(f"| {c['case']} | {c['seq']} | {empty} | {_ms(ours.get('forward'))} | {_ms(fl.get('forward'))} "
                     f"| {_ms(sd.get('forward'))} | {_ratio(ours.get('forward'), fl.get('forward'))} "
                     f"| {_ratio(ours.get('forward'), sd.get('forward'))} | {_ms(ours.get('train'))} "
                     f"| {_ms(sd.get('train'))} | {_ratio(ours.get('train'), sd.get('train'))} |")
    lines.append(f"FlexAttention forward + backward on the CPU: {result['flex_backward']}")
    if result.get("learned_table"):
        lines.append("train of T5 bias: its table learned (its gradient computed by both)")
    if result.get("sparse_over_full"):
        s = result["sparse_over_full"]
        lines.append(f"multihead, 90% empty tiles against every tile full, paired rounds: {s['ratio']:.2f}× the time "
                     f"({_ms(s['sparse'])} ms / {_ms(s['full'])} ms)")
    worst = max(((i["max_error"] or 0.0) for c in result["cases"] for i in c["impls"].values()), default=0.0)
    lines.append(f"largest error against the float64 reference, any implementation: {worst:.1e}")
    return "\n".join(lines)
