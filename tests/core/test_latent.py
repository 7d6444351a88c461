"""Multi-head latent attention: transformers' DeepSeek-V3 weights, absorbed cached decoding, cache size.

Notation: B batch, S tokens, H heads, r kv_lora_rank, dr qk_rope_head_dim.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh

F64 = torch.float64
SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
             qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=64,
             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
                           "rope_theta": 10000.0})


def _hf(dtype: torch.dtype, q_lora: bool = True):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    sizes = dict(SIZES, q_lora_rank=SIZES["q_lora_rank"] if q_lora else None)
    cfg = DeepseekV3Config(**sizes, num_hidden_layers=1)
    cfg._attn_implementation = "eager"
    attn = DeepseekV3Attention(cfg, layer_idx=0).to(dtype).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return attn, DeepseekV3RotaryEmbedding(cfg)


def _mask(b: int, s: int, km: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    allowed = torch.ones(s, s, dtype=torch.bool).tril() & km[:, None, None, :]
    return torch.zeros(b, 1, s, s, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


@pytest.mark.parametrize("q_lora", [True, False])
def test_converted_layer_equals_hf_deepseek_v3_attention_on_a_padded_batch(q_lora: bool) -> None:
    hf, rotary = _hf(torch.float32, q_lora)
    ours = mh.MultiHeadLatentAttention.from_hf(hf)
    b, s = 2, 9
    km = torch.ones(b, s, dtype=torch.bool)
    km[1, 6:] = False  # right padding
    x = torch.randn(b, s, 64)
    pos = torch.arange(s)[None].expand(b, s)
    with torch.no_grad():
        want = hf(x, position_embeddings=rotary(x, pos), attention_mask=_mask(b, s, km, torch.float32))[0]
        got = ours(x, key_mask=km)
    torch.testing.assert_close(got[km], want[km], rtol=0, atol=2e-5)
    assert ours.scale == hf.scaling


def test_absorbed_cached_decoding_equals_the_uncached_forward_in_float64() -> None:
    hf, _ = _hf(F64)
    ours = mh.MultiHeadLatentAttention.from_hf(hf)
    x = torch.randn(2, 11, 64, dtype=F64)
    with torch.no_grad():
        full = ours(x)
        cache = ours.new_cache(2, 16)
        steps = [ours(x[:, :4], cache=cache)] + [ours(x[:, t:t + 1], cache=cache) for t in range(4, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)
    assert cache.length == 11


def test_cached_decoding_equals_hf_with_its_own_cache_in_float64() -> None:
    """HF decompresses its cache; its RMSNorms and softmax compute in float32 even for float64
    inputs, so the agreement is at float32's rounding (ours: float64 throughout)."""
    from transformers import DynamicCache

    hf, rotary = _hf(F64)
    ours = mh.MultiHeadLatentAttention.from_hf(hf)
    x = torch.randn(1, 7, 64, dtype=F64)
    hf_cache, cache = DynamicCache(config=hf.config), ours.new_cache(1, 8)
    with torch.no_grad():
        for t in range(7):
            pos = torch.tensor([[t]])
            cos, sin = ours.rope.tables(pos, F64, bound=t + 1)  # float64 tables for HF too
            hf_out = hf(x[:, t:t + 1], position_embeddings=(torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)),
                        attention_mask=None, cache=hf_cache)[0]
            torch.testing.assert_close(ours(x[:, t:t + 1], cache=cache), hf_out, rtol=0, atol=2e-5)


def test_decoding_never_decompresses_the_cache() -> None:
    hf, _ = _hf(torch.float32)
    ours = mh.MultiHeadLatentAttention.from_hf(hf)
    cache = ours.new_cache(1, 8)
    calls = []
    ours.kv_b_proj.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        for _t in range(3):
            ours(torch.randn(1, 1, 64), cache=cache)
    assert calls == []  # kv_b_proj's weight is used only inside the absorbed query and output


def test_deepseek_v3_cache_holds_576_numbers_per_token_per_layer() -> None:
    config = mh.AttentionConfig.from_hf(
        __import__("pathlib").Path(__file__).parent.parent / "data" / "configs" / "deepseek-v3.json")
    layer = mh.MultiHeadLatentAttention.from_config(config, device="meta", dtype=torch.bfloat16)
    cache = mh.LatentCache(1, 1, layer.kv_lora_rank, layer.qk_rope_head_dim, dtype=torch.bfloat16, device="meta")
    assert cache.numbers_per_token == 576 and cache.nbytes == 576 * 2
    # plain MHA with V3's 128 heads would cache 128 · (192 + 128) numbers per token per layer
    assert mh.cost(config, 1, dtype="bfloat16").gqa_saving == pytest.approx(128 * 320 / 576)


def test_a_call_that_overflows_the_cache_leaves_it_unchanged() -> None:
    layer = mh.MultiHeadLatentAttention(32, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    cache = layer.new_cache(1, 4)
    with torch.no_grad():
        layer(torch.randn(1, 3, 32), cache=cache)
        with pytest.raises(ValueError, match="3 of 4 tokens: 2 more do not fit"):
            layer(torch.randn(1, 2, 32), cache=cache)
    assert cache.length == 3


def test_plain_layer_refuses_a_latent_config() -> None:
    config = mh.AttentionConfig.from_hf(
        __import__("pathlib").Path(__file__).parent.parent / "data" / "configs" / "deepseek-v3.json")
    with pytest.raises(ValueError, match="MultiHeadLatentAttention"):
        mh.MultiHeadAttention.from_config(config, device="meta")
