"""The benchmark suite: multihead against its peers on identical inputs, in one process.

Notation: B batch (1 throughout), H query heads, Hkv key/value heads, S tokens,
D head dim, E embed dim, L cached tokens.

Machine limits are measured in the same run, so every figure can be read as a fraction
of what this machine does at that moment:

* ``sgemm_gflops``: ``torch.matmul`` of two n×n float32 matrices (the issue's "sgemm").
* ``gemm_peak_gflops``: the best float32 GEMM in this process, the larger of the above
  and oneDNN's (on AMD CPUs MKL runs AVX2 code; oneDNN's AVX-512 is about twice as fast).
* ``gemm_loop_gflops`` (per compute-bound case): the best GEMM kind of the run (oneDNN's
  or ``torch.matmul``, n = 2048) timed again in the case's own interleaved loop, and
  ``frac_gemm_loop`` per row: the median over rounds of the row's rate over that GEMM's
  in the same round. A VM's speed drifts by 10-30% between cases minutes apart, so the
  column "%best" of the report is this paired fraction, not a rate over the limit measured
  at the start (``frac_gemm_peak``, kept in the JSON).
* ``copy_gbps``: bytes read plus bytes written per second by a large tensor copy
  (STREAM's convention). The bandwidth-bound case (decoding) also times the copy in
  its own interleaved loop and is rated against that: this machine's bandwidth
  drifts between runs (45 and 80 GB/s both seen).

Cases (float32 unless named, torch threads as set by the caller):

=============  ==========================================  =========================
case           what                                        work counted
=============  ==========================================  =========================
core/full      attention core, no mask, H=12, D=64         4·H·S²·D FLOPs
core/causal    the same, causal                            4·H·D·S(S+1)/2 (unmasked)
layer/prefill  a layer, E=768, H=12, S=1024, ± causal      projections + core FLOPs
               (peers include the layer under torch.compile)
layer/decode   one token, E=2048, H=32, Hkv=8, RoPE, L     weights + K/V bytes read
core/bf16      the core in bfloat16, ± causal, S ≥ 1024   as core/* (peers: ours in
               (peers: ours in float32, SDPA in bfloat16;  float32, SDPA in bfloat16)
               with AMX, ours with AMX switched off)
layer/decode-bf16  layer/decode with bfloat16 weights and  weights + K/V bytes read
               cache (peers: ours in float32, HF in bf16)
core/train     the core's forward + backward, ± causal,    3.5 × forward FLOPs
               S = 1024, 2048 (peer: SDPA)                 (FlashAttention-2's count)
layer/train    forward + backward, E=768, H=12, S=1024,    3 × forward FLOPs
               ± causal
               (peers: torch MHA, the layer on backend="native" and "sdpa";
               its floor: the step's projection GEMMs     9 GEMMs of 2·S·E²
               alone, "(projection GEMMs only)", with the
               share of each step they take)
memory         the core at S=32768 in a fresh process      peak RSS increase
=============  ==========================================  =========================

The report names the CPU and its vector features, and rates each compute-bound row
against ``torch.matmul`` (%sgemm) and against the best GEMM of the run (%best).

Timing: one warm-up call each, then repetitions interleaved round-robin (alternating
the order) so machine noise hits every implementation alike; medians are reported, and
per peer the "paired" speedup, the median of the per-round ratios (steadier than the
ratio of medians when the machine drifts between rounds).
Nothing here prints: :func:`format_report` returns the table as a string.
"""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import bench_overhead as overhead
from .machine import OthersLoad, is_busy, load_note, machine_info, reset_peak_rss, rss

__all__ = ["time_interleaved", "machine_limits", "run_suite", "format_report", "write_json", "plot", "save_figure",
           "measure_memory", "memory_probe", "paired_speedup", "spread"]

Fn = Callable[[], object]
Result = dict[str, Any]
_COPY = "(copy)"  # the bandwidth probe timed among a case's implementations
_READ = "(read)"  # a plain read of the case's bytes, timed among them too
_GEMM_LOOP = "(gemm)"  # the best GEMM kind, timed among a compute-bound case's implementations
_GEMMS = overhead.GEMMS_ONLY  # layer/train's and layer/bundled's floor: the projections' GEMMs alone

#: Sequence lengths of the core cases (full run, --quick run).
CORE_SEQ = (512, 1024, 2048, 4096)
QUICK_CORE_SEQ = (64, 128)
#: Sequence lengths of the bfloat16 core cases (full run; --quick runs QUICK_CORE_SEQ).
BF16_CORE_SEQ = (1024, 2048, 4096)
#: Sequence lengths of the core's forward + backward (full run; --quick runs the last of QUICK_CORE_SEQ).
TRAIN_CORE_SEQ = (1024, 2048)


# -- timing and machine limits ---------------------------------------------------------
def time_interleaved(
    fns: Mapping[str, Fn],
    *,
    reps: int = 5,
    warmup: int = 1,
    resets: Mapping[str, Fn] | None = None,
    budget_s: float | None = None,
) -> dict[str, dict[str, Any]]:
    """Time several callables round-robin and return per-name statistics.

    Args:
        fns: name -> callable to time.
        reps: repetitions of each (at least; see ``budget_s``).
        warmup: untimed calls of each first.
        resets: name -> untimed callable run before every call of that name (e.g. to
            roll a KV cache back).
        budget_s: if given, raise ``reps`` (up to 50) so the whole takes about this long,
            estimated from the warm-up.

    Returns:
        name -> {"median_s", "min_s", "times_s"}.
    """
    resets = resets or {}
    noop: Fn = lambda: None  # noqa: E731
    warm: dict[str, float] = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            resets.get(name, noop)()
            t0 = time.perf_counter()
            fn()
            warm[name] = time.perf_counter() - t0
    if budget_s is not None and warm:
        reps = max(reps, min(50, int(budget_s / max(sum(warm.values()), 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for r in range(reps):
        for name in order if r % 2 == 0 else order[::-1]:  # alternate: no fixed position
            resets.get(name, noop)()
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {n: {"median_s": statistics.median(t), "min_s": min(t), "times_s": t} for n, t in times.items()}


def machine_limits(*, quick: bool = False) -> dict[str, Any]:
    """Compute and bandwidth limits of this machine, measured now (see module docstring)."""
    from ..backends.gemm import onednn_usable, onednn_mm_nt

    n = 512 if quick else 4096
    a, b = torch.randn(n, n), torch.randn(n, n)
    bt = b.t().contiguous()
    fns: dict[str, Fn] = {"sgemm": lambda: torch.matmul(a, b)}
    if onednn_usable():
        fns["onednn"] = lambda: onednn_mm_nt(a, bt)
    t = time_interleaved(fns, reps=3 if quick else 7)
    flops = 2.0 * n ** 3
    sgemm = flops / t["sgemm"]["median_s"] / 1e9
    onednn = flops / t["onednn"]["median_s"] / 1e9 if "onednn" in t else None
    numel = (1 << 22) if quick else (1 << 26)  # 16 MiB / 256 MiB: the full size is far beyond L3
    src, dst = torch.randn(numel), torch.empty(numel)
    tc = time_interleaved({"copy": lambda: dst.copy_(src)}, reps=3 if quick else 7)["copy"]["median_s"]
    return {
        "sgemm_gflops": sgemm,
        "onednn_gflops": onednn,
        "gemm_peak_gflops": max(sgemm, onednn or 0.0),
        "copy_gbps": 2.0 * src.nbytes / tc / 1e9,
        "gemm_n": n,
        "copy_bytes": src.nbytes,
    }


# -- cases -----------------------------------------------------------------------------
def _core_case(s: int, causal: bool, h: int = 12, d: int = 64) -> tuple[dict[str, Any], dict[str, Fn]]:
    from ..functional import attention

    q, k, v = (torch.randn(1, h, s, d) for _ in range(3))
    flops = 4.0 * h * d * (s * (s + 1) / 2 if causal else s * s)
    fns: dict[str, Fn] = {
        "multihead": lambda: attention(q, k, v, causal=causal),
        "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    _add_native_row(fns, q, k, v, causal)
    return {"case": f"core/{'causal' if causal else 'full'}", "seq": s, "heads": h, "head_dim": d,
            "flops": flops, "limit": "compute"}, fns


def _core_bf16_case(s: int, causal: bool, h: int = 12, d: int = 64) -> tuple[dict[str, Any], dict[str, Fn]]:
    """The core on bfloat16 q, k, v (out bfloat16): ours, ours on the float32 values, SDPA in bfloat16."""
    from ..functional import attention

    q, k, v = (torch.randn(1, h, s, d).bfloat16() for _ in range(3))
    q32, k32, v32 = q.float(), k.float(), v.float()
    fns: dict[str, Fn] = {
        "multihead": lambda: attention(q, k, v, causal=causal),
        "multihead float32": lambda: attention(q32, k32, v32, causal=causal),
        "torch sdpa bf16": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    _add_native_row(fns, q, k, v, causal)
    _add_vector_row(fns, q, k, v, causal)
    flops = 4.0 * h * d * (s * (s + 1) / 2 if causal else s * s)
    return {"case": "core/bf16", "seq": s, "causal": causal, "heads": h, "head_dim": d, "flops": flops,
            "limit": "compute"}, fns


def _add_native_row(fns: dict[str, Fn], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Where "auto" does not take the native loop for these tensors but it runs here (an Intel CPU
    with AVX-512: SDPA), the loop itself as a peer row, so that its rate is still measured."""
    from ..backends import native
    from ..functional import attention
    from ..backends.auto import auto_path

    if native.available() and auto_path(q, k, v) != "native" and q.dtype in native.DTYPES:
        fns["multihead backend=native"] = lambda: attention(q, k, v, causal=causal, backend="native")


def _add_vector_row(fns: dict[str, Fn], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Where the bfloat16 loop runs on AMX tiles here, the same loop on vectors (AMX switched off,
    as on a CPU without it) as a peer row."""
    from ..backends import native
    from ..functional import attention

    def vectors() -> torch.Tensor:
        with native.amx_enabled(False):
            return attention(q, k, v, causal=causal, backend="native")

    if native.available() and native.amx():
        fns["multihead backend=native, AMX off"] = vectors


def _layer_flops(e: int, h: int, hkv: int, d: int, s: int, sk: int, causal: bool) -> float:
    proj = 2.0 * s * e * (h * d + 2 * hkv * d) + 2.0 * s * h * d * e
    pairs = s * (s + 1) / 2 if causal and s == sk else s * sk
    return proj + 4.0 * h * d * pairs


def _hf_config(kind: str, impl: str, e: int, h: int, hkv: int | None = None) -> Any:
    import transformers as tf

    cfg: tf.PretrainedConfig
    if kind == "bert":
        cfg = tf.BertConfig(hidden_size=e, num_attention_heads=h, attention_probs_dropout_prob=0.0,
                            hidden_dropout_prob=0.0)
    elif kind == "gpt2":
        cfg = tf.GPT2Config(n_embd=e, n_head=h, attn_pdrop=0.0, resid_pdrop=0.0, n_positions=8192)
    else:
        cfg = tf.LlamaConfig(hidden_size=e, num_attention_heads=h, num_key_value_heads=hkv or h,
                             head_dim=e // h, max_position_embeddings=8192, attention_bias=False)
    cfg._attn_implementation = impl
    return cfg


def _hf_prefill_peers(x: torch.Tensor, causal: bool, e: int, h: int) -> dict[str, Fn]:
    """Hugging Face attention modules on ``x``: BERT when not causal, GPT-2 and Llama when causal."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {}
    from transformers.models.bert.modeling_bert import BertAttention
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    s = x.shape[1]
    # Eager attention needs the causal mask spelled out (HF's own min-value additive form).
    additive = torch.full((s, s), torch.finfo(x.dtype).min).triu(1)[None, None] if causal else None
    fns: dict[str, Fn] = {}
    for impl in ("sdpa", "eager"):
        mask = None if impl == "sdpa" else additive
        if not causal:
            bert = BertAttention(_hf_config("bert", impl, e, h)).eval()
            fns[f"HF BERT {impl}"] = functools.partial(bert, x)
            continue
        gpt2 = GPT2Attention(_hf_config("gpt2", impl, e, h), layer_idx=0).eval()
        fns[f"HF GPT-2 {impl}"] = functools.partial(gpt2, x, attention_mask=mask)
        cfg = _hf_config("llama", impl, e, h)
        llama = LlamaAttention(cfg, layer_idx=0).eval()
        pos = LlamaRotaryEmbedding(cfg)(x, torch.arange(s)[None])
        fns[f"HF Llama {impl}"] = functools.partial(llama, x, position_embeddings=pos, attention_mask=mask)
    return fns


def _prefill_case(causal: bool, e: int = 768, h: int = 12, s: int = 1024) -> tuple[dict[str, Any], dict[str, Fn]]:
    from ..module import MultiHeadAttention

    x = torch.randn(1, s, e)
    ours = MultiHeadAttention(e, h, causal=causal).eval()
    mha = torch.nn.MultiheadAttention(e, h, batch_first=True).eval()
    tmask = torch.ones(s, s, dtype=torch.bool).triu(1) if causal else None  # torch: True = ignore
    fns: dict[str, Fn] = {
        "multihead": lambda: ours(x),
        # the fast path: eval, no grad, batch_first, self-attention, need_weights=False
        "torch MHA": lambda: mha(x, x, x, need_weights=False, attn_mask=tmask, is_causal=causal),
    }
    fns.update(_hf_prefill_peers(x, causal, e, h))
    fns["multihead torch.compile"] = functools.partial(torch.compile(ours), x)  # compiled on its warm-up call
    return {"case": "layer/prefill", "causal": causal, "embed_dim": e, "heads": h, "seq": s,
            "flops": _layer_flops(e, h, h, e // h, s, s, causal), "limit": "compute"}, fns


def _decoder(e: int, h: int, hkv: int, cached: int, dtype: torch.dtype) -> tuple[Fn, Fn, Any, Fn | None]:
    """Our layer in ``dtype`` with a cache of ``cached`` tokens: (step, reset, layer, kernel).

    ``kernel`` (None where the fused step does not run) is the step's native kernel alone,
    called as the layer calls it (its marshalled arguments) without the module around it:
    the layer's time minus the kernel's is the Python the layer runs per step."""
    from ..backends.native import StepPlan
    from ..module import MultiHeadAttention
    from ..rope import RoPE

    layer = MultiHeadAttention(e, h, num_kv_heads=hkv, causal=True, bias=False,
                               rope=RoPE(e // h, max_positions=2 * cached)).eval().to(dtype)
    cache = layer.new_cache(1, cached + 64)
    layer(torch.randn(1, cached, e, dtype=dtype), cache=cache)  # prefill
    x = torch.randn(1, 1, e, dtype=dtype)
    layer(x, cache=cache)  # one step: the fused one leaves its plan on the cache
    cache.crop(cached)
    plan, x2 = getattr(cache.fused, "plan", None), x.reshape(1, e)
    kernel = functools.partial(plan.run, x2) if isinstance(plan, StepPlan) else None  # writes slot L, as the step
    return (lambda: layer(x, cache=cache)), (lambda: cache.crop(cached)), layer, kernel


def _decode_case(quick: bool, dtype: torch.dtype = torch.float32) -> tuple[dict[str, Any], dict[str, Fn],
                                                                           dict[str, Fn]]:
    e, h, hkv, cached = (256, 8, 2, 128) if quick else (2048, 32, 8, 4096)
    d = e // h
    step, reset, ours, kernel = _decoder(e, h, hkv, cached, dtype)
    x = torch.randn(1, 1, e, dtype=dtype)
    fns: dict[str, Fn] = {"multihead": step}
    resets: dict[str, Fn] = {"multihead": reset}
    if kernel is not None:
        fns[_KERNEL_ALONE] = kernel
    if dtype != torch.float32:  # the yardstick: our own float32 step
        fns["multihead float32"], resets["multihead float32"], _, kernel32 = _decoder(e, h, hkv, cached,
                                                                                      torch.float32)
        if kernel32 is not None:
            fns[_KERNEL_ALONE + " float32"] = kernel32
    suffix = "" if dtype == torch.float32 else " " + _DTYPE_NAMES[dtype]
    try:
        import transformers as tf
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
        have_hf = True
    except ImportError:
        have_hf = False
    if have_hf:
        for impl in ("sdpa", "eager") if dtype == torch.float32 else ("sdpa",):
            cfg = _hf_config("llama", impl, e, h, hkv)
            layer = LlamaAttention(cfg, layer_idx=0).eval().to(dtype)
            pos = LlamaRotaryEmbedding(cfg)(x, torch.tensor([[cached]]))  # per model step, not per layer
            k0, v0 = torch.randn(1, hkv, cached, d, dtype=dtype), torch.randn(1, hkv, cached, d, dtype=dtype)
            # StaticCache sized to exactly L + 1 slots: every slot is valid, so no mask
            # is needed, the most favourable setting for it.
            for label, hf_cache in (("StaticCache", tf.StaticCache(config=cfg, max_cache_len=cached + 1)),
                                    ("DynamicCache", tf.DynamicCache(config=cfg))):
                hf_cache.update(k0, v0, 0)
                name = f"HF Llama {impl} {label}{suffix}"
                fns[name] = functools.partial(layer, x, position_embeddings=pos, cache=hf_cache)
                resets[name] = functools.partial(hf_cache.crop, -1)
                fns[name]()  # one step so that every later call starts from L tokens after crop
    weights = sum(p.numel() * p.element_size() for p in ours.parameters())
    kv_bytes = 2 * hkv * (cached + 1) * d * x.element_size()
    return ({"case": "layer/decode" + suffix.replace(" ", "-"), "embed_dim": e, "heads": h, "kv_heads": hkv,
             "cached": cached, "bytes": weights + kv_bytes, "weight_bytes": weights, "kv_bytes": kv_bytes,
             "limit": "bandwidth"},
            fns, resets)


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "fp16"}
#: The decoding rows of the fused step's native kernel alone (no module, no Python checks).
_KERNEL_ALONE = "multihead kernel alone"


def _train_case(causal: bool = False, e: int = 768, h: int = 12,
                s: int = 1024) -> tuple[dict[str, Any], dict[str, Fn], dict[str, Fn]]:
    from ..module import MultiHeadAttention

    x = torch.randn(1, s, e)
    grad = torch.randn(1, s, e)
    ours = MultiHeadAttention(e, h, causal=causal).train()
    native = MultiHeadAttention(e, h, causal=causal, backend="native").train()  # the FlashAttention-2 backward
    sdpa = MultiHeadAttention(e, h, causal=causal, backend="sdpa").train()
    mha = torch.nn.MultiheadAttention(e, h, batch_first=True).train()
    # torch MHA takes causality as a mask, with is_causal as the hint that lets it skip reading it
    mask = torch.nn.Transformer.generate_square_subsequent_mask(s) if causal else None
    gemms, gemms_reset, gemm_flops = _projection_gemms(ours, x, grad)
    fns: dict[str, Fn] = {
        "multihead": lambda: ours(x).backward(grad),
        "multihead backend=native": lambda: native(x).backward(grad),
        "multihead backend=sdpa": lambda: sdpa(x).backward(grad),
        "torch MHA": lambda: mha(x, x, x, attn_mask=mask, is_causal=causal, need_weights=False)[0].backward(grad),
        _GEMMS: gemms,
    }
    resets: dict[str, Fn] = {"multihead": lambda: ours.zero_grad(set_to_none=True),
                             "multihead backend=native": lambda: native.zero_grad(set_to_none=True),
                             "multihead backend=sdpa": lambda: sdpa.zero_grad(set_to_none=True),
                             "torch MHA": lambda: mha.zero_grad(set_to_none=True),
                             _GEMMS: gemms_reset}
    return {"case": "layer/train", "embed_dim": e, "heads": h, "seq": s, "causal": causal,
            "flops": 3.0 * _layer_flops(e, h, h, e // h, s, s, causal), "gemm_flops": gemm_flops,
            "limit": "compute"}, fns, resets


def _core_train_case(s: int, causal: bool, h: int = 12, d: int = 64) -> tuple[dict[str, Any], dict[str, Fn]]:
    """The core's forward + backward, ours ("auto") against SDPA's; each call returns the
    gradients of q, k and v (``torch.autograd.grad``: nothing accumulates between calls).

    FLOPs by FlashAttention-2's count: the backward's five products (the scores recomputed,
    dV, dP, dQ, dK) are 2.5 times the forward's two, so 3.5 times the forward in all.
    """
    from ..functional import attention

    q, k, v = (torch.randn(1, h, s, d, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, h, s, d)

    def step(fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(fn(q, k, v, causal), (q, k, v), grad)

    fns: dict[str, Fn] = {
        "multihead": functools.partial(step, lambda q, k, v, c: attention(q, k, v, causal=c)),
        "torch sdpa": functools.partial(step, lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)),
    }
    pairs = s * (s + 1) / 2 if causal else s * s
    return {"case": "core/train", "seq": s, "causal": causal, "heads": h, "head_dim": d,
            "flops": 3.5 * 4.0 * h * d * pairs, "limit": "compute"}, fns


def _projection_gemms(layer: Any, x: torch.Tensor, grad: torch.Tensor) -> tuple[Fn, Fn, float]:
    """The GEMMs of ``layer``'s training step and nothing else: (step, reset, FLOPs).

    The step calls the layer's own GEMM (:func:`multihead.linear.linear`, oneDNN where it
    runs) on its four projections' weights, at the step's shapes: q, k, v from x and the
    output projection from a (B, S, E) tensor standing for the heads; backward with the
    same gradient, so the weight and bias gradients of all four and the input gradient of
    the output projection (x needs none, as in the step): 9 GEMMs of 2·S·E² FLOPs (E = in =
    out). No attention kernel, however fast, can take a step below this time.
    """
    from ..linear import linear

    projs = [layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj]
    params = [(p.weight.detach().clone().requires_grad_(), p.bias.detach().clone().requires_grad_())
              for p in projs]
    heads = torch.randn_like(x, requires_grad=True)  # (B, S, E): the attention's output
    grads = [torch.randn_like(x) for _ in range(3)] + [grad]  # dq, dk, dv (any values), dy

    def step() -> None:
        outs = [linear(src, w, b) for src, (w, b) in zip((x, x, x, heads), params)]
        torch.autograd.backward(outs, grads)

    def reset() -> None:
        for t in [heads, *(t for pair in params for t in pair)]:
            t.grad = None

    one = [2.0 * x.shape[0] * x.shape[1] * w.numel() for w, _ in params]  # one GEMM of each projection
    return step, reset, 2 * sum(one) + one[3]  # forwards, weight gradients, o_proj's input gradient


def _gemm_floor(rows: list[Result], limits: dict[str, Any]) -> None:
    """A layer case's rows (layer/train, layer/bundled): the floor's row rated by its own FLOPs, and
    every row's ``gemm_fraction``, the floor's time over its own: the share of its step that is
    projection GEMM work."""
    floor = next(r for r in rows if r["impl"] == _GEMMS)
    floor["flops"] = floor["gemm_flops"]
    _add_rates(floor, limits)
    for row in rows:
        row["gemm_fraction"] = floor["median_s"] / row["median_s"]


# -- memory, in a fresh process --------------------------------------------------------
def memory_probe(impl: str, seq: int, heads: int, head_dim: int, causal: bool, path: str) -> None:
    """Run one attention call and write its peak RSS increase to ``path`` (JSON).

    Meant for a fresh process (see :func:`measure_memory`): Linux's high-water mark is
    reset after the inputs exist, so the peak counts only what the call allocates.
    """
    from ..functional import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, head_dim) for _ in range(3))
    fn: Fn = {"multihead": lambda: attention(q, k, v, causal=causal),
              "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}[impl]
    gc.collect()
    base = rss("VmRSS:")
    reset_peak_rss()
    t0 = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - t0
    assert isinstance(out, torch.Tensor)  # both impls return the output alone
    peak = rss("VmHWM:")
    io_bytes = 3 * q.nbytes + out.nbytes
    Path(path).write_text(json.dumps({"impl": impl, "peak_increase_bytes": peak - base, "io_bytes": io_bytes,
                                      "seconds": elapsed}))


def measure_memory(seq: int, *, causal: bool = False, heads: int = 12, head_dim: int = 64,
                   impls: tuple[str, ...] = ("multihead", "torch sdpa")) -> list[Result]:
    """Peak memory increase of the attention core, each implementation in its own process."""
    results = []
    for impl in impls:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "probe.json")
            code = ("import sys, multihead.tools.bench as b; "
                    f"b.memory_probe({impl!r}, {seq}, {heads}, {head_dim}, {causal}, sys.argv[1])")
            env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
            subprocess.run([sys.executable, "-c", code, path], check=True, env=env)
            probe = json.loads(Path(path).read_text())
        results.append({"case": "memory", "seq": seq, "heads": heads, "head_dim": head_dim, "causal": causal,
                        "impl": impl, "is_ours": impl == "multihead", **probe,
                        "ratio_to_io": probe["peak_increase_bytes"] / probe["io_bytes"]})
    return results


# -- the suite -------------------------------------------------------------------------
def run_suite(*, quick: bool = False, progress: Callable[[str], None] | None = None,
              memory_seq: int | None = None, parallel: bool = False) -> dict[str, Any]:
    """Run every case and return ``{"machine", "limits", "results"}`` (plain dicts).

    Args:
        quick: tiny sizes and few repetitions (seconds; for tests and smoke runs).
        progress: called with a short line before each case (the CLI prints it).
        memory_seq: S of the memory case; default 32768 (quick: 1024).
        parallel: also run :func:`multihead.parallel.bench.run` (ring attention's per-rank memory,
            time and bytes at P = 1, 2, 4; head parallelism at P = 1, 2) under ``"parallel"``.
    """
    say = progress or (lambda line: None)
    torch.manual_seed(0)
    say("machine limits")
    limits = machine_limits(quick=quick)
    budget = 0.2 if quick else 3.0
    results: list[Result] = []
    gemm, gemm_flops = _gemm_probe(limits, quick)

    def record(spec: dict[str, Any], fns: dict[str, Fn], resets: dict[str, Fn] | None = None) -> list[Result]:
        with OthersLoad() as load:
            stats = time_interleaved({**fns, _GEMM_LOOP: gemm}, reps=2 if quick else 5, warmup=1 if quick else 3,
                                     resets=resets, budget_s=budget)
        probe = stats.pop(_GEMM_LOOP)
        spec = {**spec, "gemm_loop_gflops": gemm_flops / probe["median_s"] / 1e9, "gemm_loop_flops": gemm_flops,
                "gemm_loop_times_s": probe["times_s"], "others_cpu_share": load.share}
        rows = [{**spec, "impl": impl, "is_ours": impl == "multihead", **st} for impl, st in stats.items()]
        for row in rows:
            _add_rates(row, limits)
        results.extend(rows)
        return rows

    with torch.no_grad():
        for causal in (False, True):
            for s in QUICK_CORE_SEQ if quick else CORE_SEQ:
                say(f"core {'causal' if causal else 'full'} S={s}")
                record(*_core_case(s, causal))
        for causal in (False, True):
            say(f"layer prefill causal={causal}")
            record(*(_prefill_case(causal, 64, 4, 128) if quick else _prefill_case(causal)))
        for causal in (False, True):
            for s in QUICK_CORE_SEQ if quick else BF16_CORE_SEQ:
                say(f"core bf16 {'causal' if causal else 'full'} S={s}")
                record(*_core_bf16_case(s, causal))
        for dtype in (torch.float32, torch.bfloat16):
            say(f"layer decode {_DTYPE_NAMES[dtype]}")
            results.extend(_bandwidth_rows(*_decode_case(quick, dtype), limits, quick, budget))
        with overhead.one_thread():  # the cost of a call, not of a parallel region
            for spec, fns in overhead.call_cases(quick):
                say(f"small calls {spec['shape']}, {spec['keys']} keys (1 thread)")
                record(spec, fns)
        bundled = overhead.bundled_layer_case(quick)
        if bundled is not None:
            say("layer at the bundled model's shapes")
            _gemm_floor(record(*bundled), limits)
    for causal in (False, True):
        for s in QUICK_CORE_SEQ[-1:] if quick else TRAIN_CORE_SEQ:
            say(f"core train (forward + backward) causal={causal} S={s}")
            record(*_core_train_case(s, causal))
    for causal in (False, True):
        say(f"layer train (forward + backward) causal={causal}")
        _gemm_floor(record(*(_train_case(causal, 64, 4, 128) if quick else _train_case(causal))), limits)
    say("memory")
    for row in measure_memory(memory_seq or (1024 if quick else 32768)):
        results.append(row)
    say("start-up (fresh processes)")
    suite = {"machine": machine_info(), "limits": limits, "quick": quick, "results": results,
             "startup": overhead.startup(quick)}
    if parallel:
        from ..parallel.bench import run as run_parallel

        sizes: dict[str, Any] = {"seqs": (1024,), "worlds": (1, 2)} if quick else {}
        suite["parallel"] = run_parallel(progress=say, **sizes)
    return suite


def _gemm_probe(limits: dict[str, Any], quick: bool) -> tuple[Fn, float]:
    """The run's best GEMM kind (oneDNN's where it beat ``torch.matmul`` at the start) as a probe
    timed inside each compute-bound case's loop: (callable, its FLOPs). n = 2048 (quick: 256):
    measured as fast as n = 4096 or faster on an AMD EPYC Zen 3 (oneDNN 120 against 110 GFLOP/s),
    so it did not flatter there, at an eighth of the time per round; elsewhere the JSON keeps
    both rates to compare (``gemm_loop_gflops`` per case, ``gemm_peak_gflops`` at the start)."""
    from ..backends.gemm import onednn_mm_nt

    n = 256 if quick else 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    onednn = (limits.get("onednn_gflops") or 0.0) >= limits["sgemm_gflops"]
    fn: Fn = functools.partial(onednn_mm_nt, a, b.t().contiguous()) if onednn else functools.partial(torch.matmul, a, b)
    return fn, 2.0 * n ** 3


def _bandwidth_rows(spec: dict[str, Any], fns: dict[str, Fn], resets: dict[str, Fn], limits: dict[str, Any],
                    quick: bool, budget: float) -> list[Result]:
    """Time a bandwidth-bound case (decoding) with its probes in the same loop: its rows.

    This machine's memory bandwidth drifts (a VM: 45 and 80 GB/s both seen, minutes
    apart), so the bandwidth limit of this case is a copy timed in the same interleaved
    loop as the implementations, not only the one at the start. A plain streaming read
    of as many bytes as the step reads (a sum) is timed too: the floor that no
    implementation reading those bytes from memory can beat.
    """
    numel = (1 << 22) if quick else (1 << 26)
    src, dst = torch.randn(numel), torch.empty(numel)
    probe = torch.randn(spec["bytes"] // 4)
    with OthersLoad() as load:
        stats = time_interleaved({**fns, _COPY: functools.partial(dst.copy_, src), _READ: probe.sum},
                                 reps=2 if quick else 5, warmup=1 if quick else 3, resets=resets, budget_s=budget)
    spec["others_cpu_share"] = load.share
    spec["copy_gbps"] = 2.0 * src.nbytes / stats.pop(_COPY)["median_s"] / 1e9
    spec["read_s"] = stats.pop(_READ)["median_s"]
    rows = []
    for impl, st in stats.items():
        row = {**spec, "impl": impl, "is_ours": impl == "multihead", **st}
        _add_rates(row, limits)
        rows.append(row)
    return rows


def _add_rates(row: Result, limits: dict[str, Any]) -> None:
    t = row["median_s"]
    if "flops" in row:
        row["gflops"] = row["flops"] / t / 1e9
        row["frac_sgemm"] = row["gflops"] / limits["sgemm_gflops"]
        row["frac_gemm_peak"] = row["gflops"] / limits["gemm_peak_gflops"]
        row["times_limit"] = t / (row["flops"] / (limits["sgemm_gflops"] * 1e9))  # 1.0 = at the sgemm limit
        if "gemm_loop_times_s" in row:  # the best GEMM timed in the same rounds: paired, per round
            row["frac_gemm_loop"] = row["flops"] / row["gemm_loop_flops"] * statistics.median(
                g / r for g, r in zip(row["gemm_loop_times_s"], row["times_s"]))
    if "bytes" in row:
        copy = row.get("copy_gbps", limits["copy_gbps"])  # measured alongside the case when it was
        row["gbps"] = row["bytes"] / t / 1e9
        row["frac_copy"] = row["gbps"] / copy
        row["times_limit"] = t / (row["bytes"] / (copy * 1e9))
        if "read_s" in row:
            row["times_read"] = t / row["read_s"]


def _label(row: Result) -> str:
    keys = ("shape", "keys", "batch", "seq", "causal", "embed_dim", "heads", "kv_heads", "cached", "path")
    return " ".join(f"{k}={row[k]}" for k in keys if k in row)


_GEMM_NAMES = {"onednn": "oneDNN", "torch": "torch.matmul"}  # gemm_choice()'s words in the report


def format_report(suite: dict[str, Any]) -> str:
    """The suite as text: limits, then one table per case (ours vs each peer)."""
    m, lim = suite["machine"], suite["limits"]
    onednn = f"{lim['onednn_gflops']:.0f}" if lim.get("onednn_gflops") else "n/a"
    lines = [
        f"CPU: {m['cpu']}; vector features: {', '.join(m.get('vector_features') or ['none listed'])}; "
        f"native kernels: the {m.get('native_build') or 'no'} build ({m.get('native_vector_bits', 0)}-bit vectors)",
        f"torch {m['torch']}, transformers {m['transformers']}, {m['cores']} cores, torch threads "
        f"{m['torch_threads']}, oneDNN {m['onednn']}, projections on "
        f"{_GEMM_NAMES.get(m.get('gemm', ''), 'oneDNN' if m['onednn'] else 'torch.matmul')}",
        f"limits: sgemm (torch.matmul) {lim['sgemm_gflops']:.0f} GFLOP/s, oneDNN GEMM {onednn} GFLOP/s, "
        f"copy {lim['copy_gbps']:.1f} GB/s (read + write)",
    ]
    shares = [r["others_cpu_share"] for r in suite["results"] if r.get("others_cpu_share") is not None]
    if shares:
        lines.append(f"load, in the busiest case's rounds: {load_note(max(shares))}")
    groups: dict[tuple[str, str], list[Result]] = {}
    for row in suite["results"]:
        groups.setdefault((row["case"], _label(row)), []).append(row)
    current = None
    for (case, label), rows in groups.items():
        ours = next((r for r in rows if r["is_ours"]), None)
        if ours is None:
            continue
        if case != current:
            current = case
            lines += ["", f"== {case} ==", _header(case)]
            if "gemm_loop_gflops" in ours:
                lines.append(f"(%best: each row's rate over the best GEMM's timed in the same loop, the median of "
                             f"the rounds; 'gemm GF/s': that GEMM's rate there, {lim['gemm_peak_gflops']:.0f} at "
                             "the start of the run)")
            if "bytes" in ours and "copy_gbps" in ours:
                lines.append(f"(bandwidth limit: a copy timed in the same loop, "
                             f"{ours['copy_gbps']:.1f} GB/s read + write;"
                             f" a plain read of the same {ours['bytes'] / 1e6:.0f} MB (sum) took "
                             f"{ours['read_s'] * 1e3:.2f} ms: ours {ours['times_read']:.2f}x that"
                             + "".join(f", {r['impl']} {r['times_read']:.2f}x" for r in rows
                                       if r["impl"].startswith(_KERNEL_ALONE)) + ")")
        for peer in (r for r in rows if not r["is_ours"] and r["impl"] != _GEMMS):
            lines.append(_row(case, label, ours, peer))
        if is_busy(ours.get("others_cpu_share")):
            lines.append(f"  ({label}: {load_note(ours['others_cpu_share'])})")
        floor = next((r for r in rows if r["impl"] == _GEMMS), None)
        if floor is not None:
            lines += _floor_lines(floor, rows)
    if "startup" in suite:
        lines += overhead.format_startup(suite["startup"])
    return "\n".join(lines)


def _floor_lines(floor: Result, rows: list[Result]) -> list[str]:
    """A layer case's floor: its time and GEMM rate, the share of each implementation's step it is,
    and what each step takes beyond it (the attention, forward and backward in training, and the
    glue around it)."""
    steps = [r for r in rows if r is not floor]
    shares = ", ".join(f"{r['impl']} {100 * r['gemm_fraction']:.0f}%" for r in steps)
    ours = next(r for r in steps if r["is_ours"])
    own = ours["median_s"] - floor["median_s"]
    rest = ", ".join(f"{r['impl']} {(r['median_s'] - floor['median_s']) * 1e3:.2f} ms"
                     + ("" if r is ours else f" ({(r['median_s'] - floor['median_s']) / own:.2f}x ours)")
                     for r in steps)
    train = floor["case"] == "layer/train"
    return [f"{_GEMMS} {floor['median_s'] * 1e3:.2f} ms ({100 * floor['frac_sgemm']:.0f}% of sgemm): the step's "
            f"{floor.get('gemm_count', 9)} projection GEMMs alone, a floor no attention kernel can go below;",
            f"  their share of each step: {shares}",
            f"  each step beyond them ({'attention forward + backward' if train else 'attention'} and the rest): "
            f"{rest}"]


def _header(case: str) -> str:
    if case == "memory":
        return f"{'shape':<44} {'peer':<28} {'ours MB':>9} {'peer MB':>9} {'ours/io':>8} {'peer/io':>8}"
    unit = "%copy" if case.startswith("layer/decode") else "%sgemm"
    best = "" if case.startswith("layer/decode") else f" {'ours %best':>10} {'peer %best':>10} {'gemm GF/s':>9}"
    return (f"{'shape':<44} {'peer':<28} {'ours ms':>9} {'peer ms':>9} {'speedup':>8} {'paired':>7} "
            f"{'ours ' + unit:>11} {'peer ' + unit:>11} {'ours xlim':>9}{best} {'ours ms (min-max)':>19} "
            f"{'peer ms (min-max)':>19}")


def _row(case: str, label: str, ours: Result, peer: Result) -> str:
    if case == "memory":
        return (f"{label:<44} {peer['impl']:<28} {ours['peak_increase_bytes'] / 2**20:>9.1f} "
                f"{peer['peak_increase_bytes'] / 2**20:>9.1f} {ours['ratio_to_io']:>8.2f} {peer['ratio_to_io']:>8.2f}")
    frac = "frac_copy" if case.startswith("layer/decode") else "frac_sgemm"
    key = "frac_gemm_loop" if "frac_gemm_loop" in ours else "frac_gemm_peak"  # vs the best GEMM of the run
    best = ("" if case.startswith("layer/decode") else f" {100 * ours[key]:>9.0f}% {100 * peer[key]:>9.0f}%"
            f" {ours.get('gemm_loop_gflops', math.nan):>9.0f}")
    return (f"{label:<44} {peer['impl']:<28} {ours['median_s'] * 1e3:>9.2f} {peer['median_s'] * 1e3:>9.2f} "
            f"{peer['median_s'] / ours['median_s']:>7.2f}x {paired_speedup(ours, peer):>6.2f}x "
            f"{100 * ours[frac]:>10.0f}% {100 * peer[frac]:>10.0f}% "
            f"{ours['times_limit']:>9.2f}" + best + f" {_min_max(ours):>19} {_min_max(peer):>19}")


def _min_max(row: Result) -> str:
    """A timed row's least and largest round, in ms."""
    times = row["times_s"]
    return f"{min(times) * 1e3:.2f}-{max(times) * 1e3:.2f}"


def paired_speedup(ours: Result, peer: Result) -> float:
    """The median over rounds of peer time / our time, each pair timed back to back in one round of
    :func:`time_interleaved`: the machine's drift between rounds (other jobs, a VM's bandwidth state)
    cancels, so it is steadier than the ratio of the two medians ("speedup")."""
    return statistics.median(p / o for p, o in zip(peer["times_s"], ours["times_s"]))


def spread(values: list[float]) -> dict[str, Any]:
    """``{"median", "min", "max", "values"}`` of repeated measurements (the benchmarks' JSON rows)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def write_json(suite: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write the suite's results as JSON (per-repetition times included)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(suite, indent=1))
    return out


def plot(suite: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """PNG: GFLOP/s of the attention core vs S, ours and peers, with the GEMM limits of the run's
    start and, per point, the best GEMM's rate in that case's own loop (the machine drifts)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    lim = suite["limits"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, case in zip(axes, ("core/full", "core/causal")):
        rows = [r for r in suite["results"] if r["case"] == case]
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = sorted((r["seq"], r["gflops"]) for r in rows if r["impl"] == impl)
            ax.plot(*zip(*pts), marker="o", label=impl, linewidth=2.5 if impl == "multihead" else 1.5)
        loop = sorted((r["seq"], r["gemm_loop_gflops"]) for r in rows if r["is_ours"] and "gemm_loop_gflops" in r)
        if loop:
            ax.plot(*zip(*loop), color="gray", marker="x", linestyle="none", label="best GEMM, same loop")
        ax.axhline(lim["sgemm_gflops"], color="k", linestyle="--", label="sgemm (torch.matmul), run's start")
        if lim.get("onednn_gflops"):
            ax.axhline(lim["onednn_gflops"], color="gray", linestyle=":", label="oneDNN GEMM, run's start")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S")
        ax.set_title(f"{case} (H=12, D=64, float32)" + (", unmasked FLOPs" if "causal" in case else ""))
        ax.grid(alpha=0.3)
    # one scale for both panels, set after plotting (sharey freezes the first panel's autoscale)
    tops = [r.get(key, 0.0) for r in suite["results"] if r["case"] in ("core/full", "core/causal")
            for key in ("gflops", "gemm_loop_gflops")]
    axes[0].set_ylim(0, 1.08 * max([*tops, lim["sgemm_gflops"], lim.get("onednn_gflops") or 0]))
    axes[0].set_ylabel("GFLOP/s")
    axes[0].legend(fontsize=8)
    m = suite["machine"]
    features = ", ".join(m.get("vector_features") or []) or "no AVX2/AVX-512"
    title = (f"multihead vs torch SDPA — {m.get('cpu', 'CPU')} ({features}), {m['cores']} cores, "
             f"{m['torch_threads']} threads, torch {m['torch']}")
    fig.suptitle(textwrap.fill(title, 110))  # wrapped: a long feature list ran off both edges
    return save_figure(fig, path)


def save_figure(fig: Any, path: str | os.PathLike[str]) -> Path:
    """A matplotlib figure laid out, written as a PNG at ``path`` (its folder made) and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
