"""Torch's keywords and call habits, refused with the multihead equivalent named.

Notation: B batch, H heads, Sq queries, Sk keys, D head_dim, E embed_dim.

``mh.attention`` and ``MultiHeadAttention.forward`` take no ``attn_mask``, ``is_causal``,
``key_padding_mask`` or ``need_weights``, and the layer takes ``(x, context)``, not torch's
``(query, key, value)``: each is a ``TypeError`` that names what to pass instead, with the
mask polarity (multihead: True = may attend; ``key_padding_mask`` and
``nn.MultiheadAttention``'s bool ``attn_mask``: True = ignore; SDPA's bool ``attn_mask``:
True = may attend). The second half checks the named equivalents against torch itself.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead as mh

B, H, S, D = 2, 4, 5, 8
E = H * D
F64 = torch.float64


def _qkv(sq: int = S, sk: int = S) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(B, H, sq, D, dtype=F64), torch.randn(B, H, sk, D, dtype=F64), torch.randn(B, H, sk, D, dtype=F64)


# ---- mh.attention ------------------------------------------------------------------------------------
ATTENTION_KEYWORDS = {
    "attn_mask": (torch.ones(S, S, dtype=torch.bool), [r"mask=", "True = may attend", "True = ignore",
                                                        "from_torch_mha", "from_additive"]),
    "is_causal": (True, [r"causal=True", "bottom-right", "top-left"]),
    "key_padding_mask": (torch.zeros(B, S, dtype=torch.bool), ["True = ignore",
                                                                r"key_padding_mask\(~key_padding_mask\)"]),
    "need_weights": (True, [r"return_weights=True", "never averaged"]),
    "average_attn_weights": (False, [r"return_weights=True", r"mean\(dim=1\)"]),
    "enable_gqa": (True, ["no flag"]),
}


@pytest.mark.parametrize("keyword", list(ATTENTION_KEYWORDS))
def test_attention_refuses_torch_keyword_naming_the_equivalent(keyword: str) -> None:
    value, says = ATTENTION_KEYWORDS[keyword]
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=f"'{keyword}'") as e:
        mh.attention(q, k, v, **{keyword: value})
    for phrase in says:
        assert re.search(phrase, str(e.value)), f"{phrase!r} not in: {e.value}"


def test_attention_refuses_an_unknown_keyword_by_name() -> None:
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"attention\(\) got unexpected keyword arguments 'attn_mask', 'bogus'"):
        mh.attention(q, k, v, attn_mask=None, bogus=1)


def test_attention_with_its_own_keywords_still_runs() -> None:
    q, k, v = _qkv()
    out, weights = mh.attention(q, k, v, causal=True, return_weights=True)
    assert out.shape == (B, H, S, D) and weights.shape == (B, H, S, S)


# ---- MultiHeadAttention.forward ----------------------------------------------------------------------
LAYER_KEYWORDS = {
    "attn_mask": (torch.zeros(S, S, dtype=torch.bool), [r"mask=", "True = may attend", "True = ignore",
                                                         "from_torch_mha"]),
    "is_causal": (True, [r"causal=True"]),
    "key_padding_mask": (torch.zeros(B, S, dtype=torch.bool), [r"key_mask=~key_padding_mask", "True = real token",
                                                                "True = ignore"]),
    "need_weights": (False, [r"return_weights=True", "never averaged"]),
    "average_attn_weights": (False, [r"mean\(dim=1\)"]),
    "query": (None, [r"layer\(x\)", r"layer\(x, context\)"]),
}


@pytest.mark.parametrize("keyword", list(LAYER_KEYWORDS))
def test_layer_refuses_torch_keyword_naming_the_equivalent(keyword: str) -> None:
    value, says = LAYER_KEYWORDS[keyword]
    layer = mh.MultiHeadAttention(E, H, dtype=F64)
    x = torch.randn(B, S, E, dtype=F64)
    with pytest.raises(TypeError, match=f"'{keyword}'") as e:
        layer(x, **{keyword: value})
    for phrase in says:
        assert re.search(phrase, str(e.value)), f"{phrase!r} not in: {e.value}"


def test_layer_called_with_query_key_value_of_one_tensor_names_self_attention() -> None:
    layer = mh.MultiHeadAttention(E, H, dtype=F64)
    x = torch.randn(B, S, E, dtype=F64)
    with pytest.raises(TypeError, match=r"3 positional arguments.*self-attention is layer\(x\)"):
        layer(x, x, x)


def test_layer_called_with_key_is_value_names_cross_attention() -> None:
    layer = mh.MultiHeadAttention(E, H, dtype=F64)
    x, memory = torch.randn(B, S, E, dtype=F64), torch.randn(B, 7, E, dtype=F64)
    with pytest.raises(TypeError, match=r"key is value: layer\(x, context\)"):
        layer(x, memory, memory)


def test_layer_called_with_distinct_key_and_value_says_there_is_no_equivalent() -> None:
    layer = mh.MultiHeadAttention(E, H, dtype=F64)
    x, k, v = (torch.randn(B, n, E, dtype=F64) for n in (S, 7, 7))
    with pytest.raises(TypeError, match="no equivalent") as e:
        layer(x, k, v)
    assert "batch-first" in str(e.value)


def test_refused_layer_call_changes_no_cache() -> None:
    layer = mh.MultiHeadAttention(E, H, causal=True, dtype=F64).eval()
    cache = layer.new_cache(B, 8)
    with torch.no_grad(), pytest.raises(TypeError, match="key_padding_mask"):
        layer(torch.randn(B, S, E, dtype=F64), cache=cache, key_padding_mask=torch.zeros(B, S, dtype=torch.bool))
    assert cache.host_lengths() == [0] * B


# ---- the named equivalents give torch's results ----------------------------------------------------------
def test_sdpa_bool_attn_mask_is_mask_as_it_is() -> None:
    q, k, v = _qkv(S, 7)
    allowed = torch.rand(B, 1, S, 7) < 0.6
    allowed[..., 0] = True  # SDPA returns NaN for a row with no key
    torch.testing.assert_close(mh.attention(q, k, v, mask=allowed), F.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed))


def test_key_padding_mask_is_key_padding_mask_of_its_inverse() -> None:
    q, k, v = _qkv(S, 7)
    padding = torch.zeros(B, 7, dtype=torch.bool)  # torch: True = ignore
    padding[1, -3:] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=~padding[:, None, None, :])
    got = mh.attention(q, k, v, mask=mh.masks.key_padding_mask(~padding))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("sq", [S, 2], ids=["square", "fewer-queries"])
def test_is_causal_is_causal_aligned_as_the_message_says(sq: int) -> None:
    """Equal to SDPA's is_causal when Sq == Sk; otherwise to SDPA with a bottom-right mask."""
    q, k, v = _qkv(sq, S)
    bottom_right = torch.ones(sq, S, dtype=torch.bool).tril(S - sq)
    got = mh.attention(q, k, v, causal=True)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=bottom_right))
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(got, top_left) == (sq == S)


def test_need_weights_is_return_weights_averaged_by_torch() -> None:
    theirs = nn.MultiheadAttention(E, H, batch_first=True, dtype=F64).eval()
    ours = mh.MultiHeadAttention.from_torch(theirs)
    x = torch.randn(B, S, E, dtype=F64)
    want_y, want_w = theirs(x, x, x, need_weights=True)  # averaged over heads: (B, S, S)
    y, weights = ours(x, return_weights=True)  # (B, H, S, S)
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(weights.mean(dim=1), want_w)


_DERIVED_CASES = {
    "rope": lambda: {"rope": mh.RoPE(16, max_positions=128)},
    "rope with yarn scaling": lambda: {"rope": mh.RoPE(16, max_positions=128, scaling=mh.RopeScaling(
        rope_type="yarn", factor=4.0, original_max_positions=32))},
    "mrope": lambda: {"rope": mh.MRoPE(16, sections=[2, 3, 3], max_positions=128)},
    "alibi": lambda: {"alibi": True},
    "qk-norm and sinks": lambda: {"rope": mh.RoPE(16), "qk_norm": "head", "sinks": True},
}


@pytest.mark.parametrize("case", list(_DERIVED_CASES))
def test_a_layer_built_on_the_meta_device_then_given_memory_and_a_state_dict_is_the_same_layer(case: str) -> None:
    """torch's way to build large models: under ``torch.device("meta")``, then ``to_empty`` and
    ``load_state_dict``. The buffers no state dict holds (RoPE's tables, M-RoPE's rows, ALiBi's
    slopes) are computed again when they get memory: the same bits as a layer built on the CPU
    (ALiBi's slopes used to be whatever the fresh memory held)."""
    torch.manual_seed(0)
    ref = mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, **_DERIVED_CASES[case]())
    with torch.device("meta"):
        layer = mh.MultiHeadAttention(64, 4, num_kv_heads=2, causal=True, **_DERIVED_CASES[case]())
    assert all(t.is_meta for t in layer.buffers())
    layer = layer.to_empty(device="cpu")
    layer.load_state_dict(ref.state_dict())
    for (name, want), (same, got) in zip(ref.named_buffers(), layer.named_buffers(), strict=True):
        assert name == same and got.dtype == want.dtype and torch.equal(got, want), name
    x = torch.randn(2, 10, 64)
    torch.testing.assert_close(layer(x), ref(x), atol=0, rtol=0)
    half = layer.to(torch.bfloat16)  # the tables keep float32 as before; only the device would move
    assert all(t.dtype != torch.bfloat16 for n, t in half.named_buffers() if n.startswith("rope."))
