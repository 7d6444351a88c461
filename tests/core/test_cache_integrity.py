"""A failed call never writes the KV cache; a cache belongs to one layer; crop takes any integer.

Notation: B batch, S new tokens, E embed_dim, C cache capacity.

Every failure after validation (inside the backend, in the allocator, in o_proj, in the
native decoding step) must leave the cache bitwise as it was: K, V, lengths, slot
positions and the host mirror. Each test makes a call fail at one point and compares a
full snapshot; the backend failures call the real backend first, so any staged write has
happened when they raise.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import multihead as mh
from multihead import decode
from multihead.cache import KVCache
from multihead.backends import registry
from multihead.backends.eager import explicit_attention

E, H = 16, 4


def snapshot(cache: mh.KVCache) -> tuple:
    """Everything a cache holds: K, V, lengths, slot positions, host lengths."""
    return (cache.k.clone(), cache.v.clone(), cache.lengths.clone(), cache.slot_pos.clone(), cache.host_lengths())


def assert_unchanged(cache: mh.KVCache, before: tuple) -> None:
    now = snapshot(cache)
    for name, a, b in zip(("k", "v", "lengths", "slot_pos"), before[:4], now[:4]):
        assert torch.equal(a, b), f"cache.{name} changed"
    assert before[4] == now[4], f"host lengths changed: {before[4]} -> {now[4]}"


class Boom(RuntimeError):
    pass


def failing_backend(exc: type[BaseException]) -> Callable:
    """The explicit backend, run to completion, then raising ``exc``."""
    def fn(q, k, v, **kw):
        explicit_attention(q, k, v, **kw)
        raise exc("the backend failed after running")
    return fn


@pytest.fixture(params=[Boom, MemoryError, KeyboardInterrupt], ids=["error", "memory", "interrupt"])
def failing(request, monkeypatch) -> str:
    """The name of a registered backend that fails after running (removed after the test)."""
    spec = registry.BackendSpec("failing", failing_backend(request.param), weights=True)
    monkeypatch.setitem(registry._SPECS, "failing", spec)
    return "failing"


def layer(**kw) -> mh.MultiHeadAttention:
    torch.random.default_generator.manual_seed(0)
    return mh.MultiHeadAttention(E, H, num_kv_heads=2, causal=True, **kw).eval()


# (id, layer settings, max_len, calls that succeed first (tokens per call), failing call: tokens, key_mask rows)
SCENARIOS = [
    ("prefill", {}, 16, [], 5, None),
    ("decode", {}, 16, [5], 1, None),
    ("chunk_after_prefill", {}, 16, [5], 3, None),
    ("padded_prefill", {}, 16, [], 4, [4, 2]),
    ("ring_token_wraps", {"window": 4}, 32, [4, 1], 1, None),
    ("ring_chunk_in_place", {"window": 8}, 32, [2], 3, None),
    ("ring_chunk_wraps", {"window": 4}, 32, [3], 3, None),
    ("ring_padded_chunk_wraps", {"window": 4}, 32, [3], 5, [5, 2]),
]


def prepared(settings: dict, max_len: int, warmup: list[int], backend: str | None = None):
    lay = layer(backend=backend, **settings)
    cache = lay.new_cache(2, max_len)
    for s in warmup:
        lay(torch.randn(2, s, E), cache=cache)
    return lay, cache


def failing_call_args(tokens: int, real: list[int] | None) -> dict:
    kw = {}
    if real is not None:
        kw["key_mask"] = torch.arange(tokens)[None, :] < torch.tensor(real)[:, None]  # right padded
    return {"x": torch.randn(2, tokens, E), **kw}


@torch.no_grad()
@pytest.mark.parametrize("settings, max_len, warmup, tokens, real", [s[1:] for s in SCENARIOS],
                         ids=[s[0] for s in SCENARIOS])
def test_a_backend_failing_after_it_ran_leaves_the_cache_unchanged(failing, settings, max_len, warmup, tokens,
                                                                   real) -> None:
    lay, cache = prepared(settings, max_len, warmup)
    assert cache.ring == ("window" in settings)
    before = snapshot(cache)
    lay.backend = failing
    call = failing_call_args(tokens, real)
    with pytest.raises((Boom, MemoryError, KeyboardInterrupt), match="failed after running"):
        lay(call.pop("x"), cache=cache, **call)
    assert_unchanged(cache, before)
    # and the cache still works: the same call through a working backend succeeds
    lay.backend = None
    lay(torch.randn(2, tokens, E), cache=cache, **call)
    assert cache.host_lengths() == [n + (tokens if real is None else r)
                                    for n, r in zip(before[4], real or [tokens, tokens])]


@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "chunk"])
def test_rows_of_different_lengths_write_by_scatter_and_a_failure_undoes_it(failing, tokens: int) -> None:
    """After a padded prefill the rows hold 4 and 2 tokens, so the next write goes to different
    slots per row (a scatter, not the one range of :meth:`KVCache._write_index`): a failure
    after it leaves the cache unchanged, and the same call through a working backend writes
    each row's slots."""
    lay, cache = prepared({}, 16, [])
    lay(**failing_call_args(4, [4, 2]), cache=cache)
    assert cache.host_lengths() == [4, 2]
    index = cache._write_index(cache.host_lengths(), cache.positions(tokens), tokens)
    assert isinstance(index, torch.Tensor)
    before = snapshot(cache)
    lay.backend = failing
    with pytest.raises((Boom, MemoryError, KeyboardInterrupt), match="failed after running"):
        lay(torch.randn(2, tokens, E), cache=cache)
    assert_unchanged(cache, before)
    lay.backend = None
    lay(torch.randn(2, tokens, E), cache=cache)
    assert cache.host_lengths() == [4 + tokens, 2 + tokens]
    assert torch.equal(cache.k[0, :, :4], before[0][0, :, :4]) and torch.equal(cache.k[1, :, :2], before[0][1, :, :2])
    assert not torch.equal(cache.k[1, :, 2:2 + tokens], before[0][1, :, 2:2 + tokens])


def test_rows_of_one_length_write_one_range_in_eager_mode() -> None:
    """Every row at the same length: the write is the range of slots (ring included, where it
    does not wrap); a range past the buffer is a scatter (the caller's room check refuses it)."""
    cache = KVCache(2, 16, num_kv_heads=2, head_dim=4)
    assert cache._write_index([5, 5], cache.positions(3) + 5, 3) == slice(5, 8)
    assert isinstance(cache._write_index([5, 3], cache.positions(3), 3), torch.Tensor)
    assert isinstance(cache._write_index([15, 15], cache.positions(3) + 15, 3), torch.Tensor)


@torch.no_grad()
@pytest.mark.parametrize("ring", [False, True], ids=["linear", "ring"])
def test_a_failing_output_projection_leaves_the_cache_unchanged(ring: bool) -> None:
    lay, cache = prepared({"window": 4} if ring else {}, 16, [5])

    def boom(module, args):
        raise Boom("o_proj failed after running")

    lay.o_proj.register_forward_pre_hook(boom)
    before = snapshot(cache)
    with pytest.raises(Boom):
        lay(torch.randn(2, 3, E), cache=cache)
    assert_unchanged(cache, before)


@torch.no_grad()
def test_weights_the_allocator_cannot_hold_leave_the_cache_unchanged() -> None:
    """A real allocation failure: weights of (1, 1, 2²³, 2²³) float32 take 256 TiB, more than
    any address space; the cache of 2²³ slots of head_dim 1 takes 64 MiB."""
    torch.random.default_generator.manual_seed(0)
    lay = mh.MultiHeadAttention(1, 1, head_dim=1, causal=True, bias=False).eval()
    s = 1 << 23
    cache = lay.new_cache(1, s)
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match="alloc|memory"):
        lay(torch.randn(1, s, 1), cache=cache, return_weights=True)
    assert_unchanged(cache, before)


@torch.no_grad()
def test_a_failing_fused_decoding_step_leaves_the_cache_unchanged(monkeypatch) -> None:
    lay, cache = prepared({}, 16, [5])
    x = torch.randn(2, 1, E)
    if decode.why_not_fused(lay, x, cache) is not None:
        # the step is not fused here (no AVX-512 kernel): the unfused call must hold too
        monkeypatch.setitem(registry._SPECS, "failing",
                            registry.BackendSpec("failing", failing_backend(MemoryError), weights=True))
        lay.backend = "failing"
    real_commit = KVCache.commit

    def commit_then_fail(self, step):  # after the step wrote K/V at the next slot
        if step == [1] * 2:  # the fused step's commit
            raise MemoryError("the native decoding step failed after running")
        real_commit(self, step)

    real_mirror = KVCache.mirror_step

    def mirror_then_fail(self, held, gained=1):  # the eager step's kernel wrote K/V and the counters
        if gained:
            raise MemoryError("the native decoding step failed after running")  # e.g. an interrupt as it returns
        real_mirror(self, held, gained)

    monkeypatch.setattr(KVCache, "commit", commit_then_fail)
    monkeypatch.setattr(KVCache, "mirror_step", mirror_then_fail)
    before = snapshot(cache)
    with pytest.raises(MemoryError, match="failed after running"):
        lay(x, cache=cache)
    assert_unchanged(cache, before)


def test_a_named_native_backend_that_is_off_leaves_the_cache_unchanged() -> None:
    """MULTIHEAD_NATIVE=0: backend="native" is refused, in a fresh process, before any write."""
    import subprocess
    import sys
    from pathlib import Path

    script = """
import torch, multihead as mh
torch.random.default_generator.manual_seed(0)
for window in (None, 4):
    lay = mh.MultiHeadAttention(16, 4, causal=True, window=window, backend="native").eval()
    cache = lay.new_cache(2, 16, ring=window is not None)
    with torch.no_grad():
        for s in (5, 1, 3):
            snap = (cache.k.clone(), cache.v.clone(), cache.lengths.clone(), cache.slot_pos.clone(),
                    cache.host_lengths())
            try:
                lay(torch.randn(2, s, 16), cache=cache)
            except ValueError as err:
                assert "MULTIHEAD_NATIVE=0" in str(err), err
            else:
                raise AssertionError("backend='native' ran with the kernel off")
            assert all(torch.equal(a, b) for a, b in zip(snap[:4], (cache.k, cache.v, cache.lengths, cache.slot_pos)))
            assert snap[4] == cache.host_lengths() == [0, 0]
print("ok")
"""
    root = Path(__file__).parents[2]
    env = {**__import__("os").environ, "MULTIHEAD_NATIVE": "0", "PYTHONPATH": str(root / "src")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# -- a cache belongs to one layer ----------------------------------------------------------
@torch.no_grad()
def test_a_cache_used_by_a_second_layer_is_refused_and_unchanged() -> None:
    first, second = layer(), layer()  # same shapes, same weights: only ownership tells them apart
    cache = first.new_cache(2, 16)
    first(torch.randn(2, 3, E), cache=cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="cache belongs to another layer"):
        second(torch.randn(2, 1, E), cache=cache)
    assert_unchanged(cache, before)
    first(torch.randn(2, 1, E), cache=cache)  # its own layer still uses it
    assert cache.host_lengths() == [4, 4]


@torch.no_grad()
def test_a_cache_made_directly_belongs_to_the_first_layer_that_uses_it() -> None:
    first, second = layer(), layer()
    cache = mh.KVCache(2, 16, 2, E // H)
    first(torch.randn(2, 2, E), cache=cache)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="cache belongs to another layer"):
        second(torch.randn(2, 1, E), cache=cache)
    assert_unchanged(cache, before)


# -- crop takes any integral number ---------------------------------------------------------
@pytest.mark.parametrize("n", [2, np.int64(2), np.int32(2), torch.tensor(2), [2, np.int16(2)], torch.tensor([2, 2])],
                         ids=["int", "np.int64", "np.int32", "tensor0d", "list", "tensor1d"])
def test_crop_takes_any_integral_number(n) -> None:
    lay = layer()
    cache = lay.new_cache(2, 8)
    with torch.no_grad():
        lay(torch.randn(2, 5, E), cache=cache)
    cache.crop(n)
    assert cache.host_lengths() == [2, 2] and cache.lengths.tolist() == [2, 2]


@pytest.mark.parametrize("n", [True, 2.0, "2", None, [2.5, 1]], ids=["bool", "float", "str", "none", "float_row"])
def test_crop_refuses_non_integral_numbers_by_name(n) -> None:
    cache = layer().new_cache(2, 8)
    with pytest.raises(TypeError, match="n must be an int"):
        cache.crop(n)
