"""The KV cache: incremental decoding equals the full forward; memory; errors lose nothing."""

from __future__ import annotations

import os

import pytest
import torch

import multihead as mh

os.environ.setdefault("HF_HUB_OFFLINE", "1")

E, H = 32, 4


def make_layer(num_kv_heads: int = H, *, rope: bool = True, window: int | None = None,
               causal: bool = True, dtype: torch.dtype = torch.float32, seed: int = 0) -> mh.MultiHeadAttention:
    torch.random.default_generator.manual_seed(seed)
    layer = mh.MultiHeadAttention(E, H, num_kv_heads=num_kv_heads, causal=causal, window=window,
                                  rope=mh.RoPE(E // H) if rope else None, dtype=dtype)
    return layer.eval()


def decode(layer: mh.MultiHeadAttention, x: torch.Tensor, prompt: int, *, ring: bool | None = None,
           max_len: int | None = None) -> torch.Tensor:
    """Prefill ``prompt`` tokens, then feed the rest one token at a time."""
    cache = layer.new_cache(x.shape[0], max_len or x.shape[1], ring=ring)
    outs = [layer(x[:, :prompt], cache=cache)]
    for t in range(prompt, x.shape[1]):
        outs.append(layer(x[:, t : t + 1], cache=cache))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "norope"])
@torch.no_grad()
def test_prefill_then_single_tokens_equals_full_causal_forward(num_kv_heads: int, rope: bool) -> None:
    layer = make_layer(num_kv_heads, rope=rope)
    x = torch.randn(3, 17, E)
    torch.testing.assert_close(decode(layer, x, prompt=6), layer(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("prompt", [1, 5, 16])
@torch.no_grad()
def test_prompt_length_does_not_change_the_result(prompt: int) -> None:
    layer = make_layer(2)
    x = torch.randn(2, 16, E)
    torch.testing.assert_close(decode(layer, x, prompt=prompt), layer(x), atol=1e-5, rtol=0)


@torch.no_grad()
def test_chunked_prefill_equals_full_forward() -> None:
    layer = make_layer(2)
    x = torch.randn(2, 15, E)
    cache = layer.new_cache(2, 15)
    out = torch.cat([layer(x[:, a:b], cache=cache) for a, b in ((0, 4), (4, 11), (11, 15))], dim=1)
    torch.testing.assert_close(out, layer(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@torch.no_grad()
def test_batch_of_prompts_with_different_lengths(num_kv_heads: int) -> None:
    """Right-padded prompts with key_mask; each row continues from its own length."""
    layer = make_layer(num_kv_heads)
    lengths, steps, pad_to = [7, 3, 5], 4, 7
    seqs = [torch.randn(1, n + steps, E) for n in lengths]
    prompt = torch.zeros(3, pad_to, E)
    key_mask = torch.zeros(3, pad_to, dtype=torch.bool)
    for b, n in enumerate(lengths):
        prompt[b, :n] = seqs[b][0, :n]
        key_mask[b, :n] = True
    cache = layer.new_cache(3, pad_to + steps)
    out = layer(prompt, cache=cache, key_mask=key_mask)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b, :n], layer(seqs[b])[0, :n], atol=1e-5, rtol=0)
    assert torch.isfinite(out).all()
    assert cache.host_lengths() == lengths
    for s in range(steps):
        token = torch.stack([seqs[b][0, n + s] for b, n in enumerate(lengths)])[:, None]  # (B, 1, E)
        step = layer(token, cache=cache)
        for b, n in enumerate(lengths):
            torch.testing.assert_close(step[b, 0], layer(seqs[b])[0, n + s], atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [n + steps for n in lengths]


@torch.no_grad()
def test_left_padded_key_mask_is_refused_with_a_cache() -> None:
    layer = make_layer()
    cache = layer.new_cache(2, 8)
    key_mask = torch.tensor([[False, True, True], [True, True, True]])
    with pytest.raises(ValueError, match="right-padded"):
        layer(torch.randn(2, 3, E), cache=cache, key_mask=key_mask)
    assert cache.host_lengths() == [0, 0]


@pytest.mark.parametrize("ring", [False, True], ids=["linear", "ring"])
@pytest.mark.parametrize("num_kv_heads", [4, 1], ids=["mha", "mqa"])
@torch.no_grad()
def test_sliding_window_decoding_equals_full_windowed_forward(ring: bool, num_kv_heads: int) -> None:
    layer = make_layer(num_kv_heads, window=4)
    x = torch.randn(2, 19, E)
    torch.testing.assert_close(decode(layer, x, prompt=7, ring=ring), layer(x), atol=1e-5, rtol=0)


@torch.no_grad()
def test_ring_cache_memory_is_bounded_by_the_window() -> None:
    layer = make_layer(2, window=4)
    cache = layer.new_cache(2, 1000)
    assert cache.ring and cache.capacity == 4
    assert cache.nbytes == 2 * 2 * 2 * 4 * (E // H) * 4
    x = torch.randn(2, 30, E)
    torch.testing.assert_close(decode(layer, x, prompt=3, max_len=1000), layer(x), atol=1e-5, rtol=0)


@torch.no_grad()
def test_ring_cache_with_padded_prompts() -> None:
    layer = make_layer(2, window=3)
    a, b = torch.randn(1, 10, E), torch.randn(1, 8, E)
    prompt = torch.zeros(2, 6, E)
    prompt[0], prompt[1, :4] = a[0, :6], b[0, :4]
    key_mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    cache = layer.new_cache(2, 12)
    out = layer(prompt, cache=cache, key_mask=key_mask)
    torch.testing.assert_close(out[0], layer(a)[0, :6], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[1, :4], layer(b)[0, :4], atol=1e-5, rtol=0)
    for s in range(4):
        step = layer(torch.stack([a[0, 6 + s], b[0, 4 + s]])[:, None], cache=cache)
        torch.testing.assert_close(step[0, 0], layer(a)[0, 6 + s], atol=1e-5, rtol=0)
        torch.testing.assert_close(step[1, 0], layer(b)[0, 4 + s], atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])
def test_nbytes_counts_only_kv_heads(num_kv_heads: int) -> None:
    layer = mh.MultiHeadAttention(64, 8, num_kv_heads=num_kv_heads, causal=True)
    b, max_len, d = 3, 50, 8
    cache = layer.new_cache(b, max_len)
    assert cache.nbytes == 2 * b * num_kv_heads * max_len * d * 4
    full = mh.MultiHeadAttention(64, 8, causal=True).new_cache(b, max_len)
    assert full.nbytes // cache.nbytes == 8 // num_kv_heads
    assert cache.k.shape == (b, num_kv_heads, max_len, d)


def test_new_cache_dtype_follows_the_layer_and_refuses_another() -> None:
    layer = make_layer(dtype=torch.float64)
    assert layer.new_cache(1, 4).dtype == torch.float64
    assert layer.new_cache(1, 4, dtype=torch.float64).nbytes == 2 * 1 * H * 4 * (E // H) * 8
    with pytest.raises(TypeError, match="dtype must be the layer's dtype"):
        layer.new_cache(1, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="device must be the layer's device"):
        layer.new_cache(1, 4, device="meta")


@torch.no_grad()
def test_crop_then_redecode_reproduces_the_outputs() -> None:
    layer = make_layer(2)
    x = torch.randn(2, 12, E)
    cache = layer.new_cache(2, 12)
    first = layer(x[:, :8], cache=cache)
    rejected = layer(torch.randn(2, 3, E), cache=cache)  # speculative tokens, then rejected
    assert cache.host_lengths() == [11, 11]
    cache.crop(8)
    assert cache.host_lengths() == [8, 8] and cache.lengths.tolist() == [8, 8]
    rest = torch.cat([layer(x[:, t : t + 1], cache=cache) for t in range(8, 12)], dim=1)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), layer(x), atol=1e-5, rtol=0)
    assert not torch.allclose(rejected, rest[:, :3])


@torch.no_grad()
def test_reset_starts_over() -> None:
    layer = make_layer()
    x = torch.randn(1, 6, E)
    cache = layer.new_cache(1, 6)
    layer(torch.randn(1, 4, E), cache=cache)
    cache.reset()
    assert cache.host_lengths() == [0]
    torch.testing.assert_close(decode_with(layer, cache, x), layer(x), atol=1e-5, rtol=0)


def decode_with(layer: mh.MultiHeadAttention, cache: mh.KVCache, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([layer(x[:, t : t + 1], cache=cache) for t in range(x.shape[1])], dim=1)


def _bad_calls() -> list:
    other_heads = mh.MultiHeadAttention(E, H, num_kv_heads=2, causal=True)
    return [
        ("overflow", lambda layer, c: layer(torch.randn(2, 5, E), cache=c), ValueError, "overflow"),
        ("batch", lambda layer, c: layer(torch.randn(3, 1, E), cache=c), ValueError, "batch"),
        ("heads", lambda layer, c: other_heads.eval()(torch.randn(2, 1, E), cache=c), ValueError, "K/V heads"),
        ("dtype", lambda layer, c: layer.double()(torch.randn(2, 1, E, dtype=torch.float64), cache=c),
         TypeError, "dtype"),
        ("mask", lambda layer, c: layer(torch.randn(2, 1, E), cache=c, mask=torch.ones(1, 1, 1, 5, dtype=torch.bool)),
         ValueError, "mask"),
        ("context", lambda layer, c: layer(torch.randn(2, 1, E), torch.randn(2, 3, E), cache=c), ValueError, "context"),
        ("not_a_cache", lambda layer, c: layer(torch.randn(2, 1, E), cache="cache"), TypeError, "cache"),
        ("key_mask_shape",
         lambda layer, c: layer(torch.randn(2, 2, E), cache=c, key_mask=torch.ones(2, 3, dtype=torch.bool)),
         ValueError, "key_mask"),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
@torch.no_grad()
def test_bad_call_raises_and_leaves_the_cache_unchanged(case) -> None:
    _, call, exc, match = case
    layer = make_layer()
    x = torch.randn(2, 8, E)
    cache = layer.new_cache(2, 8)
    layer(x[:, :4], cache=cache)
    k_before, v_before = cache.k.clone(), cache.v.clone()
    with pytest.raises(exc, match=match):
        call(make_layer(), cache)
    assert cache.host_lengths() == [4, 4] and cache.lengths.tolist() == [4, 4]
    assert torch.equal(cache.k, k_before) and torch.equal(cache.v, v_before)
    rest = decode_with(layer, cache, x[:, 4:])
    torch.testing.assert_close(rest, layer(x)[:, 4:], atol=1e-5, rtol=0)


def test_cache_with_gradients_enabled_is_refused() -> None:
    layer = make_layer()
    cache = layer.new_cache(1, 4)
    with pytest.raises(ValueError, match="no_grad"):
        layer(torch.randn(1, 2, E), cache=cache)
    assert cache.host_lengths() == [0]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"batch_size": 0, "max_len": 4}, ValueError, "batch_size"),
        ({"batch_size": 1, "max_len": -1}, ValueError, "max_len"),
        ({"batch_size": 1.5, "max_len": 4}, TypeError, "batch_size"),
        ({"batch_size": 1 << 20, "max_len": 1 << 30}, ValueError, "TiB"),
        ({"batch_size": 1, "max_len": 4, "dtype": torch.int32}, TypeError, "dtype"),
    ],
)
def test_new_cache_refuses_bad_sizes(kwargs, exc, match) -> None:
    with pytest.raises(exc, match=match):
        make_layer().new_cache(**kwargs)


def test_crop_refuses_bad_lengths() -> None:
    cache = make_layer().new_cache(2, 8)
    with pytest.raises(ValueError, match="n"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="one per row"):
        cache.crop([1, 2, 3])


@torch.no_grad()
def test_positions_override_the_cache_positions() -> None:
    """positions= replaces the RoPE positions a cached call would use."""
    layer = make_layer()
    x = torch.randn(1, 5, E)
    cache = layer.new_cache(1, 5)
    out = layer(x, cache=cache, positions=torch.arange(10, 15))
    torch.testing.assert_close(out, layer(x, positions=torch.arange(10, 15)), atol=1e-5, rtol=0)


# -- against Hugging Face -------------------------------------------------------------
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@torch.no_grad()
def test_matches_hf_llama_attention_with_dynamic_cache(attn_implementation: str) -> None:
    from transformers import DynamicCache, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, rope_theta=10000.0,
                         max_position_embeddings=64, num_hidden_layers=1, attention_bias=False)
    config._attn_implementation = attn_implementation
    torch.random.default_generator.manual_seed(0)
    hf = LlamaAttention(config, layer_idx=0).eval()
    rotary = LlamaRotaryEmbedding(config)
    ours = mh.MultiHeadAttention(64, 8, num_kv_heads=2, bias=False, causal=True, rope=mh.RoPE(8, 10000.0)).eval()
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        getattr(ours, name).weight.copy_(getattr(hf, name).weight)

    x = torch.randn(1, 12, 64)
    prompt = 5
    hf_cache = DynamicCache(config=config)
    cache = ours.new_cache(1, 12)
    for start, stop in [(0, prompt)] + [(t, t + 1) for t in range(prompt, 12)]:
        chunk = x[:, start:stop]
        pos = torch.arange(start, stop)[None]
        mask = None
        if stop - start > 1:
            blocked = torch.triu(torch.ones(stop - start, stop, dtype=torch.bool), diagonal=start + 1)
            mask = torch.zeros(1, 1, stop - start, stop).masked_fill(blocked, float("-inf"))
        expected, _ = hf(chunk, position_embeddings=rotary(chunk, pos), attention_mask=mask, cache=hf_cache)
        torch.testing.assert_close(ours(chunk, cache=cache), expected, atol=1e-5, rtol=1e-5)


def test_decoding_example_runs_and_matches_the_full_forward() -> None:
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[2] / "examples" / "decode.py"
    out = subprocess.run([sys.executable, str(script), "--layers", "2", "--prompt", "16", "--new", "4"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "ms/token" in out and "MiB" in out
    err = float(out.rsplit("=", 1)[1])
    assert err < 1e-4


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
@pytest.mark.parametrize("sq, sk", [(9, 9), (3, 11), (1, 7)])
def test_window_in_the_functional_core_equals_an_explicit_banded_mask(backend: str, sq: int, sk: int) -> None:
    torch.random.default_generator.manual_seed(0)
    q, k, v = torch.randn(2, 4, sq, 8), torch.randn(2, 2, sk, 8), torch.randn(2, 2, sk, 8)
    banded = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        pos = i + sk - sq  # bottom-right: the query's own position among the keys
        banded[i, max(0, pos - 2) : pos + 1] = True  # itself and the 2 keys before it
    expected = mh.attention(q, k, v, mask=banded, backend="explicit")
    got = mh.attention(q, k, v, causal=True, window=3, backend=backend)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(mh.masks.sliding_window_mask(sq, sk, window=3), banded)


@torch.no_grad()
def test_ring_cache_crops_freely_before_it_wraps() -> None:
    layer = make_layer(2, window=4)
    x = torch.randn(1, 6, E)
    cache = layer.new_cache(1, 32)
    layer(x[:, :3], cache=cache)
    cache.crop(1)  # positions 0..2 are all still in the ring
    rest = decode_with(layer, cache, x[:, 1:6])
    torch.testing.assert_close(rest, layer(x)[:, 1:], atol=1e-5, rtol=0)


@torch.no_grad()
def test_ring_cache_refuses_a_crop_past_what_it_holds() -> None:
    layer = make_layer(2, window=4)
    cache = layer.new_cache(1, 32)
    layer(torch.randn(1, 10, E), cache=cache)
    with pytest.raises(ValueError, match="no longer holds"):
        cache.crop(5)
    assert cache.host_lengths() == [10]


@torch.no_grad()
def test_asking_a_weightless_backend_for_weights_writes_nothing() -> None:
    layer = make_layer()
    layer.backend = "sdpa"
    cache = layer.new_cache(1, 8)
    with pytest.raises(ValueError, match="cannot do returning attention weights"):
        layer(torch.randn(1, 3, E), cache=cache, return_weights=True)
    assert cache.host_lengths() == [0] and cache.lengths.tolist() == [0]


@pytest.mark.parametrize("backend", mh.backends.available_backends())
def test_no_keys_or_no_queries_give_empty_or_zero_outputs(backend: str) -> None:
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 0, 8)
    assert torch.equal(mh.attention(q, k, k, backend=backend), torch.zeros(1, 2, 3, 8))
    assert mh.attention(q[:, :, :0], q, q, backend=backend).shape == (1, 2, 0, 8)


@torch.no_grad()
def test_ring_cache_chunks_of_several_tokens_equal_the_full_forward() -> None:
    """Chunks that fit before the ring wraps take the in-order path; later ones wrap it."""
    layer = make_layer(2, window=8)
    x = torch.randn(2, 30, E)
    cache = layer.new_cache(2, 40)
    assert cache.ring and cache.capacity == 8
    outs, t = [layer(x[:, :3], cache=cache)], 3
    while t < 30:
        n = min(5, 30 - t)
        outs.append(layer(x[:, t : t + n], cache=cache))
        t += n
    torch.testing.assert_close(torch.cat(outs, dim=1), layer(x), atol=1e-5, rtol=0)


# ---- append_static: the write torch.compile traces ---------------------------------------------
def test_a_static_append_writes_what_append_and_commit_write() -> None:
    """K/V, slot positions and lengths land where ``append`` then ``commit`` put them; the host
    mirror, left unset by the device-only write, is read back from ``lengths`` at its next use."""
    staged, static = mh.KVCache(2, 8, 2, 4), mh.KVCache(2, 8, 2, 4)
    for sn in (3, 1, 1):
        k, v = torch.randn(2, 2, sn, 4), torch.randn(2, 2, sn, 4)  # (B, Hkv, Sn, D)
        staged.commit(staged.append(k, v, None, structure=mh.masks.Structure()))
        static.append_static(k, v)
    assert static.host_lengths() == staged.host_lengths() == [5, 5]
    for name in ("k", "v", "slot_pos", "lengths"):
        assert torch.equal(getattr(static, name), getattr(staged, name)), name


def test_a_static_append_past_max_len_fails_before_writing() -> None:
    cache = mh.KVCache(1, 4, 1, 2)
    cache.append_static(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    before = [t.clone() for t in (cache.k, cache.v, cache.slot_pos, cache.lengths)]
    with pytest.raises(RuntimeError, match=r"cache overflow: 2 more tokens per row exceed max_len=4 "
                                           r"\(nothing was written\)"):
        cache.append_static(torch.full((1, 1, 2, 2), 2.0), torch.full((1, 1, 2, 2), 2.0))
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.k, cache.v, cache.slot_pos, cache.lengths)))
    assert cache.host_lengths() == [3]


def test_a_static_crop_undoes_a_static_append_on_the_device() -> None:
    """``crop_static`` takes the lengths as a device tensor (a traced step's undo reads nothing on
    the host): the counters are back, the slots past them empty, the mirror read back."""
    cache = mh.KVCache(2, 8, 1, 2)
    cache.append_static(torch.ones(2, 1, 3, 2), torch.ones(2, 1, 3, 2))
    before = (cache.lengths.clone(), cache.slot_pos.clone())
    cache.append_static(torch.ones(2, 1, 2, 2), torch.ones(2, 1, 2, 2))
    cache.crop_static(before[0])
    assert torch.equal(cache.lengths, before[0]) and torch.equal(cache.slot_pos, before[1])
    assert cache.host_lengths() == [3, 3]


def test_a_static_append_refuses_a_ring_cache_and_other_shapes() -> None:
    with pytest.raises(ValueError, match="a ring cache appends through append"):
        mh.KVCache(1, 8, 1, 2, window=4, ring=True).append_static(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    with pytest.raises(ValueError, match="cache has batch_size 1, got a batch of 2"):
        mh.KVCache(1, 8, 1, 2).append_static(torch.ones(2, 1, 1, 2), torch.ones(2, 1, 1, 2))
