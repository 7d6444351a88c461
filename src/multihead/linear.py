"""The projections' GEMMs: ``F.linear`` on this machine's faster GEMM, and a few-row path for decoding.

Notation: N rows of x, ``in``/``out`` the layer's widths.

:func:`linear` is ``F.linear`` with this machine's float32 GEMM (forward and backward):
oneDNN's or torch.matmul's, whichever was measured faster here
(:func:`multihead.backends.gemm.gemm_choice`; oneDNN reached 1.2-1.3× MKL's rate on an Intel
Xeon and on one AMD VM, 0.78-0.92× on another). Without autograd, a few rows (decoding) go to
:func:`multihead.backends.native.linear_few_rows`, which streams the weights faster
still, and small GEMMs to ``F.linear``, whose fixed cost per call is lower. Other dtypes
and devices use ``F.linear``. :func:`gemm_for` and :func:`mm_nt` are
the same GEMM for the torch-only attention kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .backends import native
from .backends.gemm import MatMul, onednn_gemm, compiled_onednn, gemm_for, mm_nt, onednn_available, onednn_linear_op
from .backends.registry import needs_grad

__all__ = ["linear", "linears", "few_rows", "onednn_available", "gemm_for", "mm_nt", "MatMul"]


#: Without autograd, GEMMs of at most this many multiply-adds (N·in·out) run on ``F.linear``.
#: Measured on a Zen 3 CPU (AVX2, 2 threads, medians): alone and warm, oneDNN's op costs a
#: fixed ~25 µs a call more (20-40% of a 24 × 384 × 384 GEMM, even at 72 rows); inside a BERT
#: model, weights read from memory, F.linear's projections take 0.87-0.89× oneDNN's time at
#: 72 rows × 384 (11M multiply-adds), the same at 72 × 768 (42M), 0.96-1.04× at 128 × 768,
#: and oneDNN is ahead from 1024 × 768 (0.85-0.9×).
SMALL_GEMM = 1 << 24


def _gemm() -> Callable[..., torch.Tensor]:
    """oneDNN's GEMM, on the paths that :func:`linears` takes only when it exists."""
    op = onednn_gemm()
    assert op is not None  # linears() checked it before choosing this path
    return op


class _OneDNNLinear(torch.autograd.Function):
    """yᵢ = x · wᵢᵀ + bᵢ for one or more layers of one input, with oneDNN GEMMs in the forward
    and the backward pass: one autograd node, so that x is transposed once for every weight
    gradient (q, k and v of a layer share it) and x's gradient is summed here."""

    # ctx: Any, as in torch's own examples: its stub (FunctionCtx) lacks saved_tensors and
    # needs_input_grad, and the context also carries our has_bias.
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        op = _gemm()
        weights, biases = params[0::2], params[1::2]  # w₀, b₀, w₁, b₁, ...: (out_i, in), (out_i,) or None
        x2 = x.reshape(-1, x.shape[-1])  # (N, in)
        ctx.save_for_backward(x2, *weights)
        ctx.has_bias = [b is not None for b in biases]
        ctx.shape = x.shape
        return tuple(op(x2, w, b, "none", [], "").view(*x.shape[:-1], w.shape[0])  # type: ignore[union-attr]
                     for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx: Any, *gys: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        op = _gemm()
        x2, *weights = ctx.saved_tensors
        need_x, need = ctx.needs_input_grad[0], ctx.needs_input_grad[1:]
        # oneDNN reads transposed operands slowly: pass contiguous copies (O(N·E), cheap next to the GEMMs).
        xt = x2.t().contiguous() if any(need[0::2]) else None  # (in, N), once for every layer
        gx: torch.Tensor | None = None
        grads: list[torch.Tensor | None] = []
        for i, (gy, w) in enumerate(zip(gys, weights)):
            gy2 = gy.reshape(-1, gy.shape[-1]).contiguous()  # (N, out)
            if need_x:
                part = op(gy2, w.t().contiguous(), None, "none", [], "")  # gy · w  (N, in)
                gx = part if gx is None else gx.add_(part)
            # frozen weights (e.g. adapters) skip this GEMM
            grads.append(op(gy2.t().contiguous(), xt, None, "none", [], "") if need[2 * i] else None)  # gyᵀ · x
            grads.append(gy2.sum(0) if need[2 * i + 1] and ctx.has_bias[i] else None)
        return (None if gx is None else gx.view(ctx.shape), *grads)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the fastest GEMM here (see the module docstring).

    Args:
        x: (..., in). weight: (out, in). bias: (out,) or None.

    Returns:
        (..., out), differentiable in x, weight and bias.
    """
    return linears(x, [(weight, bias)])[0]


def linears(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
    """:func:`linear` of one input through several layers: ``[x · wᵀ + b for w, b in layers]``.

    When decoding (few rows of x, no autograd, float32, the native kernel built) the
    layers run in one call that streams all their weights across threads at once; small
    GEMMs without autograd (:data:`SMALL_GEMM`) run on ``F.linear``.

    Args:
        x: (..., in). layers: (weight (out_i, in), bias (out_i,) or None).

    Returns:
        One (..., out_i) tensor per layer.
    """
    few = few_rows(x, layers)  # decoding's few rows; None at once for more
    if few is not None:
        return few
    if torch.compiler.is_compiling():  # oneDNN's op does not lower: an opaque operator around it
        params = [t for layer in layers for t in layer if t is not None]
        if compiled_onednn() and x.device.type == "cpu" and all(t.dtype == torch.float32 for t in [x, *params]):
            return [onednn_linear_op(x, w, b) for w, b in layers]
        return [F.linear(x, w, b) for w, b in layers]
    tensors = [x] + [t for layer in layers for t in layer if t is not None]
    grad = needs_grad(*tensors)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0  # N
    small = all(rows * w.shape[0] * w.shape[1] <= SMALL_GEMM for w, _ in layers)
    if x.device.type != "cpu" or any(t.dtype != torch.float32 for t in tensors) or (not grad and small):
        return [F.linear(x, w, b) for w, b in layers]
    onednn = onednn_available()  # this machine's GEMM (measured once: gemm_choice)
    if grad:
        if onednn:
            return list(_OneDNNLinear.apply(x, *(t for layer in layers for t in layer)))
        return [F.linear(x, w, b) for w, b in layers]
    if not onednn:
        return [F.linear(x, w, b) for w, b in layers]
    op = _gemm()
    x2 = x.reshape(-1, x.shape[-1])  # (N, in)
    return [op(x2, w, b, "none", [], "").view(*x.shape[:-1], w.shape[0]) for w, b in layers]


#: The tensor types the few-row kernel reads (subclasses such as DTensor keep their own dispatch).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _operands(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
    """x, then each layer's weight and bias (where there is one)."""
    found = [x]
    for w, b in layers:
        found.append(w)
        if b is not None:
            found.append(b)
    return found


def few_rows(x: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor] | None:
    """``[x · wᵀ + b for w, b in layers]`` on the native few-row kernel, or None where it does not
    apply: more than :data:`multihead.backends.native.MAX_STEP_ROWS` rows, autograd, autocast,
    a dtype other than float32, a device other than the CPU, non-contiguous weights, tensor
    subclasses, symbolic sizes, or no AVX2/AVX-512 build here. Traced by ``torch.compile`` with
    static sizes, it is the operator ``multihead::linear_few_rows`` in the graph (the same kernel).

    Decoding reads every weight once per token: the kernel streams them across the threads
    (AMD EPYC, AVX2, 2 threads, a 128256 × 1024 weight: 34 GB/s at one row against torch's 20,
    20 against 5.4 at eight rows; on one thread where that has been faster, as beside another
    busy process), and sums each dot product in float32 as a GEMM does.

    Args:
        x: (..., in). layers: (weight (out_i, in), bias (out_i,) or None).

    Returns:
        One (..., out_i) tensor per layer, or None.
    """
    if native.ops.symbolic(x):  # a graph for a range of sizes: comparing them would narrow it
        return None
    shape = x.shape
    rows = x.numel() // shape[-1] if shape and shape[-1] else 0  # N
    if not 0 < rows <= native.MAX_STEP_ROWS or torch.is_autocast_enabled("cpu") or native.vector_bits() < 256:
        return None  # AVX-512 or AVX2 (measured: 1.2-1.7× oneDNN's on AVX2; 5 to 8 rows, Intel Xeon,
        # 1 thread: 0.44-0.72× torch's time with the AVX-512 build, 0.69-0.97× with AVX2's)
    grad = torch.is_grad_enabled()
    for t in _operands(x, layers):
        if (type(t) not in _PLAIN or t.dtype != torch.float32 or not t.is_cpu or (grad and t.requires_grad)
                or (t is not x and not t.is_contiguous())):
            return None
    x2 = x.reshape(rows, shape[-1]).contiguous()  # (rows, in)
    if torch.compiler.is_compiling():
        outs = native.ops.linear_few_rows(x2, [w for w, _ in layers], [b for _, b in layers])
    else:
        outs = native.linear_few_rows(x2, layers)
    if len(shape) == 2:
        return outs
    return [o.view(*shape[:-1], o.shape[-1]) for o in outs]
