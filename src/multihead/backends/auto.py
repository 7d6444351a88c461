"""Backend ``"auto"``: an ordered table of rules, first match wins.

Notation: B batch, H query heads, Hkv key/value heads, G = H // Hkv query heads per
K/V head, Sq queries, Sk keys, D head dim (Dv for values).

``"auto"`` is the only router in multihead: each rule of :data:`AUTO_RULES` names a
path, says why it is taken, and holds the test on the call's shapes and flags (never
on tensor data). :func:`auto_path` returns the path a call will take and
:data:`AUTO_PATHS` says why; the backend runs exactly that path. The thresholds are
the reasons' numbers, re-measured by the benchmark suite (``multihead bench``, cases
"core", "causal" and "decode").

A call's decision is remembered (:func:`decision`) under its :func:`signature`, everything of
the call the rules read, together with the machine facts the rules asked on the way
(:data:`FACTS`), which are checked again before it is reused: a remembered decision is the
one the rules give, and the second call of a shape costs a dictionary look-up.
:func:`auto_path` always asks the rules afresh.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import torch

from . import gemm, native
from .blocked import blocked_attention, decode_attention
from .eager import explicit_attention
from .._memo import remember
from ..block_mask import BlockMask
from ..score_mods import lower as lower_score_mod
from ..logits import NO_FEATURES, Features
from ..masks import segment_mask
from .registry import Backend, Prepared, needs_grad, register_backend
from .sdpa import sdpa_attention

__all__ = ["Call", "Rule", "AUTO_RULES", "AUTO_PATHS", "FACTS", "Decision", "auto_path", "decision", "fresh_decision",
           "signature", "clear_decisions", "auto_backend", "intel_avx512"]

#: Decoding: at most this many query rows per K/V head (Sq·G) take a decoding path.
DECODE_ROWS = native.DECODE_ROWS
#: The torch-only decoding path needs GQA sharing (G > 1) and this many keys: below,
#: or for MHA, SDPA's fixed costs are lower.
DECODE_MIN_KEYS = 256
#: "blocked" from this many queries and keys and this head dim: below, its GEMMs are
#: too small for oneDNN's fixed costs (at S=128 it takes 2-3× SDPA's time).
BLOCKED_MIN_SEQ = 512
BLOCKED_MIN_HEAD_DIM = 64
#: The native loops from this many scores (B·H·Sq·Sk), per vector width of their build
#: (:func:`native.vector_bits`; a width not listed never takes them: its tiles are not
#: measured). Below, their fixed cost (the call, an OpenMP region, buffers) exceeds SDPA's.
#: With the plain call prepared once per signature (:func:`multihead.backends.native.ops.prepare`),
#: ``mh.attention(backend="native")`` against ``backend="sdpa"``, each the whole call, no mask:
#: AVX2 (2-core AMD EPYC, Zen 3; 1 and 2 threads, best of 21 rounds): less time than SDPA's route
#: from 2^8 scores on, prefill and decoding alike, at 1 thread 0.61-0.99× (H=12, D=32, S=4..32:
#: 0.61×, 0.67×, 0.76×, 0.91×, 0.97×; D=64, S=8..32: 0.68×, 0.85×, 0.79×; H=4, D=64, S=16 and 32:
#: 0.79×, 0.92×; one query, 64 keys: 0.71×) and at 2 threads 0.35-0.63×; at larger S ahead with a
#: causal mask (S=512 1.5×/1.05× the speed, S=1024 1.2×/1.1×), near parity without one (S=1024
#: 0.87×/0.9×, S=2048..4096 0.9-1.1×), ahead of "blocked" everywhere.
#: AVX-512 (2-core Intel Xeon with AVX512-BF16 and AMX; wall-clock medians of 5 paired rounds,
#: SDPA's time / the native loop's, 1 / 2 threads): float32, H=12, D=64, S=32 0.97×/1.06×
#: (1.01×/1.10× causal), S=64 1.18×/1.17× (1.33×/1.34×), S=128 1.21×/1.42× (1.50×/1.91×), S=256
#: 1.18×/1.23× (1.66×/1.85×), S=512 1.17×/1.27× (1.91×/2.27×), S=1024 1.16×/1.19× (1.49×/1.54×);
#: GQA 32/8, D=128, S=128 1.11×/1.41× (1.48×/1.90×), S=512 1.11×/1.15× (1.90×/1.91×); float16,
#: S=8..256, 2 threads: 1.22-2.18×; the smallest calls (thread CPU time, 1 thread): H=12, D=32,
#: S=4, 8, 16: 0.60×, 0.55×, 0.84× SDPA's time; H=4, D=64, S=16: 0.83×; one query, 64 keys, 32
#: heads: 0.84×, GQA 32/8: 0.45×. (AMD's AVX-512, Zen 4, not measured: taken alike.)
#: Below 2^8 scores (one head of 8 × 8) SDPA's route stays: the kernel is never loaded for such
#: a problem.
NATIVE_MIN_SCORES: dict[int, int] = {512: 1 << 8, 256: 1 << 8}
NATIVE_MIN_DECODE_SCORES: dict[int, int] = {512: 1 << 8, 256: 1 << 8}
#: Intel CPUs with AVX-512 (:func:`intel_avx512`): there MKL runs its own AVX-512 code, and
#: "blocked" takes 1.1-1.8× SDPA's time (H=12, D=64, S=512..4096), so a forward without the
#: log-sum-exp never takes "blocked" there.
TORCH_PREFILL_VENDORS = ("GenuineIntel",)
#: bfloat16 on a CPU with AMX (native.amx_bf16), a forward: the native loop runs on the tiles too
#: (native.amx(): csrc/attention_amx.cpp) and takes it from AMX_MIN_SCORES; below, and where the
#: kernel cannot use them (native.amx() False: then SDPA's oneDNN products on AMX run at 2.8× our
#: vector loop's speed), SDPA. Measured (that Xeon, 2 cores, paired medians, SDPA's time / the
#: loop's): H=12, D=64: S=128 1.03× / 0.99× causal, S=256 0.98× / 1.11×, S=512 1.24× / 1.52×,
#: S=1024 1.31× / 1.58×, S=2048 1.43× / 1.57×; GQA 32/8, D=128: S=128 0.75×, S=256 0.90× / 1.11×,
#: S=512 1.01× / 1.40×, S=1024..2048 1.16-1.30× / 1.43-1.48×.
AMX_MIN_SCORES = 1 << 21

#: Gradients (no log-sum-exp asked for): the native forward and its backward from this many
#: scores, per vector width; a width not listed takes SDPA; bfloat16 where the CPU has AMX
#: takes SDPA (its products on AMX: SDPA 0.57-0.64× the native time, 1.04× causal at S=512).
#: AVX-512 (Intel Xeon, where MKL runs its own AVX-512 code, so SDPA is at its strongest; not
#: measured on AMD's AVX-512; H=12, D=64, 2 threads, paired medians of 7, SDPA's time / the
#: native's): without a mask S=256 0.87×, S=512 1.04×, 1024 1.09×, 2048 1.08×; causal S=256
#: 1.15×, 512 1.53×, 1024 1.49×, 2048 1.28×. AVX2 (2-core AMD EPYC, Zen 3, H=12 or GQA 32/8, D=64,
#: forward+backward vs SDPA's, interleaved medians, 1 / 2 threads): without a mask S=512
#: 1.05×/1.25×, S=1024 1.2×/1.3×, S=2048 1.2×; causal S=512 1.8×/1.5×, S=1024 1.6×/1.7×,
#: S=2048 1.4×; GQA 32/8 alike (S=512..2048: 1.1-1.3× without a mask, 1.4-1.8× causal);
#: S=4096 without a mask about even (0.95× at 2 threads, 1.0-1.1× at 1), causal 1.15-1.3×.
#: Below 2^20 scores SDPA's fixed cost catches up (1 thread: S=256, H=12 1.0×, H=4 0.9×
#: without a mask). Measured on a shared machine (load 2-11 on 2 cores; single runs vary
#: by 5-45%); a quiet spell at 2 threads gave S=512/1024/2048 1.15×/1.16×/1.12× without a
#: mask, 1.9×/1.5×/1.4× causal.
NATIVE_MIN_GRAD_SCORES: dict[int, int] = {512: 1 << 20, 256: 1 << 20}
#: Gradients with the log-sum-exp (ring attention's blocks): the native backward from this
#: many scores; 'explicit' materialises S×S (measured on a 2-core AMD EPYC, causal, H=12,
#: D=64, forward+backward: S=1024 native 271 ms vs explicit 1929 ms; S=256 112 vs 47 ms,
#: before the backward's register tiles). AVX2 with the tiled backward (Zen 3, 1 thread,
#: CPU-time medians, D=64, out and lse both differentiated): explicit/native 1.6×/1.9×
#: (no mask / causal) at 2^16 scores (S=128, H=4), 2.1×/2.5× at 2^17, 3×/4.7× at 2^19,
#: 3.3×/6.2× at 2^22; parity at 2^14 (S=64, H=4).
NATIVE_MIN_GRAD_LSE_SCORES: dict[int, int] = {512: 1 << 22, 256: 1 << 16}
#: float32 gradients on the CPU with a head dim above SDPA_GRAD_MAX_HEAD_DIM, where the native
#: kernel does not take them, go to 'explicit' up to EXPLICIT_GRAD_MAX_SCORES scores: torch's SDPA
#: backward computes Δ = rowsum(dO·O) from its output, not from the probabilities it recomputes,
#: and the mismatch reaches dq through Σ p·k. Measured against flash-attention's criterion (dq's
#: error vs float64 at most 3× the naive float32 one's, i.e. 'explicit'), 512×256, causal, GQA
#: 6/2, B = 4, 4 seeds: D = 32 and 64 at most 1.6×, D = 96 3.0×, 111 2.8× (3.2× with a window),
#: 112 2.8×, 113 3.0×, 120 2.2×, 128 2.4×, 256 1.8×. Up to 2^22 scores, 'explicit''s S×S tensors
#: (a few of 16 MiB) are affordable; above, SDPA's O(S) memory wins and its error stands.
SDPA_GRAD_MAX_HEAD_DIM = 64
EXPLICIT_GRAD_MAX_SCORES = 1 << 22


#: The machine facts the rules ask, each through :meth:`Call.ask`: name -> (the module holding the
#: function, its name there, whether its answer is fixed for the process as long as that name holds
#: the same function). A remembered decision is reused only where every fact it asked still gives
#: the same answer (:func:`decision`): the fixed ones (what ``/proc/cpuinfo`` says) are checked by
#: the function's identity (a test that patches one is seen), the others asked again: the build's
#: vector width (0 without a kernel), whether the bfloat16 loop is on AMX tiles (switched by
#: ``native.amx_enabled``), this machine's GEMM (``$MULTIHEAD_GEMM``, ``torch.backends.mkldnn``).
FACTS: dict[str, tuple[ModuleType, str, bool]] = {
    "vector_bits": (native, "vector_bits", False),
    "cpu_vendor": (native, "cpu_vendor", True),
    "amx_bf16": (native, "amx_bf16", True),
    "amx": (native, "amx", False),
    "onednn": (gemm, "onednn_available", False),
}

#: One fact as a decision asked it: (module, name, fixed, the function asked, its answer).
Asked = tuple[ModuleType, str, bool, Callable[[], object], object]


class Call:
    """What "auto" decides on: the tensors' shapes, dtype and device, and the flags; the facts
    the rules ask several times computed once (a plain slotted class: it is made per call).

    The rules read of the tensors their ``shape``, ``dtype``, ``device`` and ``requires_grad``
    only, and of the machine what :meth:`ask` answers: :func:`signature` holds all of it, so a
    decision remembered under a signature is the one the rules give (:func:`decision`)."""

    __slots__ = ("q", "k", "v", "dropout_p", "return_weights", "return_lse", "softcap", "alibi", "sinks",
                 "varlen", "learned_grad", "bias", "score_mod", "differentiable", "logits", "few_rows", "few_keys",
                 "scores", "asked", "symbolic")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                 return_weights: bool = False, return_lse: bool = False, softcap: bool = False,
                 alibi: bool = False, sinks: bool = False, varlen: bool = False, learned_grad: bool = False,
                 bias: bool = False, score_mod: bool = False) -> None:
        self.q, self.k, self.v = q, k, v
        self.dropout_p, self.return_weights, self.return_lse = dropout_p, return_weights, return_lse
        self.softcap, self.alibi, self.sinks = softcap, alibi, sinks  # the logit features asked for
        self.varlen = varlen  # packed sequences (cu_seqlens)
        self.learned_grad = learned_grad  # alibi_slopes, sinks or the bias require grad
        self.bias, self.score_mod = bias, score_mod  # an additive bias, a score_mod
        #: Gradients or dropout are needed, or the tensors are not on the CPU.
        self.differentiable = (dropout_p > 0 or learned_grad or needs_grad(q, k, v) or q.device.type != "cpu")
        #: A logit feature (soft-capping, ALiBi, sinks) is asked for.
        self.logits = softcap or alibi or sinks
        #: A size is symbolic (a graph traced for a range of sizes): no rule may compare one.
        self.symbolic = native.ops.symbolic(q, k, v)
        self.few_rows = False if self.symbolic else native.rows_per_kv_head(q, k) <= DECODE_ROWS
        #: float32 with few keys and rows per K/V head: the decoding loop's rows-in-lanes path (AVX-512).
        self.few_keys = not self.symbolic and q.dtype == torch.float32 and k.shape[2] <= native.LANE_KEYS and (
            native.rows_per_kv_head(q, k) <= native.LANE_ROWS)
        self.scores = 0 if self.symbolic else q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        #: The machine facts asked so far, in order, with their answers (:data:`FACTS`).
        self.asked: list[Asked] = []

    def ask(self, fact: str) -> Any:
        """The answer of the machine fact ``fact`` (a key of :data:`FACTS`), recorded in :attr:`asked`."""
        owner, name, fixed = FACTS[fact]
        fn = getattr(owner, name)
        answer = fn()
        self.asked.append((owner, name, fixed, fn, answer))
        return answer

    def native_fits(self, min_scores: dict[int, int]) -> bool:
        """The native kernel takes these tensors, is compiled here for a vector width with
        measured tiles (a key of ``min_scores``: AVX-512 or AVX2), and the problem has at
        least that width's number of scores."""
        if self.q.dtype not in native.DTYPES or self.v.shape[-1] % 16 or self.scores < min(min_scores.values()):
            return False  # decided without the kernel: a small problem never builds it
        least = min_scores.get(self.ask("vector_bits"))
        return least is not None and self.scores >= least


Runner = Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]


@dataclass(frozen=True)
class Rule:
    """One row of the table: ``path`` is taken when ``applies(call)``, for ``reason``; a block mask
    reaches ``run`` as structure (``features.block_mask``) where ``block_mask``, else as a dense mask."""

    path: str
    reason: str
    applies: Callable[[Call], bool]
    run: Runner
    block_mask: bool = False
    #: What ``run`` runs for a call signature without mask, feature, lse or gradient, made once
    #: (:attr:`multihead.backends.registry.BackendSpec.prepare`); None = no such function.
    prepare: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Prepared] | None = None


def _native(decode: bool | None) -> Runner:
    """The native kernels (the FlashAttention loop, the decoding loop, or either: ``decode`` True,
    False, None); a block mask goes to :func:`native.native_backend`, which gives the loop its tiles."""
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None, causal: bool,
            window: int | None, scale: float, return_lse: bool, features: Features, **_: object
            ) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        if features.block_mask is not None:
            return native.native_backend(q, k, v, mask=mask, causal=causal, window=window, scale=scale, dropout_p=0.0,
                                         return_weights=False, return_lse=return_lse, features=features)
        out, lse = native.run(q, k, v, scale=scale, causal=causal, window=window, mask=mask, decode=decode,
                              return_lse=return_lse, softcap=features.softcap, alibi_slopes=features.alibi_slopes,
                              sinks=features.sinks, cu_seqlens=features.cu_seqlens, bias=features.bias,
                              relative=features.relative)
        return out, None, lse
    return run


def _prepared(decode: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Prepared]:
    """:func:`_native`'s plain call for one signature, made once (:func:`native.ops.prepare`)."""
    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Prepared:
        return native.ops.prepare(q, k, v, decode)
    return prepare


def _torch_kernel(fn: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]) -> Runner:
    """A torch-only kernel (returns out, or (out, lse) when asked; no features: the rules send
    none to it) as a :data:`Runner`."""
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None, causal: bool,
            window: int | None, scale: float, return_lse: bool, **_: object
            ) -> tuple[torch.Tensor, None, torch.Tensor | None]:
        result = fn(q, k, v, scale=scale, causal=causal, window=window, mask=mask, return_lse=return_lse)
        if isinstance(result, tuple):  # return_lse
            return result[0], None, result[1]
        return result, None, None
    return run


def _backend(fn: Backend) -> Runner:
    """A registered backend as a :data:`Runner`: its own signature, the call passed whole."""
    return fn


def _any_size(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None, causal: bool,
              window: int | None, scale: float, dropout_p: float, return_weights: bool, return_lse: bool,
              features: Features = NO_FEATURES) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One path for every size of a traced range, chosen from dtype, device and flags only: the
    native operator where it takes the call (it picks its loop inside, from the real sizes), else
    SDPA, else 'explicit' (soft-capping, a score_mod, or the log-sum-exp, without the kernel); an
    additive bias takes SDPA or 'explicit', which take it at any size as one dense bias."""
    learned = features.learned()
    grads = needs_grad(q, k, v) or (bool(learned) and needs_grad(*learned))
    features_used = features is not NO_FEATURES and any(f is not None for f in features)
    scored = features.has_bias() or features.score_mod is not None  # SDPA and 'explicit' take any size
    if (q.device.type == "cpu" and q.dtype in native.DTYPES and dropout_p == 0 and not (grads and features_used)
            and not scored and native.vector_bits() > 0):
        fn: Runner = _native(decode=None)
    elif features.softcap is None and features.score_mod is None and not return_lse:
        fn = sdpa_attention
    else:
        fn = explicit_attention
    return fn(q, k, v, mask=mask, causal=causal, window=window, scale=scale, dropout_p=dropout_p,
              return_weights=return_weights, return_lse=return_lse, features=features)


def _widths(least: dict[int, int]) -> str:
    """A threshold per vector width, for the reasons: "2^14 (AVX-512), 2^20 (AVX2)"."""
    names = {512: "AVX-512", 256: "AVX2"}
    return ", ".join(f"2^{n.bit_length() - 1} ({names.get(bits, f'{bits}-bit')})" for bits, n in least.items())


def intel_avx512() -> bool:
    """Whether the native kernels are built for AVX-512 on a CPU of :data:`TORCH_PREFILL_VENDORS`
    (MKL's own AVX-512 code there, where "blocked" loses: the comment above it)."""
    return native.vector_bits() == 512 and native.cpu_vendor() in TORCH_PREFILL_VENDORS


def _intel_avx512(c: Call) -> bool:
    """:func:`intel_avx512`, its facts asked through the call (:meth:`Call.ask`)."""
    return c.ask("vector_bits") == 512 and c.ask("cpu_vendor") in TORCH_PREFILL_VENDORS


def _bf16_on_amx(c: Call) -> bool:
    """bfloat16 on a CPU with AMX tiles for it: SDPA's products run there (forward and gradients),
    and the native loop's too where it can use them (native.amx())."""
    return c.q.dtype == torch.bfloat16 and bool(c.ask("amx_bf16"))


def _native_prefill_fits(c: Call) -> bool:
    """The native FlashAttention loop for a forward: at the width's threshold; bfloat16 on a CPU
    with AMX from AMX_MIN_SCORES where the loop runs on the tiles, never where it cannot; with the
    log-sum-exp (SDPA returns none) at the width's threshold everywhere."""
    if not c.native_fits(NATIVE_MIN_SCORES):  # first: a small problem never builds the kernel
        return False
    if c.return_lse or not _bf16_on_amx(c):
        return True
    return c.scores >= AMX_MIN_SCORES and bool(c.ask("amx"))


def _native_lanes_fit(c: Call) -> bool:
    """A plain float32 forward with few keys and rows per K/V head (:attr:`Call.few_keys`), at the
    FlashAttention loop's threshold, with the AVX-512 build: the decoding loop's rows-in-lanes path
    (:data:`multihead.backends.native.attention.LANE_KEYS` says what was measured)."""
    return (c.few_keys and not (c.logits or c.varlen or c.bias or c.score_mod) and c.native_fits(NATIVE_MIN_SCORES)
            and c.ask("vector_bits") == 512)


def _blocked_fits(c: Call) -> bool:
    """float32, long enough and wide enough (asked first: a small problem never asks the machine
    for its GEMM), oneDNN's GEMM here, and not an Intel CPU with AVX-512 unless with the lse."""
    return (c.q.dtype == torch.float32 and min(c.q.shape[2], c.k.shape[2]) >= BLOCKED_MIN_SEQ
            and c.q.shape[3] >= BLOCKED_MIN_HEAD_DIM and bool(c.ask("onednn"))
            and (c.return_lse or not _intel_avx512(c)))


def _explicit_grad_fits(c: Call) -> bool:
    """float32 gradients on the CPU, no dropout, no log-sum-exp, a head dim above
    SDPA_GRAD_MAX_HEAD_DIM and at most EXPLICIT_GRAD_MAX_SCORES scores (SDPA's dq fails
    flash-attention's criterion there; see the constants)."""
    return (c.differentiable and c.dropout_p == 0 and c.q.device.type == "cpu" and c.q.dtype == torch.float32
            and not c.return_lse and c.q.shape[-1] > SDPA_GRAD_MAX_HEAD_DIM
            and c.scores <= EXPLICIT_GRAD_MAX_SCORES)


def _native_features_fit(c: Call) -> bool:
    """Logit features, an additive bias or packed sequences, forward only, where a native loop would run without
    them: the decoding threshold for few rows, the FlashAttention one otherwise."""
    least = NATIVE_MIN_DECODE_SCORES if c.few_rows else NATIVE_MIN_SCORES
    return ((c.logits or c.varlen or c.bias) and not c.score_mod and not c.differentiable
            and c.native_fits(least))


#: The rules, in order; the first whose test holds is the path.
AUTO_RULES: tuple[Rule, ...] = (
    Rule("explicit", "attention weights were asked for: only 'explicit' returns them",
         lambda c: c.return_weights, _backend(explicit_attention)),
    Rule("explicit (score_mod)", "a score_mod (score_mod=...): 'explicit' evaluates any Python callable on the "
         "whole score tensor, exactly and differentiably (no other path runs one)",
         lambda c: c.score_mod, _backend(explicit_attention)),
    Rule("any size", "symbolic sizes (torch.export with a Dim, torch.compile(dynamic=True)): one path valid over "
         "the whole range, chosen without comparing a size (which would become a guard): the native operator, "
         "which picks its loop inside from the real sizes; SDPA where the kernel does not take the call, "
         "'explicit' for soft-capping or the log-sum-exp there", lambda c: c.symbolic, _any_size),
    Rule("native (features)", f"soft-capping, ALiBi, sinks, an additive bias or packed sequences (cu_seqlens) "
         "without gradients, "
         f"where a native loop would run without them (from {_widths(NATIVE_MIN_SCORES)} scores, "
         f"{_widths(NATIVE_MIN_DECODE_SCORES)} for few rows): the native FlashAttention loop applies them, packed "
         "sequences as structure (no scores across sequences); the decoding loop takes none of them",
         _native_features_fit, _native(decode=False), block_mask=True),
    Rule("native (bias, gradients)", "an additive bias (bias=..., or a relative bias lowered from a score_mod) "
         "with gradients on the CPU, no dropout, no other logit feature or packing, from "
         f"{_widths(NATIVE_MIN_GRAD_SCORES)} scores: the native kernel adds it in its forward and its backward, "
         "which also gives the bias' gradient; bfloat16 not on a CPU with AMX",
         lambda c: (c.bias and c.differentiable and c.dropout_p == 0 and c.q.device.type == "cpu"
                    and not (c.logits or c.varlen) and c.native_fits(NATIVE_MIN_GRAD_SCORES)
                    and not _bf16_on_amx(c)), _native(decode=False), block_mask=True),
    Rule("sdpa (additive bias)", "an additive bias (bias=...) without soft-capping or the log-sum-exp, and not "
         f"float32 gradients at head dim > {SDPA_GRAD_MAX_HEAD_DIM} (see 'explicit (gradients, accuracy)'): SDPA "
         "with the bias merged into its float mask (-inf where masked), exact and differentiable (with gradients "
         "below the native thresholds, or with another logit feature or packing)",
         lambda c: (c.bias and not c.softcap and not c.return_lse and not _explicit_grad_fits(c)),
         _backend(sdpa_attention)),
    Rule("explicit (additive bias)", "an additive bias with soft-capping (SDPA cannot cap), the log-sum-exp "
         f"(SDPA returns none), or float32 gradients at head dim > {SDPA_GRAD_MAX_HEAD_DIM} (SDPA's dq fails "
         "flash-attention's criterion there): 'explicit'", lambda c: c.bias, _backend(explicit_attention)),
    Rule("explicit (softcap)", "logit soft-capping with gradients or below the native thresholds (or no native "
         "kernel): 'explicit' (SDPA cannot cap)", lambda c: c.softcap, _backend(explicit_attention)),
    Rule("sdpa (bias)", "ALiBi or sinks without the log-sum-exp, with gradients or below the native thresholds: "
         "SDPA with an exact additive float mask",
         lambda c: (c.alibi or c.sinks) and not c.return_lse, _backend(sdpa_attention)),
    Rule("explicit (bias, lse)", "ALiBi with the log-sum-exp, with gradients or below the native thresholds: "
         "'explicit'", lambda c: c.alibi or c.sinks, _backend(explicit_attention)),
    Rule("native (gradients)", f"gradients on the CPU, no dropout, from {_widths(NATIVE_MIN_GRAD_SCORES)} scores: "
         "the native kernel and its FlashAttention-2 backward (faster than SDPA's there); bfloat16 not on a CPU "
         "with AMX (SDPA's products run on it)",
         lambda c: (c.differentiable and c.dropout_p == 0 and c.q.device.type == "cpu" and not c.return_lse
                    and c.native_fits(NATIVE_MIN_GRAD_SCORES)
                    and not _bf16_on_amx(c)), _native(decode=False), block_mask=True),
    Rule("explicit (gradients, accuracy)", f"float32 gradients on the CPU without dropout, head dim > "
         f"{SDPA_GRAD_MAX_HEAD_DIM}, at most 2^{EXPLICIT_GRAD_MAX_SCORES.bit_length() - 1} scores, not native: "
         "SDPA's dq there reached 3.2× the naive float32 error (flash-attention's criterion: 3×; its Δ = "
         "rowsum(dO·O) does not match the probabilities it recomputes); 'explicit' is the naive computation",
         _explicit_grad_fits, _backend(explicit_attention)),
    Rule("sdpa (gradients)", "gradients or dropout are needed (or the tensors are not on the CPU): "
         "SDPA is differentiable", lambda c: c.differentiable and not c.return_lse, _backend(sdpa_attention)),
    Rule("native (gradients, lse)", f"gradients and the log-sum-exp on the CPU, no dropout, from "
         f"{_widths(NATIVE_MIN_GRAD_LSE_SCORES)} scores: the native kernel with its FlashAttention-2 backward (O(S) "
         "memory; 'explicit' would hold S×S)",
         lambda c: (c.differentiable and c.dropout_p == 0 and c.q.device.type == "cpu"
                    and c.native_fits(NATIVE_MIN_GRAD_LSE_SCORES)), _native(decode=False), block_mask=True),
    Rule("explicit (gradients, lse)", "gradients or dropout and the log-sum-exp: 'explicit' is differentiable "
         "and returns it", lambda c: c.differentiable, _backend(explicit_attention)),
    Rule("native decode", f"few query rows per K/V head (Sq·G ≤ {DECODE_ROWS}), from "
         f"{_widths(NATIVE_MIN_DECODE_SCORES)} scores: the native loop that streams K and V once",
         lambda c: c.few_rows and not c.varlen and c.native_fits(NATIVE_MIN_DECODE_SCORES), _native(decode=True),
         prepare=_prepared(decode=True)),
    Rule("decode", f"few query rows per K/V head, GQA, ≥ {DECODE_MIN_KEYS} keys, below the native "
         "decoding threshold (or no native kernel): batched matmuls per K/V head",
         lambda c: c.few_rows and c.q.shape[1] > c.k.shape[1] and c.k.shape[2] >= DECODE_MIN_KEYS,
         _torch_kernel(decode_attention)),
    Rule("native few keys", f"float32, at most {native.LANE_KEYS} keys and {native.LANE_ROWS} query rows per K/V "
         f"head, from {_widths(NATIVE_MIN_SCORES)} scores, with the AVX-512 build: the native decoding loop, its "
         "rows in the vector lanes (0.61-0.95× the FlashAttention loop's time there)",
         _native_lanes_fit, _native(decode=True), prepare=_prepared(decode=True)),
    Rule("native", f"from {_widths(NATIVE_MIN_SCORES)} scores: the native FlashAttention loop (compiled here "
         "for AVX-512 or AVX2; float32, and bfloat16/float16 read as such and computed in float32); without the "
         f"log-sum-exp, bfloat16 on a CPU with AMX from "
         f"2^{AMX_MIN_SCORES.bit_length() - 1} scores where the loop runs on its tiles (native.amx()), never where "
         "it cannot (SDPA's products run on them)",
         _native_prefill_fits, _native(decode=False), block_mask=True, prepare=_prepared(decode=False)),
    Rule("blocked", f"float32, Sq and Sk ≥ {BLOCKED_MIN_SEQ}, D ≥ {BLOCKED_MIN_HEAD_DIM}, not native (no "
         "kernel, or below its threshold), not on an Intel CPU with AVX-512 unless the log-sum-exp is asked for "
         "(SDPA ahead): the torch-only blocked kernel", _blocked_fits, _torch_kernel(blocked_attention)),
    Rule("sdpa", "a problem too small for the other paths' fixed costs (or an unsupported shape): SDPA",
         lambda c: not c.return_lse, _backend(sdpa_attention)),
    Rule("explicit (lse)", "the log-sum-exp of a problem too small for the kernels: 'explicit'",
         lambda c: True, _backend(explicit_attention)),
)

#: The paths "auto" can take, and why it takes each.
AUTO_PATHS: dict[str, str] = {rule.path: rule.reason for rule in AUTO_RULES}


def _rule(call: Call) -> Rule:
    return next(rule for rule in AUTO_RULES if rule.applies(call))


def auto_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
              return_weights: bool = False, return_lse: bool = False, softcap: float | None = None,
              alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
              cu_seqlens: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              score_mod: Callable[..., torch.Tensor] | None = None, block_mask: BlockMask | None = None) -> str:
    """The path the ``"auto"`` backend takes for these tensors: a key of :data:`AUTO_PATHS`.

    No hidden slow path: call this (``AUTO_PATHS[path]`` says why) to see what a call of
    :func:`multihead.attention` with the same tensors and flags will run. Decided afresh by the
    rules every time (never from the remembered decisions of :func:`decision`, which must agree
    with it). May build the native kernel (first call only).

    Args:
        q: (B, H, Sq, D); k: (B, Hkv, Sk, D); v: (B, Hkv, Sk, Dv); as given to
            :func:`multihead.attention` (whose checks this does not repeat).
        dropout_p, return_weights, return_lse, softcap, alibi_slopes, sinks, cu_seqlens: as given to
            :func:`multihead.attention`.
        bias, score_mod, block_mask: as given to :func:`multihead.attention` (a score_mod is lowered
            as it lowers it; a block mask or mask_mod does not change the path: a path that does
            not take it as tiles gets it as a dense mask).
    """
    features = lower_score_mod(Features(softcap, alibi_slopes, sinks, cu_seqlens, block_mask, bias, score_mod),
                               q.shape[2], k.shape[2], q.shape[1])  # as multihead.attention lowers it
    return _rule(_call(q, k, v, dropout_p, return_weights, return_lse, features)).path


def _call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, return_weights: bool,
          return_lse: bool, features: Features) -> Call:
    learned = features.learned()
    return Call(q, k, v, dropout_p, return_weights, return_lse, features.softcap is not None,
                features.alibi_slopes is not None, features.sinks is not None, features.cu_seqlens is not None,
                bool(learned) and needs_grad(*learned), features.has_bias(), features.score_mod is not None)


class Decision(NamedTuple):
    """What "auto" runs for a call: the first rule that applies, whether the call is
    ``differentiable`` (:attr:`Call.differentiable`: packed sequences then go as a mask), the
    machine facts the rules asked on the way, with their answers (:attr:`Call.asked`), and the
    generation of the remembered decisions it was taken in (:func:`clear_decisions`)."""

    rule: Rule
    differentiable: bool
    asked: tuple[Asked, ...]
    generation: int
    #: What the rule runs for a plain call of this signature, made once (:attr:`Rule.prepare`: no
    #: logit feature, packing, weights, lse, gradient or dropout; any mask), or None.
    fast: Prepared | None = None

    def holds(self) -> bool:
        """Whether the rules would decide the same now for a call of the same :func:`signature`:
        no :func:`clear_decisions` since, and every machine fact asked gives the same answer
        (the fixed ones of :data:`FACTS` unchanged where the same function still answers)."""
        if self.generation != _generation:
            return False
        for owner, name, fixed, fn, answer in self.asked:
            now = getattr(owner, name)
            if not (fixed and now is fn) and now() != answer:
                return False
        return True


#: At most this many decisions are remembered (:func:`decision`); the oldest goes first.
DECISION_CACHE_SIZE = 1024
_decisions: dict[tuple[object, ...], Decision] = {}
_generation = 0
_NO_FEATURES_KEY = (False, False, False, False, False, False, False)


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
              return_weights: bool = False, return_lse: bool = False,
              features: Features = NO_FEATURES) -> tuple[object, ...]:
    """Everything of a call the rules read (the key of :func:`decision`'s memory): the three
    shapes, q's dtype and device, whether autograd records on q, k or v (grad mode and
    ``requires_grad``), ``dropout_p``, the two flags, which features are asked for (a bias and a
    score_mod among them) and whether alibi_slopes, sinks or the bias need gradients. The
    machine's facts are not in it: a decision keeps those it asked (:attr:`Decision.asked`),
    checked before reuse. Masks, block masks, ``causal`` and ``window`` are not read by the
    rules (every path takes them), nor the thread count."""
    grad = torch.is_grad_enabled()
    if features is NO_FEATURES:
        asked = _NO_FEATURES_KEY
    else:
        learned = features.learned()
        asked = (features.softcap is not None, features.alibi_slopes is not None, features.sinks is not None,
                 features.cu_seqlens is not None, grad and any(t.requires_grad for t in learned),
                 features.has_bias(), features.score_mod is not None)
    return (q.shape, k.shape, v.shape, q.dtype, q.device,
            grad and (q.requires_grad or k.requires_grad or v.requires_grad),
            dropout_p, return_weights, return_lse, asked)


def fresh_decision(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                   return_weights: bool = False, return_lse: bool = False,
                   features: Features = NO_FEATURES, *, prepare: bool = False) -> Decision:
    """The rules' decision for this call, taken now (:func:`auto_path`'s, with what it asked);
    neither looked up nor remembered. ``prepare``: with the rule's prepared call where the
    signature is plain (:attr:`Decision.fast`)."""
    call = _call(q, k, v, dropout_p, return_weights, return_lse, features)
    rule = _rule(call)
    plain = not (call.differentiable or call.symbolic or return_weights or return_lse or call.logits
                 or call.varlen or call.bias or call.score_mod)
    fast = rule.prepare(q, k, v) if prepare and plain and rule.prepare is not None else None
    return Decision(rule, call.differentiable, tuple(call.asked), _generation, fast)


def decision(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
             return_weights: bool = False, return_lse: bool = False,
             features: Features = NO_FEATURES) -> Decision:
    """The rule :func:`auto_backend` runs for this call: the one :func:`auto_path` names,
    remembered per :func:`signature` (at most :data:`DECISION_CACHE_SIZE`) and reused while it
    :meth:`~Decision.holds`. Decided afresh, and not remembered, while ``torch.compile`` or
    ``torch.export`` traces (symbolic shapes; the graph keeps the path anyway). After a change
    of :data:`AUTO_RULES` or of a threshold at run time: :func:`clear_decisions`."""
    if torch.compiler.is_compiling():
        return fresh_decision(q, k, v, dropout_p, return_weights, return_lse, features)
    key = signature(q, k, v, dropout_p, return_weights, return_lse, features)
    try:
        found = _decisions.get(key)
    except TypeError:  # an unhashable shape (symbolic sizes outside a compiler): decided afresh
        return fresh_decision(q, k, v, dropout_p, return_weights, return_lse, features)
    if found is not None and found.holds():
        return found
    found = fresh_decision(q, k, v, dropout_p, return_weights, return_lse, features, prepare=True)
    remember(_decisions, key, found, DECISION_CACHE_SIZE)
    return found


def clear_decisions() -> None:
    """Forget every remembered decision (:func:`decision`; a decision kept elsewhere no longer
    :meth:`~Decision.holds`), for a change of :data:`AUTO_RULES` or of a threshold at run time.
    Machine facts and the call's signature need none: they are checked."""
    global _generation
    _generation += 1
    _decisions.clear()


@register_backend("auto", weights=True, lse=True, grad=True, dropout=True, softcap=True, alibi=True, sinks=True,
                  varlen=True, block_mask=True, bias=True, score_mod=True)
def auto_backend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    mask: torch.Tensor | None, causal: bool, window: int | None, scale: float,
    dropout_p: float, return_weights: bool, return_lse: bool, features: Features = NO_FEATURES,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run the path :func:`auto_path` picks for this call (the first rule that applies;
    remembered per call signature: :func:`decision`).

    Packed sequences (``features.cu_seqlens``) reach a native forward path as structure, every
    other path as a block-diagonal mask; a block mask (``features.block_mask``) reaches a rule
    declaring :attr:`Rule.block_mask` as tiles, every other as its dense mask."""
    picked = decision(q, k, v, dropout_p, return_weights, return_lse, features)
    if picked.fast is not None and features.block_mask is None:  # a plain call: the rule's, made once
        out = picked.fast(q, k, v, scale, causal, window, mask)
        if out is not None:
            return out, None, None
    rule, cu, block = picked.rule, features.cu_seqlens, features.block_mask
    if cu is not None and (picked.differentiable or not rule.path.startswith("native")):
        segments = segment_mask(cu, q.shape[2], q.device)  # (B|1, 1, S, S)
        mask, features = (segments if mask is None else mask & segments), features._replace(cu_seqlens=None)
    if block is not None and not rule.block_mask:
        dense = block.dense()  # (Bm, Hm, Sq, Sk)
        mask, features = (dense if mask is None else mask & dense), features._replace(block_mask=None)
    return rule.run(q, k, v, mask=mask, causal=causal, window=window, scale=scale, dropout_p=dropout_p,
                    return_weights=return_weights, return_lse=return_lse, features=features)
