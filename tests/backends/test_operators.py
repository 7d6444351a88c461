"""The native kernels as PyTorch operators: opcheck, torch.compile, torch.export.

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads, D head_dim.

Every registered operator passes ``torch.library.opcheck`` (schema, fake tensors,
autograd registration); the layer compiles with ``fullgraph=True`` on each path of
the issue (prefill, causal, GQA, RoPE, key padding, cached decoding, training) with no
graph break in ``MultiHeadAttention.forward`` and the eager numbers within the accuracy
criterion; ``torch.export`` captures prefill with a dynamic sequence length.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from conftest import LAYOUTS, as_layout
from torch.export import Dim

import multihead as mh
from multihead import native
from multihead.backends.auto import auto_path

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler: " + native.status())


@pytest.fixture(autouse=True)
def _no_compile_cache() -> Iterator[None]:
    """Compile afresh: Inductor's caches are keyed without our operators' fake implementations,
    so graphs compiled by an older multihead (in the shared cache folder) would be reused with
    that version's output strides."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield

#: compiled vs eager float32: the two differ only by rounding (fused elementwise kernels, summation order).
ATOL = 2e-5


def _qkv(b: int = 1, h: int = 4, hkv: int = 2, sq: int = 20, sk: int = 33, d: int = 16, dv: int = 16,
         dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(b, h, sq, d, dtype=dtype), torch.randn(b, hkv, sk, d, dtype=dtype),
            torch.randn(b, hkv, sk, dv, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("masked, causal, window, decode", [(False, False, None, False), (True, True, None, False),
                                                            (False, True, 5, True), (True, False, 3, True)])
def test_opcheck_attention(dtype: torch.dtype, masked: bool, causal: bool, window: int | None, decode: bool) -> None:
    q, k, v = (t.requires_grad_(dtype != torch.bfloat16) for t in _qkv(dtype=dtype))
    mask = torch.rand(1, 1, 20, 33) < 0.7 if masked else None
    torch.library.opcheck(torch.ops.multihead.attention.default, (q, k, v, mask, 0.25, causal, window, decode))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck_attention_backward(layout: str, dtype: torch.dtype) -> None:
    """Strided q, k, v and dout too: the fake gives the real gradients' strides (the inputs' where
    dense, else (B, S, H, D))."""
    q, k, v = _qkv(sk=20, dtype=dtype)  # Sq = Sk: "packed" slices one buffer
    out, lse = torch.ops.multihead.attention(q, k, v, None, 0.25, True, None, False)
    dout = torch.randn_like(out)
    delta = (dout * out).sum(-1)
    q, k, v = as_layout(layout, q, k, v)
    dout = as_layout("transposed" if layout == "packed" else layout, dout)[0]
    torch.library.opcheck(torch.ops.multihead.attention_backward.default,
                          (dout, q, k, v, lse, delta, None, 0.25, True, None))


def test_opcheck_onednn_linear() -> None:
    """The projections' oneDNN GEMM as an operator (what compiled layers call)."""
    x, w, b = torch.randn(3, 5, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True), torch.randn(4)
    torch.library.opcheck(torch.ops.multihead.linear.default, (x, w, b.requires_grad_()))
    torch.library.opcheck(torch.ops.multihead.linear.default, (x, w, None))


def test_opcheck_decode_step() -> None:
    layer = mh.MultiHeadAttention(64, 4, num_kv_heads=2, rope=mh.RoPE(16, 10000.0), causal=True)
    cache = layer.new_cache(2, 16)
    projs = [layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj]
    args = (torch.randn(2, 64), [p.weight.detach() for p in projs], [p.bias.detach() for p in projs],
            layer.rope.cos, layer.rope.sin, 16, False, cache.k, cache.v, cache.lengths, 4, 2, 16, 0.25)
    torch.library.opcheck(torch.ops.multihead.decode_step.default, args)
    norm = (torch.rand(16) + 0.5, torch.rand(16) + 0.5, 1e-6, 1)  # a QK-norm per head, before RoPE
    torch.library.opcheck(torch.ops.multihead.decode_step.default, args + norm)


@pytest.mark.parametrize("window", [3, 40], ids=["window 3 of 7 keys", "window 40 over 16 slots"])
def test_opcheck_decode_step_with_a_window(window: int) -> None:
    """The window as the traced fused step passes it (a keyword), on rows holding 7 and 2 keys:
    a window shorter than the first row, and one longer than the whole cache."""
    layer = mh.MultiHeadAttention(64, 4, num_kv_heads=2, rope=mh.RoPE(16, 10000.0), causal=True, window=window)
    cache = layer.new_cache(2, 16, ring=False)
    with torch.no_grad():
        layer(torch.randn(2, 7, 64), cache=cache)
    cache.crop([7, 2])
    projs = [layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj]
    args = (torch.randn(2, 64), [p.weight.detach() for p in projs], [p.bias.detach() for p in projs],
            layer.rope.cos, layer.rope.sin, 16, False, cache.k, cache.v, cache.lengths, 4, 2, 16, 0.25)
    torch.library.opcheck(torch.ops.multihead.decode_step.default, args, {"window": window})


def _layer(**kw: object) -> mh.MultiHeadAttention:
    return mh.MultiHeadAttention(128, 8, num_kv_heads=2, causal=True, rope=mh.RoPE(16, 10000.0), **kw).eval()


def _key_mask(b: int, s: int) -> torch.Tensor:
    key_mask = torch.ones(b, s, dtype=torch.bool)
    key_mask[1, s // 2:] = False
    return key_mask


def _no_breaks(fn: object, *args: object, **kwargs: object) -> None:
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("kind", ["causal-gqa-rope", "bidirectional", "cross"])
def test_compiled_prefill_matches_eager_with_no_graph_break(amd_cpu, kind: str, padded: bool) -> None:
    """S = 256, 8 heads: "auto" takes the native FlashAttention loop (2^20 scores: at
    the threshold of AVX2 builds, above that of AVX-512 builds)."""
    layer = _layer() if kind == "causal-gqa-rope" else mh.MultiHeadAttention(128, 8).eval()
    x = torch.randn(2, 256, 128)
    kw: dict = {"key_mask": _key_mask(2, 256)} if padded else {}
    if kind == "cross":
        kw["context"] = torch.randn(2, 256, 128)
    with torch.no_grad():
        kv = torch.empty(2, layer.num_kv_heads, 256, 16)
        assert auto_path(torch.empty(2, 8, 256, 16), kv, kv) == "native"
        want = layer(x, **kw)
        got = torch.compile(layer, fullgraph=True)(x, **kw)
        _no_breaks(layer, x, **kw)
    assert (got - want).abs().max() <= ATOL


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The operators a call dispatches (the top level only: not what runs inside them)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_prefill_runs_the_eager_kernels_and_nothing_else(amd_cpu, causal: bool) -> None:
    """The benchmark's compiled prefill (here smaller: 2^20 scores, the native loop) is
    the eager layer's four oneDNN GEMMs and one native attention call, on the same
    strided views: no copy, no layout change, no kernel of Inductor's own. Compiled
    can then only differ from eager by fixed per-call costs, not by work."""
    from torch._inductor.utils import run_and_get_code

    layer = mh.MultiHeadAttention(256, 8, causal=causal).eval()
    x = torch.randn(2, 256, 256)  # 512 × 256 × 256 multiply-adds: above mh.linear.SMALL_GEMM (oneDNN's GEMMs)
    with torch.no_grad():
        with _OpLog() as log:
            want = layer(x)
        torch._dynamo.reset()
        got, codes = run_and_get_code(torch.compile(layer, fullgraph=True), x)
    kernels = [op for op in log.ops if op not in ("aten.view", "aten.transpose", "aten.reshape",
                                                  "aten._unsafe_view", "aten.permute", "aten.detach", "aten.t")]
    if not mh.backends.gemm.onednn_available():  # MULTIHEAD_GEMM=torch: F.linear's GEMM, which Inductor calls itself
        assert kernels == ["aten.addmm"] * 3 + ["multihead.attention", "aten.addmm"]
        assert "\n".join(codes).count("torch.ops.multihead.attention.default(") == 1
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        return
    assert kernels == ["mkldnn._linear_pointwise"] * 3 + ["multihead.attention", "mkldnn._linear_pointwise"]
    code = "\n".join(codes)
    assert code.count("torch.ops.multihead.linear.default(") == 4
    assert code.count("torch.ops.multihead.attention.default(") == 1
    assert "cpp_fused" not in code and "extern_kernels" not in code.split("def call")[1]  # nothing of Inductor's
    assert torch.equal(got, want)  # the same kernels on the same data: bit for bit


def test_fused_step_is_the_operator_when_intercepted_and_the_kernel_itself_in_eager() -> None:
    """Eager, the fused step calls the kernel without the operator's Python dispatch (the
    profiler sees no ``multihead::decode_step``); under a dispatch mode (what tracing and fake
    tensors use) it is the operator, seen by the mode. Same output and cache, bit for bit."""
    from torch.profiler import profile

    layer = _layer()
    cache = layer.new_cache(2, 16)
    x = torch.randn(2, 1, 128)
    with torch.no_grad():
        layer(torch.randn(2, 5, 128), cache=cache)
        reason = mh.decode.why_not_fused(layer, x, cache)
        assert reason in (None, "the native kernel is not compiled here for AVX-512 or AVX2")
        with profile() as prof:
            eager = layer(x, cache=cache)
        written = (cache.k.clone(), cache.v.clone(), cache.slot_pos.clone())
        cache.crop(5)
        with _OpLog() as log:
            intercepted = layer(x, cache=cache)
    assert torch.equal(eager, intercepted) and cache.host_lengths() == [6, 6]
    assert all(torch.equal(a, b) for a, b in zip(written, (cache.k, cache.v, cache.slot_pos)))
    fused = reason is None
    assert ("multihead.decode_step" in log.ops) == fused
    assert not any(e.name == "multihead::decode_step" for e in prof.events())


@pytest.mark.parametrize("backend", ["native", None])
def test_compiled_training_matches_eager_gradients(backend: str | None) -> None:
    """Forward and backward compiled; "native" runs the native backward inside the graph."""
    layer = _layer(backend=backend).train()
    x = torch.randn(2, 96, 128, requires_grad=True)
    layer(x).square().sum().backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    x.grad = None
    torch.compile(layer, fullgraph=True)(x).square().sum().backward()
    got = [x.grad] + [p.grad for p in layer.parameters()]
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= ATOL * max(1.0, w.abs().max().item())
    _no_breaks(layer, x)


def test_compiled_cached_decoding_matches_eager_and_compiles_twice() -> None:
    """Prefill then single-token steps through the in-place cache, compiled with
    fullgraph=True: one graph for the prompt, one for the fused decoding step
    (``multihead::decode_step``, which writes the cache), reused at every length."""
    layer = _layer()
    prompt, steps = torch.randn(2, 12, 128), [torch.randn(2, 1, 128) for _ in range(6)]
    torch._dynamo.reset()
    with torch.no_grad():
        eager_cache, compiled_cache = layer.new_cache(2, 32), layer.new_cache(2, 32)
        want = [layer(prompt, cache=eager_cache)] + [layer(s, cache=eager_cache) for s in steps]
        compiled = torch.compile(layer, fullgraph=True)
        from torch._dynamo.utils import counters
        counters.clear()
        got = [compiled(prompt, cache=compiled_cache)] + [compiled(s, cache=compiled_cache) for s in steps]
        assert counters["stats"]["unique_graphs"] == 2
    assert compiled_cache.host_lengths() == eager_cache.host_lengths() == [18, 18]
    assert torch.equal(compiled_cache.lengths, eager_cache.lengths)
    assert (compiled_cache.k[:, :, :18] - eager_cache.k[:, :, :18]).abs().max() <= ATOL
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= ATOL
    assert mh.decode.why_not_fused(layer, steps[0], compiled_cache) is None  # the fused step is what ran
    with torch.no_grad():
        _no_breaks(layer, steps[0], cache=compiled_cache)


def test_compiled_fused_step_with_a_sliding_window_equals_the_step_by_step_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer with window=3 on a linear cache, its step compiled with fullgraph=True: the traced
    fused step (``multihead::decode_step``, given the layer's window) over steps that carry each
    row past the window, one graph at every length, equals the eager step-by-step path."""
    layer = _layer(window=3)
    prompt, steps = torch.randn(2, 5, 128), [torch.randn(2, 1, 128) for _ in range(3)]
    windows: list[int | None] = []
    real = native.step.decode_step  # the operator's body (what the compiled graph calls)
    monkeypatch.setattr(native.step, "decode_step", lambda *a, **kw: windows.append(kw["window"]) or real(*a, **kw))
    torch._dynamo.reset()
    with torch.no_grad():
        cache, plain = layer.new_cache(2, 16, ring=False), layer.new_cache(2, 16, ring=False)
        for c in (cache, plain):
            layer(prompt, cache=c)
        assert mh.decode.why_not_fused(layer, steps[0], cache) is None
        # dynamic: the cache's length symbolic from the first step (else a second graph at the second)
        compiled = torch.compile(layer, fullgraph=True, dynamic=True)
        from torch._dynamo.utils import counters
        counters.clear()
        got = [compiled(s, cache=cache) for s in steps]
        assert counters["stats"]["unique_graphs"] == 1
        want = [layer(s, cache=plain, positions=torch.tensor([5 + i])) for i, s in enumerate(steps)]  # not fused
        layer.window = None  # planted: the last step without its window differs
        plain.crop(7)
        unwindowed = layer(steps[-1], cache=plain, positions=torch.tensor([7]))
    assert windows == [3] * len(steps)
    assert cache.host_lengths() == plain.host_lengths() == [8, 8]
    assert (cache.k[:, :, :8] - plain.k[:, :, :8]).abs().max() <= ATOL
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() <= ATOL
    assert (unwindowed - want[-1]).abs().max() > 100 * ATOL


@pytest.mark.parametrize("padded", [False, True])
def test_export_with_a_dynamic_sequence_length_runs_at_two_lengths(amd_cpu, padded: bool) -> None:
    layer = _layer()
    # From 256 positions (2^20 scores): native for the whole range with AVX-512 and AVX2 builds
    # alike (their thresholds, 2^14 and 2^20, become guards on the symbolic length).
    s = Dim("s", min=256, max=1024)
    x = torch.randn(2, 256, 128)
    args: tuple = (x,)
    kwargs = {"key_mask": _key_mask(2, 256)} if padded else {}
    shapes = {"x": {1: s}, "key_mask": {1: s}} if padded else {"x": {1: s}}
    with torch.no_grad():
        program = torch.export.export(layer, args, kwargs, dynamic_shapes=shapes)
        ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        assert "multihead.attention.default" in ops
        for length in (300, 417):
            x = torch.randn(2, length, 128)
            kw = {"key_mask": _key_mask(2, length)} if padded else {}
            got = program.module()(x, **kw)
            assert got.shape == (2, length, 128)
            assert (got - layer(x, **kw)).abs().max() <= ATOL


def _count(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the kernel calls (``native.attention.run_kernel``, and the prepared plain call
    ``PlainCall`` where it runs the kernel) by path: the operator's body always asks the kernel for
    the log-sum-exp (the operator returns it), the direct call only when its caller does (these
    tests' calls never do)."""
    from multihead.backends.native import attention as loops

    calls = {"direct": 0, "operator": 0}
    real, real_plain = loops.run_kernel, loops.PlainCall.__call__

    def counted(*args: object, **kwargs: object) -> object:
        # run_kernel(name, q, k, v, scale, causal, window, mask, lse, ...)
        calls["operator" if args[8] else "direct"] += 1
        return real(*args, **kwargs)

    def counted_plain(self: loops.PlainCall, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        out = real_plain(self, *args, **kwargs)
        calls["direct"] += out is not None
        return out

    monkeypatch.setattr(loops, "run_kernel", counted)
    monkeypatch.setattr(loops.PlainCall, "__call__", counted_plain)
    return calls


def test_eager_calls_without_gradients_skip_the_operators_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager and without gradients the kernel runs directly (the operator's Python dispatch costs
    tens of µs, a sizeable part of a small layer); the result is bitwise the operator's."""
    calls = _count(monkeypatch)
    q, k, v = _qkv()
    with torch.no_grad():
        direct = mh.attention(q, k, v, causal=True, backend="native")
    assert calls == {"direct": 1, "operator": 0}
    via_op = torch.ops.multihead.attention(q, k, v, None, q.shape[-1] ** -0.5, True, None, None)[0]  # its loop
    assert calls == {"direct": 1, "operator": 1}
    assert torch.equal(direct, via_op)
    mh.attention(q, k, v, backend="native")  # grad mode on, but nothing requires a gradient
    assert calls == {"direct": 2, "operator": 1}


def _prepared_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each call of a prepared plain call (``PlainCall``): whether it was given a mask."""
    from multihead.backends.native import attention as loops

    seen: list[bool] = []
    real = loops.PlainCall.__call__

    def recorded(self: loops.PlainCall, *args: Any) -> torch.Tensor | None:
        seen.append(len(args) > 6 and args[6] is not None)
        return real(self, *args)

    monkeypatch.setattr(loops.PlainCall, "__call__", recorded)
    return seen


@pytest.mark.parametrize("sq, sk, causal", [(20, 33, False), (1, 40, True), (24, 24, False)])
def test_masked_calls_take_the_prepared_call_bitwise(sq: int, sk: int, causal: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A call with a bool mask (key padding, broadcast or whole) and no gradient runs the signature's
    prepared call, through multihead.attention ("auto" and "native") and through "auto" as the layer
    calls it; its output is bitwise the general path's (the same kernel and arguments), the decoding
    loop's (one query) and the FlashAttention loop's alike."""
    from multihead.backends import get_backend
    from multihead.backends.native import attention as loops

    seen = _prepared_calls(monkeypatch)
    q, k, v = _qkv(b=2, sq=sq, sk=sk)
    masks = [torch.rand(2, 1, 1, sk) > 0.3, torch.rand(2, 4, sq, sk) > 0.5, torch.rand(sk) > 0.4]
    with torch.no_grad():
        for mask in masks:
            want = loops.run_kernel("mh_decode_f32" if loops.decoding_loop_fits(q, k) else "mh_attention_f32", q, k,
                                    v, 0.25, causal, None, mask, False,
                                    *(() if loops.decoding_loop_fits(q, k) else (loops.query_tile(),)))
            for backend in ("auto", "native"):
                seen.clear()
                got = mh.attention(q, k, v, mask=mask, causal=causal, scale=0.25, backend=backend)
                assert seen == [True], (backend, seen)
                assert torch.equal(got, want), backend
            seen.clear()
            four = mask[(None,) * (4 - mask.dim())]  # as the layer's checks give it
            got, _, _ = get_backend("auto")(q, k, v, mask=four, causal=causal, window=None, scale=0.25,
                                            dropout_p=0.0, return_weights=False, return_lse=False)
            assert seen == [True] and torch.equal(got, want)


def test_prepared_calls_are_only_for_plain_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights, the log-sum-exp, gradients, a logit feature or packed sequences never take a
    prepared call (each is a signature of its own), and neither does a block mask (not in the
    signature: checked per call); the layer's calls with key padding do, forward without gradients."""
    seen = _prepared_calls(monkeypatch)
    q, k, v = _qkv(b=2, sq=24, sk=24)
    mask = torch.rand(2, 1, 1, 24) > 0.3
    with torch.no_grad():
        mh.attention(q, k, v, mask=mask, return_lse=True)
        mh.attention(q, k, v, mask=mask, softcap=30.0)
        mh.attention(q, k, v, cu_seqlens=torch.tensor([0, 10, 24]))
        mh.attention(q, k, v, block_mask=mh.create_block_mask(lambda b, h, i, j: i >= j, 2, 4, 24, 24, block_size=32))
        assert seen == []
    mh.attention(q.requires_grad_(), k, v, mask=mask).sum().backward()
    assert seen == []
    layer = mh.MultiHeadAttention(64, 4).eval()
    x = torch.randn(2, 24, 64)
    with torch.no_grad():
        layer(x, key_mask=mask[:, 0, 0])
    assert seen == [True]


@pytest.mark.parametrize("watcher", ["grad", "profiler", "fake", "dispatch mode", "compile"])
def test_anything_that_watches_operators_sees_the_operator(watcher: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients, the profiler, dispatch modes (fake tensors) and torch.compile get the operator,
    never the direct call: it records the backward, shows in traces, and is traced."""
    q, k, v = _qkv()
    calls = _count(monkeypatch)
    operator_bodies = 1
    if watcher == "grad":
        q.requires_grad_(True)
        mh.attention(q, k, v, backend="native").sum().backward()
        assert q.grad is not None
    elif watcher == "profiler":
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            mh.attention(q, k, v, backend="native")
        assert "multihead::attention" in {e.name for e in prof.events()}
    elif watcher == "fake":  # the operator's fake implementation: no kernel runs on fake tensors
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode, torch.no_grad():
            out = mh.attention(*(mode.from_tensor(t) for t in (q, k, v)), backend="native")
        assert out.shape == q.shape
        operator_bodies = 0
    elif watcher == "dispatch mode":  # real tensors, a mode that records every operator
        from torch.utils._python_dispatch import TorchDispatchMode

        seen: list[str] = []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                seen.append(str(func))
                return func(*args, **(kwargs or {}))

        with Record(), torch.no_grad():
            mh.attention(q, k, v, backend="native")
        assert "multihead.attention.default" in seen, seen
    else:
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(lambda a, b, c: mh.attention(a, b, c, backend="native"), fullgraph=True)(q, k, v)
            torch.testing.assert_close(got, mh.attention(q, k, v, backend="native"), atol=ATOL, rtol=0)
        calls["direct"] -= 1  # the eager comparison's call
    assert calls == {"direct": 0, "operator": operator_bodies}
