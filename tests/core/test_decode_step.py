"""The fused decoding step is inspectable: each condition, one at a time, makes
``why_not_fused`` name it; with all of them met the step runs and equals the
step-by-step path. The cache's counters have one writer, ``KVCache.commit``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import record_ops
from torch import nn

import multihead as mh
from multihead import decode
from multihead.backends import native
from multihead.module import Watch

FUSED = native.vector_bits() >= 256  # AVX-512 or AVX2


def _watched(layer: mh.MultiHeadAttention) -> mh.MultiHeadAttention:
    """The layer as a trace or a capture leaves it while watching (its steps report)."""
    layer.watch = Watch(lambda name, t: None, weights=False)
    return layer


def _layer(**kw) -> mh.MultiHeadAttention:
    torch.random.default_generator.manual_seed(0)
    return mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, rope=mh.RoPE(16), **kw).eval()


def _prefilled(layer: mh.MultiHeadAttention, b: int = 2, **cache_kw) -> tuple[mh.KVCache, torch.Tensor]:
    cache = layer.new_cache(b, 32, **cache_kw)
    x = torch.randn(b, 9, 64, dtype=layer.q_proj.weight.dtype)
    with torch.no_grad():
        layer(x[:, :8], cache=cache)
    return cache, x[:, 8:]


class _Sub(nn.Linear):
    pass


# (condition's reason fragment, how to break only that condition): each returns (layer, x, cache, call kwargs).
BREAKS: dict[str, Callable[[], tuple]] = {
    "not one new token per row": lambda: (lambda lay: (lay, torch.randn(2, 2, 64), _prefilled(lay)[0], {}))(_layer()),
    "more than": lambda: (lambda lay: (lay, torch.randn(native.MAX_STEP_ROWS + 1, 1, 64),
                                       _prefilled(lay, native.MAX_STEP_ROWS + 1)[0], {}))(_layer()),
    "key_mask given": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _prefilled(lay)[0],
                                            {"key_mask": torch.ones(2, 1, dtype=torch.bool)}))(_layer()),
    "positions given": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _prefilled(lay)[0],
                                             {"positions": torch.tensor([8])}))(_layer()),
    "context given": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _prefilled(lay)[0],
                                           {"context": torch.randn(2, 3, 64)}))(_layer()),
    "weights asked for": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _prefilled(lay)[0],
                                               {"return_weights": True}))(_layer()),
    "a mask_mod, block_mask, bias or score_mod given": lambda: (lambda lay: (
        lay, torch.randn(2, 1, 64), _prefilled(lay)[0], {"mask_mod": lambda b, h, q, kv: kv >= 0}))(_layer()),
    "the layer is watched": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _prefilled(lay)[0], {}))(
        _watched(_layer())),
    "soft-capping, ALiBi or sinks": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _prefilled(lay)[0], {}))(
        _layer(softcap=30.0)),
    "QK-norm is not one the step computes": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _prefilled(lay)[0], {}))(
        (lambda lay: (setattr(lay.k_norm, "eps", 1e-3), lay)[1])(_layer(qk_norm="head"))),
    "a ring cache": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _ring_cache_without_window(lay), {}))(_layer()),
    "dropout in training mode": lambda: (lambda lay: (lay.train(), torch.randn(2, 1, 64), _prefilled(lay)[0], {}))(
        _layer(dropout=0.1)),
    "a backend other than": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _prefilled(lay)[0], {}))(
        _layer(backend="sdpa")),
    "not float32, bfloat16 or float16": lambda: (lambda lay: (lay, torch.randn(2, 1, 64, dtype=torch.float64),
                                                              _prefilled(lay)[0], {}))(_layer(dtype=torch.float64)),
    "not of the input's dtype": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _half_cache(lay), {}))(_layer()),
    "not on the CPU": lambda: (lambda lay: (lay, torch.empty(2, 1, 64, device="meta"), _prefilled(lay)[0], {}))(
        _layer()),
    "K and V buffers": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _strided_cache(lay), {}))(_layer()),
    "not a plain contiguous nn.Linear": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _prefilled(lay)[0], {}))(
        _with_subclassed_projection(_layer())),
    "not of the layer's shape": lambda: _narrow_weight_after_prefill(),
    "RoPE is not a plain": lambda: (lambda lay: (lay, torch.randn(2, 1, 64), _prefilled(lay)[0], {}))(
        mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, rope=mh.RoPE(16, max_positions=8)).eval()),
}


def _ring_cache_without_window(layer: mh.MultiHeadAttention) -> mh.KVCache:
    cache = layer.new_cache(2, 32)
    cache.ring = True  # as a ring cache of another (windowed) layer would be
    return cache


def _half_cache(layer: mh.MultiHeadAttention) -> mh.KVCache:
    cache, _ = _prefilled(layer)
    cache.k, cache.v = cache.k.bfloat16(), cache.v.bfloat16()  # a float32 layer's cache, made bfloat16
    return cache


def _strided_cache(layer: mh.MultiHeadAttention) -> mh.KVCache:
    cache, _ = _prefilled(layer)
    cache.v = cache.v.transpose(2, 3).contiguous().transpose(2, 3)  # same values, other strides
    return cache


def _with_subclassed_projection(layer: mh.MultiHeadAttention) -> mh.MultiHeadAttention:
    sub = _Sub(64, 64)
    sub.load_state_dict(layer.o_proj.state_dict())
    layer.o_proj = sub
    return layer


def _narrow_weight_after_prefill() -> tuple:
    layer = _layer()
    cache, token = _prefilled(layer)
    layer.o_proj.weight.data = torch.randn(64, 32)  # (E, E/2): not the (E, H·D) the kernel would read
    return layer, token, cache, {}


def test_every_condition_has_a_case_here() -> None:
    reasons = [r for r, _ in decode.FUSED_CONDITIONS]
    assert len(reasons) == len(set(reasons))
    for reason in reasons[:-1]:  # the last one (the kernel is built) is the machine's, tested below
        assert any(key in reason for key in BREAKS), reason


@pytest.mark.skipif(not FUSED, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
@pytest.mark.parametrize("reason", list(BREAKS))
def test_each_condition_alone_makes_it_say_why_not(reason: str) -> None:
    layer, x, cache, call = BREAKS[reason]()
    got = decode.why_not_fused(layer, x, cache, **call)
    assert got is not None and reason in got, got


@pytest.mark.skipif(not FUSED, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
@pytest.mark.parametrize("rows", [2, 5, native.MAX_STEP_ROWS])
def test_with_every_condition_met_the_step_runs_and_equals_the_step_by_step_path(rows: int) -> None:
    """From 1 to MAX_STEP_ROWS (8) rows: the GEMV's row counts as constants, 5 to 8 in fewer weight
    rows a pass."""
    layer = _layer()
    cache, token = _prefilled(layer, rows)
    twin = _layer()
    twin_cache, _ = _prefilled(twin, rows)
    assert decode.why_not_fused(layer, token, cache) is None
    with torch.no_grad():
        fused = layer(token, cache=cache)
        stepwise = twin(token, cache=twin_cache, positions=torch.tensor([8]))  # positions: not fused
    torch.testing.assert_close(fused, stepwise, atol=1e-5, rtol=1e-5)
    assert cache.host_lengths() == twin_cache.host_lengths() == [9] * rows
    assert torch.equal(cache.lengths, twin_cache.lengths) and torch.equal(cache.slot_pos, twin_cache.slot_pos)
    torch.testing.assert_close(cache.k, twin_cache.k, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not FUSED, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [1, 3, 9, 40])
def test_a_sliding_window_is_fused_on_a_linear_cache_and_equals_the_step_by_step_path(window: int,
                                                                                     dtype: torch.dtype) -> None:
    """A windowed layer (Mistral, Gemma 2/3, Cohere 2, EXAONE 4) on a linear cache: the fused step
    attends to each row's last ``window`` keys, as the step-by-step path does, over several steps
    that carry the cache past the window; a ring cache stays refused by name."""
    layer = _layer(window=window, dtype=dtype)
    cache, _ = _prefilled(layer, ring=False)
    twin = _layer(window=window, dtype=dtype)  # the same weights and prompt (the seed is set again)
    twin_cache, _ = _prefilled(twin, ring=False)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for step in range(4):
        token = torch.randn(2, 1, 64, dtype=dtype)
        assert decode.why_not_fused(layer, token, cache) is None
        with torch.no_grad():
            got = layer(token, cache=cache)
            want = twin(token, cache=twin_cache, positions=torch.tensor([8 + step]))  # positions: not fused
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if window < 12 and dtype == torch.float32:  # a planted difference: the step must see the window (12 keys held)
        layer.window = None
        cache.crop(11)
        with torch.no_grad():
            assert (layer(token, cache=cache) - got).abs().max() > 10 * tol
    ring_layer = _layer(window=4)
    assert "a ring cache" in decode.why_not_fused(ring_layer, torch.randn(2, 1, 64), _prefilled(ring_layer)[0])


#: QK-norms the fused step computes (per head, before or after RoPE, Gemma's 1 + w), each with weights
#: far from one so that a norm skipped, misplaced or read as the other's fails.
NORMS = {"head": {"qk_norm": "head"}, "head_after_rope": {"qk_norm": "head_after_rope"},
         "head, offset": {"qk_norm": "head", "norm_offset": True, "norm_eps": 1e-5},
         "proj": {"qk_norm": "proj"}, "proj, offset": {"qk_norm": "proj", "norm_offset": True}}


def _normed_layer(norm: str, dtype: torch.dtype = torch.float32) -> mh.MultiHeadAttention:
    layer = _layer(**NORMS[norm], dtype=dtype)
    with torch.no_grad():
        layer.q_norm.weight.copy_(torch.rand(layer.q_norm.weight.numel()) * 2 + 0.5)  # D, or H·D across heads
        layer.k_norm.weight.copy_(torch.rand(layer.k_norm.weight.numel()) * 3 - 1)
    return layer


@pytest.mark.skipif(not FUSED, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", list(NORMS))
def test_a_qk_norm_per_head_is_fused_and_equals_the_step_by_step_path(norm: str, dtype: torch.dtype) -> None:
    """Qwen3's, Gemma 3's and HunYuan's QK-norm run inside the fused step: the outputs and the
    cached (normed, rotated) keys equal the step-by-step path's; the norm changes the output."""
    layer = _normed_layer(norm, dtype)
    cache, token = _prefilled(layer)
    assert decode.why_not_fused(layer, token, cache) is None
    expected = _stepwise(layer, cache, token)
    with torch.no_grad():
        got = layer(token, cache=cache)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    slot = cache.k[:, :, 8]  # (B, Hkv, D): the new token's key, normed then rotated (or the other way)
    twin = _normed_layer(norm, dtype)
    twin_cache, _ = _prefilled(twin)
    with torch.no_grad():
        twin(token, cache=twin_cache, positions=torch.tensor([8]))
    torch.testing.assert_close(slot, twin_cache.k[:, :, 8], atol=tol, rtol=tol)
    with torch.no_grad():  # a planted difference: the step must see the norm's weight
        layer.k_norm.weight.copy_(-layer.k_norm.weight - (2 if layer.k_norm.offset else 0))  # k's scale negated:
        # every logit's sign flipped
        cache.crop(8)
        assert (layer(token, cache=cache) - got).abs().max() > 10 * tol


@pytest.mark.skipif(not FUSED, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
def test_a_qk_norm_the_kernel_cannot_run_as_it_is_is_not_fused() -> None:
    """A hooked norm, norms of two eps, or a weight of another dtype: the step-by-step path, by name."""
    cases = [lambda lay: lay.q_norm.register_forward_hook(lambda m, a, out: out),
             lambda lay: setattr(lay.k_norm, "eps", 1e-3),
             lambda lay: setattr(lay.q_norm, "weight", nn.Parameter(lay.q_norm.weight.detach().double()))]
    for change in cases:
        layer = _normed_layer("head")
        cache, token = _prefilled(layer)
        change(layer)
        assert "QK-norm is not one the step computes" in decode.why_not_fused(layer, token, cache)


def _stepwise(layer: mh.MultiHeadAttention, cache: mh.KVCache, token: torch.Tensor) -> torch.Tensor:
    """The step by the step-by-step path (positions given: never fused), on a copy of the cache."""
    twin = mh.KVCache(cache.batch_size, cache.max_len, layer.num_kv_heads, layer.head_dim, dtype=cache.dtype)
    twin.k.copy_(cache.k), twin.v.copy_(cache.v), twin.lengths.copy_(cache.lengths), twin.slot_pos.copy_(cache.slot_pos)
    twin._host_lengths = cache.host_lengths()
    with torch.no_grad():
        return layer(token, cache=twin, positions=cache.lengths[:, None].clone())


@pytest.mark.skipif(not FUSED, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
def test_the_steps_marshalled_arguments_follow_every_tensor_they_point_into() -> None:
    """The eager step's plan (its C arguments, kept on the cache) is reused while nothing it
    points into changes, and remade when a weight is replaced or moved, the RoPE tables are
    replaced, the thread count, the layer's scale or its QK-norm changes: each step equals the
    step-by-step path."""
    layer = _normed_layer("head")
    cache, token = _prefilled(layer)
    # (change, whether the plan must be remade)
    changes: list[tuple[Callable[[], object], bool]] = [
        (lambda: None, False),
        (lambda: setattr(layer.q_proj, "weight", nn.Parameter(torch.randn(64, 64) / 8)), True),  # replaced
        (lambda: layer.v_proj.weight.data.copy_(torch.randn(32, 64) / 8), False),  # in place: new values
        (lambda: setattr(layer.o_proj.weight, "data", layer.o_proj.weight.data.clone() * 2), True),  # moved
        (lambda: setattr(layer.k_proj, "bias", nn.Parameter(torch.randn(32))), True),  # a bias where none was
        (lambda: (delattr(layer.q_proj, "weight"), setattr(layer.q_proj, "weight", torch.randn(64, 64) / 8)),
         True),  # a plain tensor attribute where the parameter was (found by attribute, not the registry)
        (lambda: torch.set_num_threads(torch.get_num_threads() % 2 + 1), True),  # 1 <-> 2
        (lambda: setattr(layer, "scale", 0.2), True),  # the layer's logit scale reassigned
        (lambda: setattr(layer, "rope", mh.RoPE(16, max_positions=64)), True),  # new tables
        (lambda: setattr(layer.k_norm, "weight", nn.Parameter(torch.rand(16) + 0.5)), True),  # the norm's weight
        (lambda: layer.q_norm.weight.data.mul_(1.5), False),  # in place: new values
        (lambda: [setattr(norm, "eps", 0.5) for norm in (layer.q_norm, layer.k_norm)], True),  # both norms' eps
    ]
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            layer(token, cache=cache)
        cache.crop(8)
        for change, remade in changes:
            before = cache.fused
            change()
            expected = _stepwise(layer, cache, token)
            with torch.no_grad():
                got = layer(token, cache=cache)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert (cache.fused is not before) == remade
            cache.crop(8)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not FUSED, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
@pytest.mark.parametrize("table", ["float64", "strided", "sin of another length"])
def test_rope_tables_the_kernel_cannot_read_as_they_are_are_not_fused(table: str) -> None:
    layer = _layer()
    cache, token = _prefilled(layer)
    rope = layer.rope
    if table == "float64":
        rope.cos = rope.cos.double()
    elif table == "strided":
        rope.cos = torch.stack([rope.cos, rope.cos], -1)[..., 0]  # the same values, every other float
    else:
        rope.sin = rope.sin[:-1]
    assert "the RoPE is not a plain" in decode.why_not_fused(layer, token, cache)


def test_without_the_kernel_it_says_so(monkeypatch) -> None:
    monkeypatch.setattr(native, "vector_bits", lambda: 0)
    layer = _layer()
    cache, token = _prefilled(layer)
    assert "not compiled here" in decode.why_not_fused(layer, token, cache)


# ---- one writer of the counters -------------------------------------------------------------
def test_append_stages_and_only_commit_advances_the_counters() -> None:
    layer = _layer(backend="explicit")
    cache = layer.new_cache(2, 16)
    k = torch.randn(2, 2, 3, 16)
    step = cache.append(k, k, None, structure=mh.Structure(causal=True))
    assert cache.host_lengths() == [0, 0] and cache.lengths.tolist() == [0, 0]
    assert (cache.slot_pos == -1).all()
    cache.commit(step)
    assert cache.host_lengths() == [3, 3] and cache.lengths.tolist() == [3, 3]
    assert cache.slot_pos[:, :3].tolist() == [[0, 1, 2], [0, 1, 2]]


def test_rollback_restores_the_cache_bitwise() -> None:
    layer = _layer(backend="explicit")
    cache = layer.new_cache(2, 16)
    first = torch.randn(2, 2, 5, 16)
    cache.commit(cache.append(first, first, None, structure=mh.Structure(causal=True)))
    before = [t.clone() for t in (cache.k, cache.v, cache.lengths, cache.slot_pos)]
    step = cache.append(torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16), [2, 1], structure=mh.Structure(True))
    cache.rollback(step)
    for a, b in zip(before, (cache.k, cache.v, cache.lengths, cache.slot_pos)):
        assert torch.equal(a, b)
    assert cache.host_lengths() == [5, 5]


def test_commit_of_counts_is_one_in_order_token_per_row_of_a_linear_cache() -> None:
    layer = _layer()
    cache = layer.new_cache(2, 8)
    cache.commit([1, 1])
    assert cache.host_lengths() == [1, 1] and cache.slot_pos[:, 0].tolist() == [0, 0]
    with pytest.raises(ValueError, match="one in-order token per row"):
        cache.commit([2, 1])
    with pytest.raises(ValueError, match="2 counts"):
        cache.commit([1])
    assert cache.host_lengths() == [1, 1]
    for _ in range(7):
        cache.commit([1, 1])
    before = [t.clone() for t in (cache.lengths, cache.slot_pos)]
    with pytest.raises(ValueError, match="already holds max_len=8"):  # full: refused, whichever writer
        cache.commit([1, 1])
    assert cache.host_lengths() == [8, 8] and all(torch.equal(a, b) for a, b in zip(before, (cache.lengths,
                                                                                          cache.slot_pos)))


def _counters_after_two_steps(monkeypatch: pytest.MonkeyPatch, *, native_writer: bool) -> tuple[list, list[bool]]:
    """A 3-row cache of lengths 3, 1, 2, then commit([1, 1, 1]) twice: (counters, what the native writer returned)."""
    cache = mh.KVCache(3, 8, 2, 4)
    k = torch.randn(3, 2, 3, 4)
    cache.commit(cache.append(k, k, [3, 1, 2], structure=mh.Structure(causal=True)))
    if not native_writer:
        monkeypatch.setattr(native.loader, "counter_writer", None)  # as before the library is loaded
    wrote: list[bool] = []
    real = native.advance_counters
    monkeypatch.setattr(native, "advance_counters", lambda *a: wrote.append(real(*a)) or wrote[-1])
    cache.commit([1, 1, 1])
    cache.commit([1, 1, 1])
    monkeypatch.undo()
    return [cache.lengths.tolist(), cache.slot_pos.tolist(), cache.host_lengths()], wrote


def test_commit_writes_the_counters_in_one_native_call_as_the_torch_operations_would(monkeypatch) -> None:
    assert native.build(), native.status()
    fast, wrote = _counters_after_two_steps(monkeypatch, native_writer=True)
    slow, not_written = _counters_after_two_steps(monkeypatch, native_writer=False)
    assert wrote == [True, True] and not_written == [False, False]  # each path taken where it should be
    assert fast == slow == [[5, 3, 4], [[0, 1, 2, 3, 4, -1, -1, -1], [0, 1, 2, -1, -1, -1, -1, -1],
                                        [0, 1, 2, 3, -1, -1, -1, -1]], [5, 3, 4]]


def test_the_native_counter_writer_refuses_a_full_row_and_writes_nothing() -> None:
    assert native.build(), native.status()
    lengths, slot_pos = torch.tensor([1, 4]), torch.full((2, 4), -1)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 4\)"):
        native.advance_counters(lengths, slot_pos)
    assert lengths.tolist() == [1, 4] and (slot_pos == -1).all()


def test_the_native_counter_writer_steps_aside_for_dispatch_modes_and_odd_tensors() -> None:
    """Under a TorchDispatchMode (fake tensors, recorders) the writes must be operators it sees;
    tensors it cannot write in place (not int64, not CPU-contiguous rows) go to torch too."""
    assert native.build(), native.status()
    cache = mh.KVCache(2, 4, 1, 2)
    with record_ops() as seen:
        cache.commit([1, 1])
    assert seen.ops and cache.lengths.tolist() == [1, 1] and cache.slot_pos[:, 0].tolist() == [0, 0]
    assert not native.advance_counters(torch.zeros(2, dtype=torch.int32), torch.full((2, 4), -1))
    assert not native.advance_counters(torch.zeros(2, dtype=torch.int64), torch.full((4, 2), -1).t())


def test_a_failing_backend_leaves_the_cache_as_it_was(monkeypatch) -> None:
    """The module writes the cache only when the whole call succeeds (failure inside the backend)."""
    from multihead.backends import registry

    layer = _layer(backend="explicit")
    cache, token = _prefilled(layer)
    before = [t.clone() for t in (cache.k, cache.v, cache.lengths, cache.slot_pos)]

    def boom(*a, **k):
        raise MemoryError("simulated: the weights could not be allocated")

    spec = registry.get_spec("explicit")
    import dataclasses
    monkeypatch.setitem(registry._SPECS, "explicit", dataclasses.replace(spec, fn=boom))
    with torch.no_grad(), pytest.raises(MemoryError):
        layer(torch.randn(2, 3, 64), cache=cache)
    for a, b in zip(before, (cache.k, cache.v, cache.lengths, cache.slot_pos)):
        assert torch.equal(a, b)
    assert cache.host_lengths() == [8, 8]


def test_from_config_builds_the_layer_a_config_describes() -> None:
    cfg = mh.AttentionConfig(embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2, causal=True,
                             rope_base=10000.0, bias=False)
    layer = mh.MultiHeadAttention.from_config(cfg)
    assert (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.causal) == (4, 2, 16, True)
    assert layer.rope is not None and layer.q_proj.bias is None
    assert mh.MultiHeadAttention.from_config(cfg).num_kv_heads == 2
    with pytest.raises(TypeError, match="AttentionConfig"):
        mh.MultiHeadAttention.from_config({"embed_dim": 64})


@pytest.mark.skipif(not FUSED, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
def test_a_copied_cache_decodes_into_its_own_buffers() -> None:
    """A cache copied after fused steps (deepcopy, as beam search or a user might) does not
    carry the original's marshalled pointers: its steps write its own buffers, the original
    is untouched, and both continue alike."""
    import copy

    layer = _layer()
    cache, token = _prefilled(layer)
    with torch.no_grad():
        layer(token, cache=cache)  # a fused step: the cache now holds a plan
        twin = copy.deepcopy(cache)
        before = cache.k.clone()
        nxt = torch.randn_like(token)
        got = layer(nxt, cache=twin)
        assert torch.equal(cache.k, before) and cache.host_lengths() == [9, 9]
        assert cache.lengths.tolist() == [9, 9] and twin.lengths.tolist() == [10, 10]  # counters of its own
        assert (cache.slot_pos[:, 9] == -1).all() and (twin.slot_pos[:, 9] == 9).all()
        torch.testing.assert_close(got, layer(nxt, cache=cache), atol=0, rtol=0)
    assert twin.fused is not cache.fused
    assert torch.equal(cache.lengths, twin.lengths) and torch.equal(cache.slot_pos, twin.slot_pos)


def _step_arguments(layer: mh.MultiHeadAttention) -> dict:
    projs = [layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj]
    return dict(num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
                rope=(layer.rope.cos, layer.rope.sin, layer.rope.rotary_dim, layer.rope.interleaved),
                scale=float(layer.scale), layers=[(p.weight.detach(), p.bias.detach()) for p in projs])


@pytest.mark.skipif(not FUSED, reason=f"no AVX-512 or AVX2 native kernel here ({native.status()})")
@pytest.mark.parametrize("window", [None, 6])
def test_row_starts_give_the_step_of_the_rows_held_from_slot_0(window: int | None) -> None:
    """Left padding: row b's tokens in slots starts[b] .. lengths[b] - 1, NaN in the slots before
    (never read), positions counted from the start; the step equals that of the same tokens held
    from slot 0 (rows 0, 7 and 12 slots of padding, one of them 1 real token; with a window of 6
    too). Starts past a row's new token are refused before anything is written."""
    torch.random.default_generator.manual_seed(3)
    layer = mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, rope=mh.RoPE(16), window=window).eval()
    starts, real = torch.tensor([0, 7, 12]), torch.tensor([20, 18, 1])
    lengths = starts + real
    k, v = (torch.randn(3, 2, 40, 16) for _ in range(2))
    padded_k, padded_v = (torch.full_like(t, float("nan")) for t in (k, v))
    for b in range(3):
        padded_k[b, :, starts[b]:lengths[b]] = k[b, :, :real[b]]
        padded_v[b, :, starts[b]:lengths[b]] = v[b, :, :real[b]]
    x, kw = torch.randn(3, 64), _step_arguments(layer)
    with torch.no_grad():
        got = native.decode_step(x, cache_k=padded_k, cache_v=padded_v, lengths=lengths, starts=starts,
                                 window=window, **kw)
        want = native.decode_step(x, cache_k=k, cache_v=v, lengths=real, window=window, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for b in range(3):  # the new token's K and V written at the row's slot lengths[b]
        torch.testing.assert_close(padded_k[b, :, lengths[b]], k[b, :, real[b]], atol=0, rtol=0)
    before = padded_k.clone()
    with pytest.raises(ValueError, match=r"starts must lie in \[0, lengths\[b\]\]"):
        native.decode_step(x, cache_k=padded_k, cache_v=padded_v, lengths=lengths, starts=lengths + 1, **kw)
    assert torch.equal(padded_k.nan_to_num(), before.nan_to_num())
