"""The native kernels as PyTorch operators: ``torch.ops.multihead.*`` (``torch.library``).

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim,
Dv value head dim, E embed_dim, C cache capacity.

The kernels read raw memory (tensors passed by address), which ``torch.compile`` and
``torch.export`` cannot trace; registered as custom operators with fake (meta) implementations giving
exact output shapes, dtypes and strides, they are opaque nodes of a graph instead:

* ``multihead::attention(q, k, v, mask, scale, causal, window, decode, softcap=None,
  alibi_slopes=None, sinks=None, cu_seqlens=None) -> (out, lse)``, differentiable through
  ``multihead::attention_backward`` (FlashAttention-2's backward, ``csrc/backward.cpp``:
  probabilities recomputed from the saved lse) when no logit feature or packing is given
  but an additive bias (the backward adds it, and gives its gradient; asking for gradients
  with another is refused by name). ``bias`` is dense, ``rel_bias`` one value per head and
  distance (T5's), read along diagonals;
* ``multihead::decode_step(...)`` a whole cached decoding step; it writes the new
  token's K and V into the cache buffers (declared as mutated);
* ``multihead::linear_few_rows(x, weights, biases) -> [y_i]``: the few-row GEMV of decoding's
  projections (:func:`.step.linear_few_rows`), forward only.

float32, bfloat16 and float16 run the tiled kernels of their dtype (computed in float32,
half precision widened as loaded: no float32 copies); float64 runs a
plain float64 loop of the same rule, there so that ``torch.autograd.gradcheck`` can
check the backward's algorithm in float64 (float32 runs it in register tiles).
Registering is cheap and happens on import of :mod:`multihead.backends.native`; the
kernels are built on first call. Eager calls with nothing to record or trace run the
operators' bodies directly (:func:`direct`): their Python dispatch costs tens of µs a call.
:func:`run` is the attention's way in (the ``"native"`` backend's, ``"auto"``'s): it picks the
loop and runs the operator or, when :func:`direct`, its body.

The bodies call the kernels' Python entry points below them: :mod:`.attention` (the loops),
:mod:`.step` (the decoding step) and :mod:`.loader` (the library).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import attention as loops  # the name `attention` is the operator multihead::attention's here
from . import loader, step
from ..registry import Prepared
from ._ffi import ptr

__all__ = ["attention", "attention_impl", "attention_backward", "decode_step", "linear_few_rows", "direct", "forward",
           "run", "symbolic", "prepare"]

Tensor = torch.Tensor


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute (and return lse) in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mask_strides(mask: Tensor | None, shape: tuple[int, int, int, int]) -> tuple[Tensor | None, tuple[int, ...]]:
    """The mask expanded to (B, H, Sq, Sk) (strides 0 where broadcast) and its strides."""
    if mask is None:
        return None, (0, 0, 0, 0)
    mask = mask[(None,) * (4 - mask.dim())].expand(shape)
    return mask, tuple(mask.stride())


def _rows(t: Tensor) -> Tensor:
    """t itself when its last dim is contiguous (the kernels take any other strides), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _gradient_like(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An empty gradient for ``t`` (B, H, S, D) (in ``dtype``, default t's): with t's strides when
    t fills its memory densely with contiguous rows (contiguous leaves; the layer's heads, views
    of its (B, S, H·D) projections, so that their backward is a view), else laid out (B, S, H, D)
    (e.g. slices of a packed qkv buffer). The fake implementation calls it too."""
    out = torch.empty_like(t, dtype=dtype)  # preserve_format: t's strides when t is dense, else contiguous
    if out.stride() == t.stride() and t.stride(-1) == 1:
        return out
    b, h, s, d = t.shape
    return t.new_empty((b, s, h, d), dtype=dtype).permute(0, 2, 1, 3)


def _strides(*tensors: Tensor) -> tuple[int, ...]:
    """The (b, h, s) strides of each 4-d tensor, in order (the kernels' stride arguments)."""
    return tuple(n for t in tensors for n in t.stride()[:3])


def _check(code: int, what: str) -> None:
    if code == -1:
        raise MemoryError(f"the native {what} could not allocate its buffers")
    if code != 0:
        raise RuntimeError(f"the native {what} refused the problem (code {code})")


# torch's C state queries of :func:`direct` (torch.jit.is_tracing() is _is_tracing() outside TorchScript),
# looked up once: direct() is asked on every small call.
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_level = torch._C._functorch.peek_interpreter_stack
_jit_tracing = torch._C._is_tracing
_profiling = torch.autograd._profiler_enabled


def direct(*tensors: Tensor | None) -> bool:
    """Whether a call with these tensors may run a kernel's implementation directly rather than
    through its operator (the operator's Python dispatch costs tens of µs a call, a sizeable part
    of a small layer's): in eager mode, with no gradient to record, plain tensors, and nothing
    tracing or watching the operators (``torch.compile``, ``torch.export``, a ``TorchDispatchMode``
    such as fake tensors, functorch transforms, ``torch.jit.trace``, the profiler), all of which
    need to see the operator."""
    if (torch.compiler.is_compiling() or _dispatch_modes() > 0 or _functorch_level() is not None or _jit_tracing()
            or _profiling()):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not Tensor or (grad and t.requires_grad)):
            return False
    return True


def symbolic(*tensors: Tensor) -> bool:
    """Whether any size of these tensors is symbolic (a graph traced for a range of sizes):
    then no decision may compare a size, or it becomes a guard that narrows the range.

    ``torch.export`` shows such sizes as ``SymInt``; ``torch.compile(dynamic=True)`` shows them
    to Python as ints, so its tracing is asked for by its setting (read only while compiling)."""
    return any(isinstance(n, torch.SymInt) for t in tensors for n in t.shape) or _compiling_dynamic()


def _compiling_dynamic() -> bool:
    """``torch.compile(dynamic=True)`` is tracing (its sizes are symbolic whatever Python sees)."""
    if not torch.compiler.is_compiling():
        return False
    import torch._dynamo.config as dynamo_config  # loaded already: dynamo is tracing

    return not dynamo_config.assume_static_by_default


def attention_impl(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, causal: bool,
              window: Optional[int], decode: Optional[bool], softcap: Optional[float] = None,
              alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
              cu_seqlens: Optional[Tensor] = None, tiles: Optional[Tensor] = None,
              partial: Optional[Tensor] = None, bq: int = 0, bk: int = 0,
              bias: Optional[Tensor] = None, rel_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Attention with the native kernels: ``(out (B, H, Sq, Dv), lse (B, H, Sq))``, the body of
    the operator ``multihead::attention`` (:data:`attention`): :func:`forward` with the lse.

    Args:
        q: (B, H, Sq, D); k: (B, Hkv, Sk, D); v: (B, Hkv, Sk, Dv); CPU, float32, float16,
            bfloat16 or float64, validated by the caller (:func:`multihead.attention`).
        mask: bool, broadcastable to (B, H, Sq, Sk), True = may attend; or None.
        scale, causal, window: as in :func:`multihead.attention` (bottom-right aligned).
        decode: the decoding loop (few rows per K/V head) instead of the FlashAttention loop;
            None: chosen here from the rows per K/V head (what a graph with symbolic sizes
            passes, so that no size becomes a guard of ``torch.export`` or ``torch.compile``).
        softcap, alibi_slopes (H,), sinks (H,), cu_seqlens (N+1,) or (B, N+1): the logit
            features and packed sequences (:func:`multihead.attention`); the FlashAttention
            loop only (``decode`` must be False), float32 and half precision only.
        tiles, partial, bq, bk: a block mask (:class:`.attention.Tiles`: int32 classes
            (B|1, H|1, ⌈Sq/bq⌉, ⌈Sk/bk⌉), uint8 partial tiles (P, bq, bk)), not with ``mask``;
            the FlashAttention loop skips its empty tiles (float64: applied as its dense mask).
        bias: an additive float bias broadcastable to (B, H, Sq, Sk) (the FlashAttention loop;
            the backward adds it too, and gives its gradient).
        rel_bias: (B|1, H|1, Sq + Sk - 1) float, a bias that depends on the distance alone:
            ``rel_bias[b, h, j - i + Sq - 1]`` added to the logit of query row i and key j (T5's
            position bias; read along diagonals, never made (Sq, Sk)); with ``bias`` too, both.

    Returns:
        out in q's dtype (a view of a (B, Sq, H, Dv) buffer; contiguous for float64),
        zeros for rows with no key; lse float32 (float64 for float64), ``-inf`` there.

    Raises:
        TypeError, ValueError: the tensors do not describe one problem (checked here, before any
            memory is read: the operator may be called directly).
    """
    loops.check_operator_inputs(q, k, v, mask, window, softcap, alibi_slopes, sinks, cu_seqlens)
    blocks = _tiles(q, k, mask, tiles, partial, bq, bk)
    out, lse = forward(q, k, v, mask, scale, causal, window, decode, softcap, alibi_slopes, sinks, cu_seqlens,
                       return_lse=True, tiles=blocks, bias=bias, relative=rel_bias)
    assert lse is not None  # asked for
    return out, lse


def forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, causal: bool,
            window: Optional[int], decode: Optional[bool], softcap: Optional[float] = None,
            alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
            cu_seqlens: Optional[Tensor] = None, *, return_lse: bool,
            tiles: loops.Tiles | None = None, bias: Tensor | None = None,
            relative: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`attention_impl`, with the lse only when ``return_lse`` (float32 and half precision:
    the kernel then writes none); what eager calls run directly when :func:`direct`. ``tiles``:
    a block mask, checked (:meth:`.attention.Tiles.check`) before the kernel reads it."""
    if tiles is not None and q.dtype == torch.float64:  # the plain float64 loop: as a dense mask
        tiles.check(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        mask, tiles = tiles.dense(q.shape[2], k.shape[2]), None
    plain = (softcap is None and alibi_slopes is None and sinks is None and cu_seqlens is None and tiles is None
             and bias is None and relative is None)
    if decode is None:  # the loop for these sizes, chosen where no tracer sees the sizes
        decode = plain and loops.decoding_loop_fits(q, k)
    logits = None if plain else loops.Logits(softcap, alibi_slopes, sinks, cu_seqlens, tiles=tiles, bias=bias,
                                             relative=relative)
    if logits is not None and (decode or q.dtype == torch.float64):
        raise ValueError("softcap, alibi_slopes, sinks, cu_seqlens, bias and block masks run in the float32 "
                         f"FlashAttention loop only (got decode={decode}, dtype {q.dtype})")
    if q.dtype == torch.float64:
        return _forward_f64(loader.require(), q, k, v, mask, scale, causal, window)
    name, extra = ("mh_decode_f32", ()) if decode else ("mh_attention_f32", (loops.query_tile(),))
    # The caller (multihead.attention, the module) validated once: no second check here. Mixed
    # dtypes (not from multihead.attention) are brought to q's.
    if k.dtype != q.dtype or v.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    result = loops.run_kernel(name, q, k, v, scale, causal, window, mask, return_lse, *extra, checked=True,
                              logits=logits)
    return result if isinstance(result, tuple) else (result, None)


def _tiles(q: Tensor, k: Tensor, mask: Optional[Tensor], tiles: Optional[Tensor], partial: Optional[Tensor],
           bq: int, bk: int) -> loops.Tiles | None:
    """The operator's block mask arguments as :class:`.attention.Tiles` (None without one), checked."""
    if tiles is None and partial is None:
        return None
    if tiles is None or partial is None:
        raise ValueError("a block mask needs both tiles and partial, got "
                         f"tiles={type(tiles).__name__}, partial={type(partial).__name__}")
    if mask is not None:
        raise ValueError("a block mask (tiles) and a dense mask cannot be given together: fold the mask into it")
    blocks = loops.Tiles(tiles, partial, bq, bk)
    blocks.check(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return blocks


attention = torch.library.custom_op("multihead::attention", mutates_args=())(attention_impl)


@attention.register_fake
def _attention_fake(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, causal: bool,
                    window: Optional[int], decode: Optional[bool], softcap: Optional[float] = None,
                    alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                    cu_seqlens: Optional[Tensor] = None, tiles: Optional[Tensor] = None,
                    partial: Optional[Tensor] = None, bq: int = 0, bk: int = 0,
                    bias: Optional[Tensor] = None, rel_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    b, h, sq, _ = q.shape
    dv = v.shape[-1]
    if q.dtype == torch.float64:
        out = q.new_empty((b, h, sq, dv))
    else:
        out = q.new_empty((b, sq, h, dv)).permute(0, 2, 1, 3)  # (B, H, Sq, Dv), as the kernel writes it
    return out, q.new_empty((b, h, sq), dtype=_wide(q.dtype))


def _forward_f64(lib: object, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, causal: bool,
                 window: int | None) -> tuple[Tensor, Tensor]:
    b, h, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    q, k, v = (_rows(t) for t in (q, k, v))
    mask, mstrides = _mask_strides(mask, (b, h, sq, sk))
    out = torch.empty((b, h, sq, dv), dtype=torch.float64, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float64, device=q.device)
    strides = (*_strides(q, k, v), *(0,) * 12, *mstrides)  # dout, dq, dk, dv: unread
    _check(lib.mh_attention_forward_f64(  # type: ignore[attr-defined]
        ptr(q), ptr(k), ptr(v), ptr(mask), ptr(out), ptr(lse), (b, h, hkv, sq, sk, d, dv),
        strides, float(scale), int(causal), int(window or 0), torch.get_num_threads()), "float64 attention")
    return out, lse


@torch.library.custom_op("multihead::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                       mask: Optional[Tensor], scale: float, causal: bool, window: Optional[int],
                       tiles: Optional[Tensor] = None, partial: Optional[Tensor] = None, bq: int = 0,
                       bk: int = 0, bias: Optional[Tensor] = None, rel_bias: Optional[Tensor] = None,
                       bias_grad: bool = False, rel_grad: bool = False
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """FlashAttention-2's backward: ``(dq, dk, dv, dbias, drel)``, dq, dk, dv shaped and typed like q, k, v.

    Args:
        dout: (B, H, Sq, Dv) the gradient of out. q, k, v, mask, scale, causal, window:
            the forward's. lse: (B, H, Sq) the forward's log-sum-exp. delta: (B, H, Sq)
            ``Σ_t dout·out − dlse`` per row (float32, float64 for float64).
            q, k, v and dout are read at their strides (copied only if their last dim is
            not contiguous); the results do not depend on the strides (bitwise).
        tiles, partial, bq, bk: the forward's block mask, if any (its empty tiles cost no
            product; float64 applies it as its dense mask).
        bias, rel_bias: the forward's additive biases, if any (float32 and half precision).
        bias_grad: also compute the gradient of the bias added to each logit (dense);
        rel_grad: also compute its sums along the diagonals (the relative bias' gradient).

    Returns:
        dq, dk, dv with the strides of q, k, v where those are dense (the layer's heads:
        views of its projections, whose backward then copies nothing), else laid out
        (B, S, H, D) (:func:`_gradient_like`); dbias (B, H, Sq, Sk) float32, the gradient of
        the bias added to each logit (0 where masked), with ``bias_grad``, else an empty (0,);
        drel (B, H, Sq + Sk - 1) float32, ``[b, h, t] = Σ_i dbias[b, h, i, t - Sq + 1 + i]``, with
        ``rel_grad``, else an empty (0,).
    """
    _check_backward(dout, q, k, v, lse, delta, mask, window)
    blocks = _tiles(q, k, mask, tiles, partial, bq, bk)
    lib = loader.require()
    wide = _wide(q.dtype)
    biases = loops.Logits(bias=bias, relative=rel_bias)
    if wide == torch.float64 and (biases.any() or bias_grad or rel_grad):
        raise ValueError("bias and rel_bias run in the float32 kernels only (the forward refuses them in float64)")
    if blocks is not None and wide == torch.float64:
        mask, blocks = blocks.dense(q.shape[2], k.shape[2]), None
    b, h, sq, d = q.shape
    hkv, sk, dv_ = k.shape[1], k.shape[2], v.shape[-1]
    q_, k_, v_, do_ = (_rows(t.to(wide)) for t in (q, k, v, dout))
    lse_, delta_ = lse.to(wide).contiguous(), delta.to(wide).contiguous()
    mask, mstrides = _mask_strides(mask, (b, h, sq, sk))
    dq, dk, dv = (_gradient_like(t, wide) for t in (q, k, v))  # (half precision: rounded to it below)
    common = (ptr(q_), ptr(k_), ptr(v_), ptr(do_), ptr(lse_), ptr(delta_), ptr(mask), ptr(dq), ptr(dk), ptr(dv),
              (b, h, hkv, sq, sk, d, dv_), (*_strides(q_, k_, v_, do_, dq, dk, dv), *mstrides),
              float(scale), int(causal), int(window or 0))
    # the kernel writes all of it
    dbias = torch.empty((b, h, sq, sk) if bias_grad else (0,), dtype=torch.float32, device=q.device)
    drel = torch.empty((b, h, sq + sk - 1) if rel_grad else (0,), dtype=torch.float32, device=q.device)
    if wide == torch.float64:
        code = lib.mh_attention_backward_f64(*common, torch.get_num_threads())  # type: ignore[attr-defined]
    else:
        tile_args = (None, (), None) if blocks is None else blocks.arguments()
        bias_ptr, bias_strides, keep = loops.bias_arguments(biases, b, h, sq, sk)
        if (bias_grad or rel_grad) and bias_ptr is None:
            raise ValueError("bias_grad and rel_grad need the forward's bias or rel_bias, got neither")
        code = lib.mh_attention_backward_f32(*common, *tile_args, bias_ptr, bias_strides,  # type: ignore[attr-defined]
                                             ptr(dbias) if bias_grad else None, ptr(drel) if rel_grad else None,
                                             torch.get_num_threads())
        del keep
    _check(code, "attention backward")
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias, drel


def _check_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                    mask: Optional[Tensor], window: Optional[int]) -> None:
    """The backward's tensors checked before the kernel reads them: q, k, v and the mask as the
    forward's, dout (B, H, Sq, Dv), lse and delta (B, H, Sq), all floating CPU tensors."""
    loops.check_operator_inputs(q, k, v, mask, window)
    b, h, sq, _ = q.shape
    for name, t, shape in (("dout", dout, (b, h, sq, v.shape[-1])), ("lse", lse, (b, h, sq)),
                           ("delta", delta, (b, h, sq))):
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point or t.device.type != "cpu" \
                or tuple(t.shape) != shape:
            got = f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating CPU tensor {list(shape)}, got {got}")


@attention_backward.register_fake
def _attention_backward_fake(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, delta: Tensor,
                             mask: Optional[Tensor], scale: float, causal: bool, window: Optional[int],
                             tiles: Optional[Tensor] = None, partial: Optional[Tensor] = None, bq: int = 0,
                             bk: int = 0, bias: Optional[Tensor] = None, rel_bias: Optional[Tensor] = None,
                             bias_grad: bool = False, rel_grad: bool = False
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    dbias = q.new_empty((b, h, sq, sk) if bias_grad else (0,), dtype=torch.float32)
    drel = q.new_empty((b, h, sq + sk - 1) if rel_grad else (0,), dtype=torch.float32)
    return _gradient_like(q), _gradient_like(k), _gradient_like(v), dbias, drel  # the real strides (.to keeps them)


#: The operator ``multihead::attention``'s inputs, in order (its autograd reads them by name).
_INPUTS = ("q", "k", "v", "mask", "scale", "causal", "window", "decode", "softcap", "alibi_slopes", "sinks",
           "cu_seqlens", "tiles", "partial", "bq", "bk", "bias", "rel_bias")
_BIAS, _REL_BIAS = _INPUTS.index("bias"), _INPUTS.index("rel_bias")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    given = dict(zip(_INPUTS, (*inputs, *(None,) * (len(_INPUTS) - len(inputs)))))
    named = [name for name in ("softcap", "alibi_slopes", "sinks", "cu_seqlens") if given[name] is not None]
    if named:  # the backward would compute another function's gradients: refused (the registry refuses first)
        raise ValueError(f"the native backward does not apply {', '.join(named)}: compute gradients with "
                         "backend='explicit' or 'sdpa' (or 'auto', which routes there)")
    out, lse = output
    ctx.save_for_backward(given["q"], given["k"], given["v"], out, lse, given["mask"], given["tiles"],
                          given["partial"], given["bias"], given["rel_bias"])
    ctx.structure = (given["scale"], given["causal"], given["window"])
    ctx.block_size = (given["bq"] or 0, given["bk"] or 0)


def _backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, mask, tiles, partial, bias, rel_bias = ctx.saved_tensors
    wide = _wide(q.dtype)
    # dout's rows made contiguous (if they are not) before delta's sums, which then run in one order
    # for every layout: the gradients do not depend on dout's strides (bitwise).
    dout = torch.zeros_like(out) if dout is None else _rows(dout)
    delta = (dout.to(wide) * out.to(wide)).sum(-1)  # (B, H, Sq): Σ_t dO·O
    if dlse is not None:
        delta = delta - dlse.to(wide)  # lse's own gradient: ds += p · dlse
    needs = (*ctx.needs_input_grad, *(False,) * len(_INPUTS))  # (trailing inputs left at their defaults: none)
    want_bias, want_relative = bias is not None and needs[_BIAS], rel_bias is not None and needs[_REL_BIAS]
    dq, dk, dv, dbias, drel = torch.ops.multihead.attention_backward(
        dout, q, k, v, lse, delta, mask, *ctx.structure, tiles, partial, *ctx.block_size, bias, rel_bias,
        bool(want_bias), bool(want_relative))
    grads: list[Tensor | None] = [dq, dk, dv, *(None,) * (len(_INPUTS) - 3)]
    if want_bias:
        grads[_BIAS] = dbias.sum_to_size(bias.shape).to(bias.dtype)
    if want_relative:
        grads[_REL_BIAS] = drel.sum_to_size(rel_bias.shape).to(rel_bias.dtype)
    return tuple(grads[:len(ctx.needs_input_grad)])


attention.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("multihead::decode_step", mutates_args=("cache_k", "cache_v"))
def decode_step(x: Tensor, weights: list[Tensor], biases: list[Optional[Tensor]], cos: Optional[Tensor],
                sin: Optional[Tensor], rotary_dim: int, interleaved: bool, cache_k: Tensor, cache_v: Tensor,
                lengths: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                q_norm: Optional[Tensor] = None, k_norm: Optional[Tensor] = None, norm_eps: float = 0.0,
                norm_mode: int = 0, window: Optional[int] = None) -> Tensor:
    """A whole decoding step (:func:`multihead.backends.native.decode_step`): ``y (B, E)``.

    Writes each row's new K and V into ``cache_k``/``cache_v`` (B, Hkv, C, D) at slot
    ``lengths[b]``; ``lengths`` is read, never written (the caller commits it). A QK-norm per
    head: its q and k weights (D,), eps and mode (:data:`.step.NORM_MODES`); ``norm_mode`` 0: none.
    ``window``: a sliding window (a linear cache's keys), or None.
    """
    rope = None if cos is None or sin is None else (cos, sin, rotary_dim, interleaved)
    norm = None
    if norm_mode or q_norm is not None or k_norm is not None:  # all of them, or the check refuses them
        norm = (q_norm, k_norm, norm_eps, norm_mode)
    return step.decode_step(x, list(zip(weights, biases)), num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, rope=rope, cache_k=cache_k, cache_v=cache_v, lengths=lengths,
                            scale=scale, norm=norm, window=window)  # type: ignore[arg-type]


@decode_step.register_fake
def _decode_step_fake(x: Tensor, weights: list[Tensor], biases: list[Optional[Tensor]], cos: Optional[Tensor],
                      sin: Optional[Tensor], rotary_dim: int, interleaved: bool, cache_k: Tensor, cache_v: Tensor,
                      lengths: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                      q_norm: Optional[Tensor] = None, k_norm: Optional[Tensor] = None, norm_eps: float = 0.0,
                      norm_mode: int = 0, window: Optional[int] = None) -> Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("multihead::linear_few_rows", mutates_args=())
def linear_few_rows(x: Tensor, weights: list[Tensor], biases: list[Optional[Tensor]]) -> list[Tensor]:
    """``[x · wᵀ + b for w, b in zip(weights, biases)]`` for few rows of x
    (:func:`multihead.backends.native.linear_few_rows`): x (M, K), M at most
    :data:`multihead.backends.native.MAX_STEP_ROWS`; one (M, N_i) tensor per weight (N_i, K). The operator that
    ``torch.compile`` keeps in its graphs where eager calls run the function itself."""
    if len(weights) != len(biases):
        raise ValueError(f"biases must have one entry per weight ({len(weights)}), got {len(biases)}")
    return step.linear_few_rows(x, list(zip(weights, biases)))


@linear_few_rows.register_fake
def _linear_few_rows_fake(x: Tensor, weights: list[Tensor], biases: list[Optional[Tensor]]) -> list[Tensor]:
    return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]


def prepare(q: Tensor, k: Tensor, v: Tensor, decode: bool | None = None) -> Prepared:
    """The native loop for one call signature (these shapes and dtype; no logit feature, lse,
    gradient or dropout; any bool mask), made once (:class:`.attention.PlainCall`): what :func:`run`
    would run for such a call, without its per-call choices. ``decode``: the decoding loop, the FlashAttention
    loop, or None: :func:`.attention.decoding_loop_fits`. The function it
    returns gives None (the caller then runs the general path) where :func:`direct` says the
    operator must be seen (a compiler, a dispatch mode, the profiler) or a last dimension is strided."""
    if decode is None:
        decode = loops.decoding_loop_fits(q, k)
    call = loops.PlainCall(q, k, v, decode)

    def run_prepared(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool,
                     window: Optional[int], mask: Optional[Tensor] = None) -> Optional[Tensor]:
        return call(q, k, v, scale, causal, window, mask) if direct(q, k, v, mask) else None

    return run_prepared


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool, window: int | None,
        mask: torch.Tensor | None, return_lse: bool = False, decode: bool | None = None,
        softcap: float | None = None, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None, tiles: loops.Tiles | None = None,
        bias: torch.Tensor | None = None, relative: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The native loop for these tensors (decoding loop for few rows per K/V head, else
    the FlashAttention loop), half precision read and written as such and computed in
    float32: ``(out, lse or None)``.

    The logit features and packed sequences (``cu_seqlens``, as structure: no key panel
    outside a query's sequences is computed) run in the FlashAttention loop only, so they
    take it whatever ``decode`` says. Runs the operator ``multihead::attention``
    (:data:`attention`): differentiable (the native backward) without them, traceable by
    ``torch.compile`` and ``torch.export``; in eager calls without gradients its body
    directly (:func:`direct`)."""
    plain = (softcap is None and alibi_slopes is None and sinks is None and cu_seqlens is None and tiles is None
             and bias is None and relative is None)
    if not plain:
        decode = False  # the decoding loop takes none of them (nor a block mask, nor a bias)
    elif decode is None and not symbolic(q, k):
        decode = loops.decoding_loop_fits(q, k)
    # symbolic sizes (torch.export with a Dim, torch.compile(dynamic=True)): None, the operator chooses
    if not direct(q, k, v, mask, alibi_slopes, sinks, cu_seqlens, bias, relative):
        blocks = (None, None, 0, 0) if tiles is None else tiles
        out, lse = torch.ops.multihead.attention(q, k, v, mask, float(scale), bool(causal), window, decode,
                                                 None if softcap is None else float(softcap), alibi_slopes, sinks,
                                                 cu_seqlens, *blocks, bias, relative)
        return out, (lse if return_lse else None)
    # the operator's body, without its dispatch
    if tiles is not None:
        tiles.check(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return forward(q, k, v, mask, float(scale), bool(causal), window, decode, softcap, alibi_slopes, sinks, cu_seqlens,
                   return_lse=return_lse, tiles=tiles, bias=bias, relative=relative)
