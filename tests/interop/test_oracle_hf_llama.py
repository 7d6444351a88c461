"""Hugging Face's LlamaAttention as an oracle: RoPE (rotate-half), causal, MHA and GQA.

LlamaAttention takes ``position_embeddings=(cos, sin)`` from LlamaRotaryEmbedding and an
optional 4-D additive ``attention_mask`` (B, 1, S, S): 0 = attend, finfo.min = blocked.
Its "eager" path applies no causal mask by itself (the model builds the mask), so the
tests pass the causal mask explicitly to both implementations; the "sdpa" path falls
back to ``is_causal=True`` when no mask is given, which one test relies on.

Notation: B batch, S tokens, E = hidden_size, H heads, Hkv key/value heads, D head_dim.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

import multihead as mh

E, H, D = 64, 4, 16
B, S = 2, 10
ATOL32 = 1e-5


def _pair(num_kv_heads: int, theta: float, impl: str, *, causal: bool = True
          ) -> tuple[LlamaAttention, LlamaRotaryEmbedding, mh.MultiHeadAttention]:
    config = LlamaConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=num_kv_heads,
                         rope_theta=theta, attention_bias=False, max_position_embeddings=128,
                         attn_implementation=impl)
    theirs = LlamaAttention(config, layer_idx=0).eval()
    ours = mh.MultiHeadAttention(E, H, num_kv_heads=num_kv_heads, bias=False, causal=causal,
                                 rope=mh.RoPE(D, base=theta))
    ours.load_state_dict(theirs.state_dict())  # same names: q_proj, k_proj, v_proj, o_proj
    return theirs, LlamaRotaryEmbedding(config), ours


def _causal_additive(batch: int, s: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, 1, S, S): 0 on and below the diagonal, finfo.min above, as transformers builds it."""
    blocked = torch.ones(s, s, dtype=torch.bool).triu(1)
    mask = torch.zeros(s, s, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)
    return mask.expand(batch, 1, s, s)


def _hf(theirs, rotary, x, position_ids, attention_mask):
    cos, sin = rotary(x, position_ids)
    return theirs(x, position_embeddings=(cos, sin), attention_mask=attention_mask)[0]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_equals_llama_attention_with_rope_causal(num_kv_heads: int, theta: float, impl: str) -> None:
    theirs, rotary, ours = _pair(num_kv_heads, theta, impl)
    x = torch.randn(B, S, E)
    with torch.no_grad():
        want = _hf(theirs, rotary, x, torch.arange(S)[None].expand(B, S), _causal_additive(B, S))
        got = ours(x)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL32)


@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_equals_llama_sdpa_relying_on_is_causal(num_kv_heads: int) -> None:
    theirs, rotary, ours = _pair(num_kv_heads, 10000.0, "sdpa")
    x = torch.randn(B, S, E)
    with torch.no_grad():
        want = _hf(theirs, rotary, x, torch.arange(S)[None].expand(B, S), None)
        torch.testing.assert_close(ours(x), want, rtol=0, atol=ATOL32)


@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
def test_equals_llama_at_shifted_positions(num_kv_heads: int) -> None:
    theirs, rotary, ours = _pair(num_kv_heads, 500000.0, "eager")
    x = torch.randn(B, S, E)
    position_ids = torch.stack([torch.arange(S) + 7, torch.arange(S) + 40])  # (B, S)
    with torch.no_grad():
        want = _hf(theirs, rotary, x, position_ids, _causal_additive(B, S))
        torch.testing.assert_close(ours(x, positions=position_ids), want, rtol=0, atol=ATOL32)


def test_hf_additive_mask_converts_to_our_mask() -> None:
    theirs, rotary, ours = _pair(2, 10000.0, "eager", causal=False)  # HF's mask says it all
    x = torch.randn(B, S, E)
    additive = _causal_additive(B, S).clone()
    additive[1, :, :, -3:] = torch.finfo(torch.float32).min  # right padding in sequence 1
    additive[1, :, -3:, :] = 0.0  # padded queries: keep them attending, compare real rows only
    with torch.no_grad():
        want = _hf(theirs, rotary, x, torch.arange(S)[None].expand(B, S), additive)
        got = ours(x, mask=mh.masks.from_additive(additive))
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=ATOL32)
    torch.testing.assert_close(got[1, :-3], want[1, :-3], rtol=0, atol=ATOL32)


def test_hf_padding_attention_mask_is_our_key_mask() -> None:
    theirs, rotary, ours = _pair(2, 10000.0, "eager")
    x = torch.randn(B, S, E)
    attention_mask = torch.ones(B, S, dtype=torch.long)  # HF 2-D: 1 = real token, 0 = padding
    attention_mask[1, -3:] = 0
    additive = _causal_additive(B, S).clone()
    additive = additive.masked_fill(attention_mask[:, None, None, :] == 0, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = _hf(theirs, rotary, x, torch.arange(S)[None].expand(B, S), additive)
        got = ours(x, key_mask=attention_mask.bool())
    # Real queries agree; the padded ones are garbage in HF and ignored by every model.
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=ATOL32)
    torch.testing.assert_close(got[1, :-3], want[1, :-3], rtol=0, atol=ATOL32)
