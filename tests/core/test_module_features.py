"""The layer's new features against Hugging Face's attention modules (random weights, float32 and float64).

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads, D head_dim.

Each test builds a transformers attention module of one family from a small config,
randomises its weights, copies them into a MultiHeadAttention with the family's
features (their parameter names are the same: q_proj.., q_norm, k_norm, sinks), and
compares the outputs on a left-padded batch (padded query rows are not compared: HF
gives them arbitrary values).
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh

F64 = torch.float64
B, S = 2, 11
PAD = 3  # row 1 has 3 padding tokens on the left


def _key_mask() -> torch.Tensor:
    km = torch.ones(B, S, dtype=torch.bool)
    km[1, :PAD] = False
    return km


def _hf_mask(dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """(B, 1, S, S) additive: causal, padding (and window), finfo.min where blocked."""
    i, j = torch.arange(S)[:, None], torch.arange(S)[None]
    allowed = (j <= i) & _key_mask()[:, None, None, :]
    if window is not None:
        allowed = allowed & (i - j < window)
    return torch.zeros(B, 1, S, S, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _randomise(module: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


def _positions() -> torch.Tensor:
    return (torch.cumsum(_key_mask().long(), dim=1) - 1).clamp(min=0)  # (B, S): HF's left-padded positions


def _compare(hf_out: torch.Tensor, ours: torch.Tensor, atol: float) -> None:
    km = _key_mask()
    torch.testing.assert_close(ours[km], hf_out[km], rtol=0, atol=atol)


def _load(ours: mh.MultiHeadAttention, hf: torch.nn.Module) -> None:
    state = {k.replace("query_layernorm", "q_norm").replace("key_layernorm", "k_norm"): v  # HunYuan's names
             for k, v in hf.state_dict().items()}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rope" not in m], (missing, unexpected)


def _family(name: str, dtype: torch.dtype):
    """(HF attention, rotary embedding, our layer) for one family."""
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                  max_position_embeddings=64, rms_norm_eps=1e-6)
    if name == "qwen3":
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention as A, Qwen3RotaryEmbedding as R
        cfg, kw = Qwen3Config(**common), dict(qk_norm="head")
    elif name == "olmo2":
        from transformers import Olmo2Config
        from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention as A, Olmo2RotaryEmbedding as R
        cfg, kw = Olmo2Config(**common), dict(qk_norm="proj")
    elif name == "hunyuan_v1_dense":  # its q/k RMSNorm after RoPE
        from transformers import HunYuanDenseV1Config
        from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import (
            HunYuanDenseV1Attention as A, HunYuanDenseV1RotaryEmbedding as R)
        cfg, kw = HunYuanDenseV1Config(**common), dict(qk_norm="head_after_rope")
    elif name == "gemma2":
        from transformers import Gemma2Config
        from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention as A, Gemma2RotaryEmbedding as R
        cfg = Gemma2Config(**common, query_pre_attn_scalar=16, attn_logit_softcapping=2.0)
        kw = dict(softcap=2.0, scale=16 ** -0.5)
    elif name == "gemma3":
        from transformers import Gemma3TextConfig
        from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention as A, Gemma3RotaryEmbedding as R
        cfg = Gemma3TextConfig(**common, query_pre_attn_scalar=20, layer_types=["full_attention"] * 2,
                               num_hidden_layers=2)
        kw = dict(qk_norm="head", norm_offset=True, scale=20 ** -0.5)
    elif name == "gpt_oss":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention as A, GptOssRotaryEmbedding as R
        cfg = GptOssConfig(**common, layer_types=["full_attention"] * 2, num_hidden_layers=2)
        kw = dict(sinks=True)
    cfg._attn_implementation = "eager"
    hf = A(cfg, layer_idx=0).to(dtype).eval()
    _randomise(hf)
    bias = hf.q_proj.bias is not None
    params = cfg.rope_parameters
    params = params["full_attention"] if "full_attention" in params else params
    scaling = mh.RopeScaling.from_hf(params, max_positions=64)  # gpt-oss: yarn
    ours = mh.MultiHeadAttention(64, 4, num_kv_heads=2, head_dim=24, bias=bias, o_bias=hf.o_proj.bias is not None,
                                 causal=True, rope=mh.RoPE(24, params["rope_theta"], max_positions=64, scaling=scaling),
                                 norm_eps=1e-6,
                                 backend="explicit", dtype=dtype, **kw).eval()
    _load(ours, hf)
    rotary = R(cfg)
    return hf, rotary, ours, cfg


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "hunyuan_v1_dense", "gemma2", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_layer_equals_hf_attention_on_a_padded_batch(name: str, dtype: torch.dtype) -> None:
    hf, rotary, ours, cfg = _family(name, dtype)
    x = torch.randn(B, S, 64, dtype=dtype)
    pos = _positions()
    extra = {"layer_type": "full_attention"} if name == "gemma3" else {}
    cos, sin = rotary(x, pos, **extra)
    if dtype == F64:  # HF's tables are float32; give it ours in float64 (same formula) for a 1e-10 comparison
        cos64, sin64 = ours.rope.tables(pos, F64, bound=S)  # (B, S, D/2)
        cos, sin = (t if t.shape[-1] == cos.shape[-1] else torch.cat([t, t], dim=-1) for t in (cos64, sin64))
    with torch.no_grad():
        want = hf(x, position_embeddings=(cos.to(dtype), sin.to(dtype)), attention_mask=_hf_mask(dtype))[0]
        for backend in ("explicit", "auto", "sdpa"):
            if backend == "sdpa" and name == "gemma2":
                continue  # soft-capping: sdpa refuses (tested in tests/backends)
            ours.backend = backend
            got = ours(x, key_mask=_key_mask(), positions=pos)
            # HF's eager softmax and RMSNorms compute in float32 even for float64 inputs (ours in
            # float64), so the float64 comparison is at float32's rounding, with no HF RoPE-table error.
            _compare(want, got, 2e-5 if dtype == torch.float32 else 1e-5)


def test_bloom_alibi_layer_equals_hf_bloom_attention() -> None:
    from transformers import BloomConfig
    from transformers.models.bloom.modeling_bloom import BloomAttention, build_alibi_tensor

    heads = 6  # not a power of two
    cfg = BloomConfig(hidden_size=48, n_head=heads)
    hf = BloomAttention(cfg, layer_idx=0).eval()
    _randomise(hf)
    ours = mh.MultiHeadAttention(48, heads, causal=True, alibi=True).eval()
    w = hf.query_key_value.weight.view(heads, 3, 8, 48)  # BLOOM's fused layout: per head (q, k, v)
    bias = hf.query_key_value.bias.view(heads, 3, 8)
    with torch.no_grad():
        for i, proj in enumerate((ours.q_proj, ours.k_proj, ours.v_proj)):
            proj.weight.copy_(w[:, i].reshape(48, 48))
            proj.bias.copy_(bias[:, i].reshape(48))
        ours.o_proj.load_state_dict(hf.dense.state_dict())
    x = torch.randn(B, S, 48)
    alibi = build_alibi_tensor(_key_mask().long(), heads, torch.float32)  # (B·H, 1, S)
    with torch.no_grad():
        want = hf(x, torch.zeros_like(x), alibi, _hf_mask(torch.float32))[0]
        for backend in ("explicit", "sdpa", "auto"):
            ours.backend = backend
            _compare(want, ours(x, key_mask=_key_mask()), 2e-5)


def test_alibi_layer_decoding_with_a_cache_equals_the_full_forward() -> None:
    layer = mh.MultiHeadAttention(30, 3, causal=True, alibi=True, sinks=True).eval()
    with torch.no_grad():
        layer.sinks.normal_()
        x = torch.randn(2, 9, 30)
        full = layer(x)
        cache = layer.new_cache(2, 16)
        steps = [layer(x[:, :5], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=2e-6)


def test_packed_positions_equal_the_sequences_run_one_by_one() -> None:
    layer = mh.MultiHeadAttention(32, 4, num_kv_heads=2, causal=True, rope=mh.RoPE(8), qk_norm="head").eval()
    lengths = [4, 1, 6]
    positions = torch.cat([torch.arange(n) for n in lengths])
    x = torch.randn(1, sum(lengths), 32)
    with torch.no_grad():
        packed = layer(x, positions=positions, packed=True)
        alone = torch.cat([layer(part) for part in x.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=2e-6)


@pytest.mark.parametrize(("kw", "error", "match"), [
    (dict(qk_norm="rms"), ValueError, "qk_norm must be one of"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(alibi=1), TypeError, "alibi must be a bool"),
    (dict(alibi=True, rope=mh.RoPE(8)), ValueError, "ALiBi replaces position embeddings"),
    (dict(norm_eps=0.0, qk_norm="head"), ValueError, "eps"),
])
def test_bad_feature_arguments_are_refused_naming_them(kw: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        mh.MultiHeadAttention(32, 4, **kw)


def test_packed_needs_positions_and_alibi_refuses_a_ring_cache() -> None:
    layer = mh.MultiHeadAttention(32, 4, causal=True, alibi=True, window=4).eval()
    with pytest.raises(ValueError, match="packed=True needs positions"):
        layer(torch.randn(1, 3, 32), packed=True)
    with torch.no_grad(), pytest.raises(ValueError, match="ring cache with alibi"):
        layer(torch.randn(1, 3, 32), cache=layer.new_cache(1, 16, ring=True))


def test_fused_decoding_step_is_declined_for_the_new_features() -> None:
    layer = mh.MultiHeadAttention(32, 4, causal=True, softcap=3.0).eval()
    cache = layer.new_cache(1, 8)
    assert mh.decode.why_not_fused(layer, torch.randn(1, 1, 32), cache) in (
        "the layer has soft-capping, ALiBi or sinks", "the native kernel is not compiled here for AVX-512")
