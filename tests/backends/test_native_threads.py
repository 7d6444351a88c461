"""Results do not depend on the thread count: the decoding kernels and the FlashAttention loops
give the same bits with 1, 2 and 3 threads.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim.

The decoding kernels split long key ranges into parts merged by their log-sum-exp
(flash-decoding). The parts fix the summation order, so they are chosen from the problem
alone, never from the thread count (before, 1, 2 and 3 threads split 5,000 keys of one
K/V head into 2, 4 and 6 parts and differed by up to 2.4e-7).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import multihead as mh
from multihead import decode, native


def with_threads(fn: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """``fn()`` run with 1, 2 and 3 torch threads (the count restored after)."""
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(fn())
        return outs
    finally:
        torch.set_num_threads(before)


def assert_bitwise_equal(outs: list[torch.Tensor]) -> None:
    for n, out in zip((2, 3), outs[1:]):
        assert torch.equal(outs[0], out), f"{n} threads differ from 1 by {float((out - outs[0]).abs().max()):.2e}"


@torch.no_grad()
@pytest.mark.parametrize("b, h, hkv, sq, sk", [(1, 8, 1, 1, 5000), (2, 4, 2, 1, 3000), (1, 4, 1, 3, 1700),
                                               (3, 8, 8, 1, 1300)])
def test_the_decoding_kernel_gives_the_same_bits_for_any_thread_count(b, h, hkv, sq, sk) -> None:
    torch.random.default_generator.manual_seed(sk)
    q, k, v = torch.randn(b, h, sq, 64), torch.randn(b, hkv, sk, 64), torch.randn(b, hkv, sk, 64)
    assert_bitwise_equal(with_threads(lambda: native.decode_f32(q, k, v, scale=0.125, causal=True)))
    # auto's decoding path (few query rows per K/V head), through the public function
    assert_bitwise_equal(with_threads(lambda: mh.attention(q, k, v, causal=True)))


@torch.no_grad()
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_a_decoding_step_gives_the_same_bits_for_any_thread_count(kv_heads: int) -> None:
    """The fused native step where it applies (AVX-512 or AVX2), else the layer's unfused path."""
    torch.random.default_generator.manual_seed(kv_heads)
    layer = mh.MultiHeadAttention(256, 8, num_kv_heads=kv_heads, causal=True, bias=False,
                                  rope=mh.RoPE(32, max_positions=4096)).eval()
    prompt, token = torch.randn(1, 2500, 256), torch.randn(1, 1, 256)

    def step() -> torch.Tensor:
        cache = layer.new_cache(1, 2600)
        layer(prompt, cache=cache)
        return torch.cat([layer(token, cache=cache) for _ in range(2)], dim=1)  # (1, 2, E)

    cache = layer.new_cache(1, 2600)
    layer(prompt, cache=cache)
    fused = decode.why_not_fused(layer, token, cache) is None
    assert fused == (native.vector_bits() >= 256)
    assert_bitwise_equal(with_threads(step))


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_timed_decoding_step_gives_the_same_bits_whichever_thread_count_it_picks(dtype: torch.dtype) -> None:
    """From 1 MB of weights the fused step runs on all its threads or on one, whichever has been
    faster lately, and now and then the other (in a fresh process, both within the first 40
    steps): every step equals the 1-thread run bit for bit, as its projections are cut into the
    same chunks whoever takes them."""
    torch.random.default_generator.manual_seed(7)
    layer = mh.MultiHeadAttention(512, 8, num_kv_heads=2, causal=True, bias=True,
                                  rope=mh.RoPE(64, max_positions=512)).eval().to(dtype)  # 2.6 MB float32
    prompt, tokens = torch.randn(2, 30, 512, dtype=dtype), torch.randn(2, 40, 512, dtype=dtype)

    def steps() -> torch.Tensor:
        cache = layer.new_cache(2, 80)
        layer(prompt, cache=cache)
        return torch.cat([layer(tokens[:, i:i + 1], cache=cache) for i in range(tokens.shape[1])], dim=1)

    cache = layer.new_cache(2, 80)
    layer(prompt, cache=cache)
    assert (decode.why_not_fused(layer, tokens[:, :1], cache) is None) == (native.vector_bits() >= 256)
    assert_bitwise_equal(with_threads(steps))


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hkv", [3, 6])
def test_the_flash_loop_gives_the_same_bits_for_any_thread_count(dtype: torch.dtype, hkv: int) -> None:
    """The FlashAttention loops share work two ways: each thread packing and running whole (b, K/V
    head) pairs (3 pairs with 1 or 3 threads, 6 with any), or all threads packing first and then
    taking query tiles one at a time (3 pairs over 2 threads): the same bits every way."""
    torch.random.default_generator.manual_seed(hkv)
    q, k, v = (torch.randn(1, 6, 300, 64).to(dtype), torch.randn(1, hkv, 300, 64).to(dtype),
               torch.randn(1, hkv, 300, 64).to(dtype))
    for causal in (False, True):
        def run(causal: bool = causal) -> torch.Tensor:
            return native.run(q, k, v, scale=0.125, causal=causal, window=None, mask=None, decode=False)[0]

        assert_bitwise_equal(with_threads(run))
