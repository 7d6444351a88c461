"""torch.nn.MultiheadAttention as an oracle: same weights, same outputs.

torch packs W_q, W_k, W_v into ``in_proj_weight`` (3E, E) and reads bool masks as
True = *ignore*; multihead has q_proj/k_proj/v_proj and True = may attend
(:func:`multihead.masks.from_torch_mha` converts).

Notation: B batch, S tokens, E embed_dim, H heads.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multihead as mh
from conftest import ATOL64

F64 = torch.float64
E, H, B, S = 16, 4, 2, 6
BACKENDS = ("sdpa", "explicit")


def _pair(backend: str, *, causal: bool = False,
          bias: bool = True) -> tuple[nn.MultiheadAttention, mh.MultiHeadAttention]:
    """A torch layer with random weights and ours holding the same weights."""
    theirs = nn.MultiheadAttention(E, H, bias=bias, batch_first=True, dtype=F64).eval()
    with torch.no_grad():
        for p in theirs.parameters():  # torch zero-initialises biases; make them count
            p.normal_(std=0.5)
    ours = mh.MultiHeadAttention(E, H, bias=bias, causal=causal, backend=backend, dtype=F64)
    with torch.no_grad():
        w_q, w_k, w_v = theirs.in_proj_weight.chunk(3)
        ours.q_proj.weight.copy_(w_q), ours.k_proj.weight.copy_(w_k), ours.v_proj.weight.copy_(w_v)
        ours.o_proj.weight.copy_(theirs.out_proj.weight)
        if bias:
            b_q, b_k, b_v = theirs.in_proj_bias.chunk(3)
            ours.q_proj.bias.copy_(b_q), ours.k_proj.bias.copy_(b_k), ours.v_proj.bias.copy_(b_v)
            ours.o_proj.bias.copy_(theirs.out_proj.bias)
    return theirs, ours


def _torch(theirs: nn.MultiheadAttention, x: torch.Tensor, **kwargs) -> torch.Tensor:
    return theirs(x, x, x, need_weights=False, **kwargs)[0]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_mask_equals_torch(backend: str, bias: bool) -> None:
    theirs, ours = _pair(backend, bias=bias)
    x = torch.randn(B, S, E, dtype=F64)
    torch.testing.assert_close(ours(x), _torch(theirs, x), rtol=0, atol=ATOL64)


@pytest.mark.parametrize("torch_mask", ["float-subsequent", "bool-triu"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_layer_equals_torch_with_causal_attn_mask(backend: str, torch_mask: str) -> None:
    theirs, ours = _pair(backend, causal=True)
    x = torch.randn(B, S, E, dtype=F64)
    if torch_mask == "float-subsequent":
        attn_mask = nn.Transformer.generate_square_subsequent_mask(S, dtype=F64)
    else:
        attn_mask = torch.ones(S, S, dtype=torch.bool).triu(1)  # True = ignore
    torch.testing.assert_close(ours(x), _torch(theirs, x, attn_mask=attn_mask), rtol=0, atol=ATOL64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_converted_attn_mask_equals_torch(backend: str) -> None:
    theirs, ours = _pair(backend)
    x = torch.randn(B, S, E, dtype=F64)
    ignore = torch.rand(S, S) > 0.7
    ignore.fill_diagonal_(False)  # torch returns NaN for a fully ignored row; keep one key per query
    torch.testing.assert_close(ours(x, mask=mh.masks.from_torch_mha(ignore)),
                               _torch(theirs, x, attn_mask=ignore), rtol=0, atol=ATOL64)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_key_padding_equals_torch_key_padding_mask(backend: str, causal: bool) -> None:
    theirs, ours = _pair(backend, causal=causal)
    x = torch.randn(B, S, E, dtype=F64)
    key_padding_mask = torch.zeros(B, S, dtype=torch.bool)  # torch: True = padding, ignore
    key_padding_mask[1, -2:] = True
    kwargs = {"attn_mask": torch.ones(S, S, dtype=torch.bool).triu(1)} if causal else {}
    want = _torch(theirs, x, key_padding_mask=key_padding_mask, **kwargs)
    got = ours(x, key_mask=mh.masks.from_torch_mha(key_padding_mask))  # ours: True = real token
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL64)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_per_head_weights_equal_torch_unaveraged_weights(causal: bool) -> None:
    theirs, ours = _pair("explicit", causal=causal)
    x = torch.randn(B, S, E, dtype=F64)
    attn_mask = torch.ones(S, S, dtype=torch.bool).triu(1) if causal else None
    want_y, want_w = theirs(x, x, x, attn_mask=attn_mask, need_weights=True, average_attn_weights=False)
    y, weights = ours(x, return_weights=True)
    assert weights.shape == want_w.shape == (B, H, S, S)
    torch.testing.assert_close(weights, want_w, rtol=0, atol=ATOL64)
    torch.testing.assert_close(y, want_y, rtol=0, atol=ATOL64)


def test_float32_equals_torch_to_1e_5() -> None:
    theirs, ours = _pair("sdpa", causal=True)
    theirs, ours = theirs.float(), ours.float()
    x = torch.randn(B, 32, E)
    attn_mask = nn.Transformer.generate_square_subsequent_mask(32)
    torch.testing.assert_close(ours(x), _torch(theirs, x, attn_mask=attn_mask), rtol=0, atol=1e-5)


def test_cross_attention_equals_torch_with_separate_key_value() -> None:
    theirs, ours = _pair("sdpa")
    x, context = torch.randn(B, 3, E, dtype=F64), torch.randn(B, 7, E, dtype=F64)
    want = theirs(x, context, context, need_weights=False)[0]
    torch.testing.assert_close(ours(x, context), want, rtol=0, atol=ATOL64)


# ---- from_torch carries the layout (torch's default batch_first=False is (S, B, E)) ------------------
def _torch_layer(batch_first: bool, **kwargs) -> nn.MultiheadAttention:
    theirs = nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=F64, **kwargs).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(std=0.5)
    return theirs


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
def test_from_torch_takes_the_torch_modules_own_layout(batch_first: bool) -> None:
    theirs = _torch_layer(batch_first)
    ours = mh.MultiHeadAttention.from_torch(theirs)
    assert ours.batch_first == batch_first
    x = torch.randn(*((B, S) if batch_first else (S, B)), E, dtype=F64)  # the torch module's layout
    want = _torch(theirs, x)
    got = ours(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL64)


def test_from_seq_first_torch_with_key_padding_and_weights_equals_torch() -> None:
    theirs = _torch_layer(False)
    ours = mh.MultiHeadAttention.from_torch(theirs)
    x = torch.randn(S, B, E, dtype=F64)  # (S, B, E)
    key_padding_mask = torch.zeros(B, S, dtype=torch.bool)  # (B, S) in both layouts, True = ignore
    key_padding_mask[1, -2:] = True
    want_y, want_w = theirs(x, x, x, key_padding_mask=key_padding_mask, need_weights=True,
                            average_attn_weights=False)
    y, weights = ours(x, key_mask=~key_padding_mask, return_weights=True)
    torch.testing.assert_close(y, want_y, rtol=0, atol=ATOL64)
    torch.testing.assert_close(weights, want_w, rtol=0, atol=ATOL64)  # (B, H, S, S) in both


def test_from_seq_first_torch_cross_attention_equals_torch() -> None:
    theirs = _torch_layer(False, kdim=12, vdim=12)
    ours = mh.MultiHeadAttention.from_torch(theirs)
    x, memory = torch.randn(3, B, E, dtype=F64), torch.randn(7, B, 12, dtype=F64)  # (S, B, E), (Sk, B, kdim)
    want = theirs(x, memory, memory, need_weights=False)[0]
    torch.testing.assert_close(ours(x, memory), want, rtol=0, atol=ATOL64)


def test_seq_first_layer_decodes_through_a_cache_as_without() -> None:
    ours = mh.MultiHeadAttention.from_torch(_torch_layer(False), causal=True)
    x = torch.randn(S, B, E, dtype=F64)
    cache = ours.new_cache(B, S)
    with torch.no_grad():
        steps = [ours(x[:3], cache=cache)] + [ours(x[i:i + 1], cache=cache) for i in range(3, S)]
        full = ours(x)
    torch.testing.assert_close(torch.cat(steps), full, rtol=0, atol=ATOL64)  # (S, B, E)


def test_seq_first_layer_refuses_a_non_3d_input_by_name() -> None:
    ours = mh.MultiHeadAttention.from_torch(_torch_layer(False))
    with pytest.raises(ValueError, match="x"):
        ours(torch.randn(S, E, dtype=F64))
    assert "batch_first=False" in repr(ours)


def test_a_seq_first_layer_is_refused_where_its_layout_would_be_lost() -> None:
    """shard_heads, context_parallel and mh.trace read (B, S, E): a batch_first=False layer is refused."""
    layer = mh.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(16, 2))  # batch_first=False
    assert not layer.batch_first
    with pytest.raises(ValueError, match="batch_first=False"):
        mh.parallel.shard_heads(layer)
    with pytest.raises(ValueError, match="batch_first=False"):
        mh.parallel.context_parallel(layer)
    with pytest.raises(ValueError, match="batch_first=False"):
        mh.trace(layer, torch.randn(5, 1, 16))
