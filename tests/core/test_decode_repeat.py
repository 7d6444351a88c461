"""A plain cached call after a fused step skips its checks only while nothing they read has
changed (``multihead.decode.repeat_step``): every change a check could see makes the next
call ask them all again, and that call then does exactly what it did before this shortcut
existed (the same numbers as the step-by-step path, or the same refusal, the cache
untouched)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import record_ops
from torch import nn
from torch.nn import functional as F

import multihead as mh
from multihead import decode
from multihead.backends import native

pytestmark = pytest.mark.skipif(native.vector_bits() < 256,
                                reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")


def _layer(**kw) -> mh.MultiHeadAttention:
    torch.random.default_generator.manual_seed(0)
    return mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, rope=mh.RoPE(16), **kw).eval()


def _stepped(max_len: int = 32) -> tuple[mh.MultiHeadAttention, mh.KVCache, torch.Tensor]:
    """A layer and its cache after a prefill of 8 and one fused (checked) step, cropped back
    to 8: the cache holds a plan that remembers its checks. Returns (layer, cache, token)."""
    layer = _layer()
    cache = layer.new_cache(2, max_len)
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        layer(x[:, :8], cache=cache)
        layer(x[:, 8:], cache=cache)
    cache.crop(8)
    assert cache.fused.guard is not None
    return layer, cache, x[:, 8:]


def _stepwise(layer: mh.MultiHeadAttention, cache: mh.KVCache, token: torch.Tensor) -> torch.Tensor:
    """The call by the step-by-step path (positions given: never fused), on a copy of the cache."""
    twin = mh.KVCache(cache.batch_size, cache.max_len, layer.num_kv_heads, layer.head_dim, dtype=cache.dtype)
    for name in ("k", "v", "lengths", "slot_pos"):
        getattr(twin, name).copy_(getattr(cache, name))
    twin._host_lengths = cache.host_lengths()
    with torch.no_grad():
        return layer(token, cache=twin, positions=cache.lengths[:, None].clone())


def _linear_times_two(proj: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: 2 * F.linear(t, proj.weight, proj.bias)


def _global_hook() -> Iterator[None]:
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    yield
    handle.remove()


def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    yield
    torch.set_num_threads(before)


def _tensor_scale_changed_in_place(layer: mh.MultiHeadAttention, cache: mh.KVCache) -> None:
    """A 0-d tensor scale, a checked step with it, then the same tensor changed in place."""
    layer.scale = torch.tensor(0.25)
    with torch.no_grad():
        layer(torch.randn(2, 1, 64), cache=cache)  # asks every check (the scale is new): remembered
        cache.crop(8)
        assert decode.repeat_step(layer, torch.randn(2, 1, 64), cache) is not None  # remembered indeed
    cache.crop(8)
    layer.scale.fill_(0.1)


class _Sub(nn.Linear):
    pass


def _swap_class(proj: nn.Module) -> None:
    proj.__class__ = _Sub


# Changes after which the next plain call must ask every check again and then compute what
# the step-by-step path computes. Each takes (at: the layer, c: its cache) and changes one thing in place;
# a generator is a change undone after the call.
CHANGES: dict[str, Callable[[mh.MultiHeadAttention, mh.KVCache], object]] = {
    "a weight replaced": lambda at, c: setattr(at.q_proj, "weight", nn.Parameter(torch.randn(64, 64) / 8)),
    "a weight's .data replaced": lambda at, c: setattr(at.o_proj.weight, "data", at.o_proj.weight.data * 2),
    "a weight's .data made strided": lambda at, c: setattr(at.v_proj.weight, "data",
                                                          at.v_proj.weight.data.t().contiguous().t()),
    "a bias where there was none": lambda at, c: setattr(at.k_proj, "bias", nn.Parameter(torch.randn(32))),
    "the logit scale": lambda at, c: setattr(at, "scale", 0.2),
    "a tensor logit scale changed in place": _tensor_scale_changed_in_place,
    "a sliding window": lambda at, c: setattr(at, "window", 4),
    "soft-capping": lambda at, c: setattr(at, "softcap", 5.0),
    "another backend": lambda at, c: setattr(at, "backend", "explicit"),
    "a forward hook on a projection": lambda at, c: at.o_proj.register_forward_hook(lambda m, i, o: 2 * o),
    "a forward pre-hook on a projection": lambda at, c: at.q_proj.register_forward_pre_hook(
        lambda m, i: (2 * i[0],)),
    "a global forward hook": lambda at, c: _global_hook(),
    "a projection's own forward": lambda at, c: setattr(at.o_proj, "forward", _linear_times_two(at.o_proj)),
    "a projection replaced by a subclass": lambda at, c: _swap_class(at.k_proj),
    "other RoPE tables": lambda at, c: setattr(at, "rope", mh.RoPE(16, max_positions=64, base=500.0)),
    "a RoPE table too short for the position": lambda at, c: setattr(at, "rope", mh.RoPE(16, max_positions=8)),
    "the RoPE's pairing": lambda at, c: setattr(at.rope, "interleaved", True),
    "a layer buffer (ALiBi slopes)": lambda at, c: at.register_buffer("alibi_slopes", torch.full((4,), 0.5)),
    "the thread count": lambda at, c: _threads(torch.get_num_threads() % 2 + 1),  # 1 <-> 2
    "the cache's K buffer replaced": lambda at, c: setattr(c, "k", c.k.clone()),
    "the cache's V buffer restrided": lambda at, c: setattr(c, "v", c.v.transpose(2, 3).contiguous().transpose(2, 3)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_change_a_check_reads_makes_the_next_call_ask_them_all(change: str) -> None:
    layer, cache, token = _stepped()
    undo = CHANGES[change](layer, cache)
    if isinstance(undo, Iterator):
        next(undo)
    try:
        with torch.no_grad():
            assert decode.repeat_step(layer, token, cache) is None  # nothing done
            assert cache.host_lengths() == [8, 8]
            expected = _stepwise(layer, cache, token)
            got = layer(token, cache=cache)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert cache.host_lengths() == [9, 9]
    finally:
        if isinstance(undo, Iterator):
            next(undo, None)


def test_with_nothing_changed_the_next_calls_skip_the_checks_and_equal_the_step_by_step_path(monkeypatch) -> None:
    layer, cache, token = _stepped()
    asked: list[int] = []
    real = decode.why_not_fused

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        asked.append(1)
        return real(*args, **kwargs)

    for n in range(3):
        nxt = torch.randn_like(token)
        expected = _stepwise(layer, cache, nxt)  # asks (and is refused): not counted
        monkeypatch.setattr(decode, "why_not_fused", counted)
        with torch.inference_mode():
            got = layer(nxt, cache=cache)
        monkeypatch.undo()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert cache.host_lengths() == [9 + n] * 2 and cache.lengths.tolist() == [9 + n] * 2
    assert asked == []  # not once: each call repeated the checked step
    monkeypatch.setattr(decode, "why_not_fused", counted)
    layer.scale = 0.3  # a change: asked again once, then repeated again
    with torch.no_grad():
        layer(token, cache=cache), layer(token, cache=cache)
    assert asked == [1]


def test_a_full_cache_is_refused_as_before_and_left_untouched() -> None:
    layer, cache, token = _stepped(max_len=10)
    with torch.no_grad():
        layer(token, cache=cache), layer(token, cache=cache)  # the second by repeat_step: 10 of 10
        before = [t.clone() for t in (cache.k, cache.v, cache.lengths, cache.slot_pos)]
        with pytest.raises(ValueError, match="cache overflow"):
            layer(token, cache=cache)
    assert cache.host_lengths() == [10, 10]
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.k, cache.v, cache.lengths, cache.slot_pos)))


@pytest.mark.parametrize("call", ["another layer", "another dtype", "another width", "another batch",
                                  "not a KVCache", "with gradients", "x requiring grad"])
def test_calls_the_checks_refuse_are_refused_as_before(call: str) -> None:
    layer, cache, token = _stepped()
    before = [t.clone() for t in (cache.k, cache.v, cache.lengths, cache.slot_pos)]
    other = _layer()
    calls: dict[str, tuple[Callable[[], object], type[Exception], str]] = {
        "another layer": (lambda: other(token, cache=cache), ValueError, "belongs to another layer"),
        "another dtype": (lambda: layer(token.double(), cache=cache), TypeError, "dtype"),
        "another width": (lambda: layer(token[..., :32], cache=cache), ValueError, "last dim 64"),
        "another batch": (lambda: layer(token[:1], cache=cache), ValueError, "batch_size 2"),
        "not a KVCache": (lambda: layer(token, cache=object()), TypeError, "cache must be a multihead.KVCache"),
    }
    if call == "with gradients":
        with pytest.raises(ValueError, match="is for inference"):
            layer(token, cache=cache)  # grad mode on, the weights require grad
    elif call == "x requiring grad":  # frozen weights: the fused step would have dropped x's gradient silently
        layer.requires_grad_(False)
        with pytest.raises(ValueError, match="is for inference"):
            layer(token.clone().requires_grad_(), cache=cache)
    else:
        run, error, message = calls[call]
        with torch.no_grad(), pytest.raises(error, match=message):
            run()
    assert cache.host_lengths() == [8, 8]
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.k, cache.v, cache.lengths, cache.slot_pos)))


def test_a_weight_of_the_wrong_shape_is_refused_not_read_out_of_bounds() -> None:
    layer, cache, token = _stepped()
    layer.o_proj.weight.data = torch.randn(64, 32)
    assert "not of the layer's shape" in decode.why_not_fused(layer, token, cache)
    before = [t.clone() for t in (cache.k, cache.v, cache.lengths, cache.slot_pos)]
    with torch.no_grad(), pytest.raises(ValueError, match=r"weight must be \(N, 64\), got \[64, 32\]"):
        layer(token, cache=cache)  # the step-by-step path's own refusal
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.k, cache.v, cache.lengths, cache.slot_pos)))


def test_a_projections_own_forward_is_run_by_every_path() -> None:
    """An instance ``forward`` (as some adapters assign) is the module's behaviour: neither the
    fused step nor the faster GEMM of the step-by-step path may bypass it."""
    layer, cache, token = _stepped()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        plain_full, plain_step = layer(x), _stepwise(layer, cache, token)
        layer.o_proj.forward = _linear_times_two(layer.o_proj)
        torch.testing.assert_close(layer(x), 2 * plain_full)
        torch.testing.assert_close(layer(token, cache=cache), 2 * plain_step, atol=1e-5, rtol=1e-5)


def test_head_capture_and_dispatch_modes_see_the_call() -> None:
    """A head capture attached to the layer, and a TorchDispatchMode (fake tensors, recorders,
    tracing), each get the call as they did before: never the shortcut."""
    layer, cache, token = _stepped()
    with torch.no_grad(), record_ops() as seen:
        assert decode.repeat_step(layer, token, cache) is None
        layer(token, cache=cache)
    assert "multihead.decode_step.default" in seen.ops and cache.host_lengths() == [9, 9]
    cache.crop(8)
    model = nn.Sequential(layer)
    with torch.no_grad(), mh.heads.capture(model) as cap:
        layer(token, cache=cache)
    assert cap.weights, "the capture recorded nothing"
