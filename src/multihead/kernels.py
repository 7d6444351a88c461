"""Backends ``"native"``, ``"blocked"`` and ``"auto"``, and the projections' fast ``linear``.

Notation: B batch, H query heads, Hkv key/value heads, G = H // Hkv query heads per
K/V head, Sq queries, Sk keys, D head dim (Dv for values).

``"native"`` runs :mod:`multihead.native` (the compiled kernels), ``"blocked"`` the
torch-only kernel of :mod:`multihead.blocked`; both hand gradients and dropout to
``"sdpa"``.

``"auto"`` (the default) picks per call: weights → ``"explicit"``; gradients or dropout
→ ``"sdpa"`` (differentiable); then, when the compiled kernel of :mod:`multihead.native`
builds here for AVX-512 (``"native"``: float32, half precision upcast), its decoding loop for few
query rows per K/V head (Sq·G ≤ 32) from 2^11 scores (B·H·Sq·Sk), its FlashAttention
loop from 2^14 scores. Without it: GQA decoding over ≥ 256 keys →
:func:`~multihead.blocked.decode_attention`, two batched matmuls; float32 with oneDNN,
Sq and Sk ≥ 512 and D ≥ 64 → ``"blocked"``. Anything else (tiny problems, where SDPA's fixed costs are
lowest) → ``"sdpa"``. The thresholds were measured.

:func:`linear` is ``F.linear`` on oneDNN (forward and backward), for the projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native
from .backends import get_backend, register_backend
from .blocked import _onednn_linear, _upcast, blocked_attention, decode_attention, onednn_available

__all__ = ["linear", "linears", "auto_path", "AUTO_PATHS", "blocked_attention", "decode_attention",
           "onednn_available"]

#: At most this many query rows per K/V head (Sq·G) go to the batched decode path,
#: and only with GQA sharing (G > 1) and enough keys: measured on this project's
#: machine, SDPA is faster for MHA and for short caches (fixed costs dominate).
_DECODE_ROWS = 32
_DECODE_MIN_KEYS = 256
#: "auto" uses "blocked" from this many queries and keys, and head dims from 64: below
#: that SDPA wins (at S=128 "blocked" takes 2-3× SDPA's time, the GEMMs are too small
#: for oneDNN's fixed costs and keys are padded to multiples of 128); from S=512 with
#: D=64 "blocked" is 1.2-1.4× faster.
_BLOCKED_MIN_SEQ = 512
_BLOCKED_MIN_HEAD_DIM = 64
#: "auto" uses the native kernel from this many scores (B·H·Sq·Sk): below, its fixed
#: cost (~15 µs: ctypes, an OpenMP region, buffers) exceeds SDPA's (~10 µs).
_NATIVE_MIN_SCORES = 1 << 14
#: The same for few query rows per K/V head (decoding), where the native kernel streams
#: K and V without packing them: it wins from about 2^11 scores.
_NATIVE_MIN_DECODE_SCORES = 1 << 11
#: Input dtypes "auto" sends to the native kernel (half precision is computed in float32,
#: which is also faster than SDPA's half-precision CPU path, measured 1.5-3×).
_NATIVE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _OneDNNLinear(torch.autograd.Function):
    """y = x · wᵀ + b with oneDNN GEMMs in the forward and the backward pass."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor,
                b: torch.Tensor | None) -> torch.Tensor:
        op = _onednn_linear()
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        ctx.save_for_backward(x2, w)
        ctx.has_bias = b is not None
        return op(x2, w, b, "none", [], "").view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, gy: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        op = _onednn_linear()
        x2, w = ctx.saved_tensors
        gy2 = gy.reshape(-1, gy.shape[-1]).contiguous()  # (N, out)
        # oneDNN reads transposed operands slowly: pass contiguous copies (O(N·E), cheap next to the GEMMs).
        need_x, need_w, need_b = ctx.needs_input_grad
        gx = gw = gb = None
        if need_x:
            gx = op(gy2, w.t().contiguous(), None, "none", [], "").view(*gy.shape[:-1], w.shape[1])  # gy · w
        if need_w:  # frozen weights (e.g. adapters) skip this GEMM
            gw = op(gy2.t().contiguous(), x2.t().contiguous(), None, "none", [], "")  # gyᵀ · x  (out, in)
        if need_b and ctx.has_bias:
            gb = gy2.sum(0)
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with oneDNN's GEMM for float32 CPU tensors (forward and backward).

    On AMD CPUs torch's float32 matmul (MKL) runs AVX2 code and its single-row GEMV uses
    one core; oneDNN reaches about twice the FLOP rate and twice the bandwidth. Without
    autograd, a few rows (decoding) go to :func:`multihead.native.linear_few_rows`,
    which streams the weight faster still. Other dtypes and devices, or oneDNN
    disabled, use ``F.linear``.

    Args:
        x: (..., in). weight: (out, in). bias: (out,) or None.

    Returns:
        (..., out), differentiable in x, weight and bias.
    """
    return linears(x, [(weight, bias)])[0]


def linears(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
    """:func:`linear` of one input through several layers: ``[x · wᵀ + b for w, b in layers]``.

    When decoding (few rows of x, no autograd, float32, the native kernel built) the
    layers run in one call that streams all their weights across threads at once.

    Args:
        x: (..., in). layers: (weight (out_i, in), bias (out_i,) or None).

    Returns:
        One (..., out_i) tensor per layer.
    """
    tensors = [x] + [t for layer in layers for t in layer if t is not None]
    if (_onednn_linear() is None or not torch.backends.mkldnn.enabled or x.device.type != "cpu"
            or any(t.dtype != torch.float32 for t in tensors)):
        return [F.linear(x, w, b) for w, b in layers]
    if _needs_grad(*tensors):
        return [_OneDNNLinear.apply(x, w, b) for w, b in layers]
    x2 = x.reshape(-1, x.shape[-1])  # (N, in)
    if (0 < x2.shape[0] <= native.FEW_ROWS and all(t.is_contiguous() for t in tensors[1:])
            and native.vector_bits() >= 512):
        outs = native.linear_few_rows(x2.contiguous(), layers)
    else:
        op = _onednn_linear()
        outs = [op(x2, w, b, "none", [], "") for w, b in layers]
    return [o.view(*x.shape[:-1], o.shape[-1]) for o in outs]


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _few_rows(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Few query rows per K/V head (Sq·G, e.g. decoding): the batched-matmul path wins."""
    return q.shape[2] * (q.shape[1] // k.shape[1]) <= _DECODE_ROWS


@register_backend("blocked")
def blocked_backend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    mask: torch.Tensor | None, causal: bool, window: int | None, scale: float,
    dropout_p: float, return_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The blocked kernel; gradients or dropout go to ``"sdpa"`` (differentiable).

    Why not our forward with torch's flash backward (fed our output and log-sum-exp): the
    backward recomputes the logits with its own GEMM, and the few-ulp mismatch with ours
    leaves the probabilities summing to 1 ± ε, which its Δ = rowsum(dO·O) term turns into
    gradient errors several times those of a plain float32 implementation.
    """
    if dropout_p > 0 or _needs_grad(q, k, v):
        return get_backend("sdpa")(q, k, v, mask=mask, causal=causal, window=window, scale=scale,
                                   dropout_p=dropout_p, return_weights=False)
    return blocked_attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask), None


@register_backend("native")
def native_backend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    mask: torch.Tensor | None, causal: bool, window: int | None, scale: float,
    dropout_p: float, return_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The compiled kernel (:mod:`multihead.native`), float32 (half precision upcast).

    Gradients or dropout go to ``"sdpa"`` (differentiable); float64 goes to the
    ``"blocked"`` kernel, in float64 (the compiled kernel is float32 only).

    Raises:
        RuntimeError: the kernel cannot be built or loaded here (the message says why),
            or the tensors are not on the CPU.
    """
    if dropout_p > 0 or _needs_grad(q, k, v):
        return get_backend("sdpa")(q, k, v, mask=mask, causal=causal, window=window, scale=scale,
                                   dropout_p=dropout_p, return_weights=False)
    if q.device.type != "cpu":
        raise RuntimeError(f"backend 'native' runs on the CPU, got tensors on {q.device}")
    if q.dtype not in _NATIVE_DTYPES:
        return blocked_attention(q, k, v, scale=scale, causal=causal, window=window, mask=mask), None
    return _native_call(q, k, v, scale=scale, causal=causal, window=window, mask=mask), None


def _native_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
                 window: int | None, mask: torch.Tensor | None, decode: bool | None = None) -> torch.Tensor:
    dtype = q.dtype
    fn = native.decode_f32 if (_few_rows(q, k) if decode is None else decode) else native.attention_f32
    out = fn(_upcast(q), _upcast(k), _upcast(v), scale=scale, causal=causal, window=window, mask=mask)
    return out if dtype == torch.float32 else out.to(dtype)


def _native_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, min_scores: int) -> bool:
    """Whether "auto" should use the native kernel for these tensors (built on first ask)."""
    return (q.dtype in _NATIVE_DTYPES and v.shape[-1] % 16 == 0
            and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] >= min_scores and native.vector_bits() >= 512)


#: The paths "auto" can take, and why it takes each (:func:`auto_path`).
AUTO_PATHS = {
    "explicit": "attention weights were asked for: only 'explicit' returns them",
    "sdpa (gradients)": "gradients or dropout are needed (or the tensors are not on the CPU): SDPA is differentiable",
    "native decode": "few query rows per K/V head (decoding): the native loop that streams K and V once",
    "native": "the native FlashAttention loop (compiled here; float32, half precision upcast)",
    "decode": "few query rows per K/V head, no native kernel: batched matmuls per K/V head",
    "blocked": "float32, Sq and Sk >= 512, D >= 64, no native kernel: the torch-only blocked kernel",
    "sdpa": "a problem too small for the other paths' fixed costs (or an unsupported shape): SDPA",
}


def auto_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
              return_weights: bool = False) -> str:
    """The path the ``"auto"`` backend takes for these tensors: a key of :data:`AUTO_PATHS`.

    No hidden slow path: call this (``mh.kernels.AUTO_PATHS[path]`` says why) to see
    what a call of :func:`multihead.attention` with the same tensors will run. May build
    the native kernel (first call only).

    Args:
        q: (B, H, Sq, D); k: (B, Hkv, Sk, D); v: (B, Hkv, Sk, Dv); as given to
            :func:`multihead.attention` (whose checks this does not repeat).
        dropout_p, return_weights: as given to :func:`multihead.attention`.
    """
    if return_weights:
        return "explicit"
    if dropout_p > 0 or _needs_grad(q, k, v) or q.device.type != "cpu":
        return "sdpa (gradients)"
    sq, sk, d, g = q.shape[2], k.shape[2], q.shape[3], q.shape[1] // k.shape[1]
    if _few_rows(q, k) and _native_fits(q, k, v, _NATIVE_MIN_DECODE_SCORES):
        return "native decode"
    if _few_rows(q, k) and g > 1 and sk >= _DECODE_MIN_KEYS:
        return "decode"
    if _native_fits(q, k, v, _NATIVE_MIN_SCORES):
        return "native"
    if (q.dtype == torch.float32 and onednn_available() and min(sq, sk) >= _BLOCKED_MIN_SEQ
            and d >= _BLOCKED_MIN_HEAD_DIM):
        return "blocked"
    return "sdpa"


@register_backend("auto", weights=True)
def auto_backend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    mask: torch.Tensor | None, causal: bool, window: int | None, scale: float,
    dropout_p: float, return_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the path :func:`auto_path` picks for this call (see the module docstring)."""
    path = auto_path(q, k, v, dropout_p=dropout_p, return_weights=return_weights)
    structure = dict(scale=scale, causal=causal, window=window, mask=mask)
    if path == "native decode":
        return _native_call(q, k, v, decode=True, **structure), None
    if path == "native":
        return _native_call(q, k, v, decode=False, **structure), None
    if path == "decode":
        return decode_attention(q, k, v, **structure), None
    if path == "blocked":
        return blocked_attention(q, k, v, **structure), None
    name = "explicit" if path == "explicit" else "sdpa"
    return get_backend(name)(q, k, v, dropout_p=dropout_p, return_weights=return_weights, **structure)
