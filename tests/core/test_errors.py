"""Bad input fails loudly, at the boundary, before any work.

One case per bad input: ValueError for sizes, shapes, values and devices; TypeError for
types and dtypes. Each case checks the exception type, that the message names the
argument, and that no projection, rotation or attention backend ran.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import multihead as mh
from multihead.backends import registry

MHA = mh.MultiHeadAttention
E, H, B, S = 16, 4, 2, 5


def x32(*shape: int, **kw) -> torch.Tensor:
    return torch.randn(*(shape or (B, S, E)), **kw)


def qkv(h=4, hkv=4, sq=5, sk=5, d=8, dtype=torch.float32):
    return (torch.randn(B, h, sq, d, dtype=dtype), torch.randn(B, hkv, sk, d, dtype=dtype),
            torch.randn(B, hkv, sk, d, dtype=dtype))


def attn(**kwargs) -> Callable[[], object]:
    """A call of mh.attention on good q, k, v (4 heads, S=5, D=8) with ``kwargs`` changed."""
    def call():
        q, k, v = qkv()
        args = {"q": q, "k": k, "v": v, **kwargs}
        return mh.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    return call


def fwd(*args, layer: dict | None = None, **kwargs) -> Callable[[], object]:
    """A call of a good layer (E=16, H=4, float32) on ``args`` and ``kwargs``."""
    def call():
        return MHA(E, H, **(layer or {}))(*args, **kwargs)
    return call


BOOL = torch.bool
# (id, call, exception, message pattern naming the argument)
CASES = [
    # -- MultiHeadAttention(...) ----------------------------------------------------------
    ("ctor-embed_dim-not-divisible-by-num_heads", lambda: MHA(10, 3), ValueError,
     r"embed_dim \(10\) must be divisible by num_heads \(3\)"),
    ("ctor-num_heads-not-divisible-by-num_kv_heads", lambda: MHA(16, 4, num_kv_heads=3), ValueError,
     r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
    ("ctor-embed_dim-zero", lambda: MHA(0, 4), ValueError, r"embed_dim must be in \[1, .*got 0"),
    ("ctor-num_heads-negative", lambda: MHA(16, -1), ValueError, r"num_heads must be in \[1, .*got -1"),
    ("ctor-num_kv_heads-zero", lambda: MHA(16, 4, num_kv_heads=0), ValueError, r"num_kv_heads .*got 0"),
    ("ctor-head_dim-zero", lambda: MHA(16, 4, head_dim=0), ValueError, r"head_dim .*got 0"),
    ("ctor-embed_dim-float", lambda: MHA(16.0, 4), TypeError, r"embed_dim must be an int"),
    ("ctor-num_heads-bool", lambda: MHA(16, True), TypeError, r"num_heads must be an int"),
    ("ctor-odd-head_dim-with-rope", lambda: MHA(15, 3, rope=mh.RoPE(5)), ValueError,
     r"head_dim must be even .*got 5"),
    ("ctor-rope-head_dim-differs", lambda: MHA(16, 4, rope=mh.RoPE(8)), ValueError,
     r"rope.head_dim must equal head_dim=4, got 8"),
    ("ctor-rope-not-a-RoPE", lambda: MHA(16, 4, rope="rope"), TypeError, r"rope must be a multihead.RoPE"),
    ("ctor-dropout-negative", lambda: MHA(16, 4, dropout=-0.1), ValueError, r"dropout must be in \[0.0, 1.0\).*-0.1"),
    ("ctor-dropout-one", lambda: MHA(16, 4, dropout=1.0), ValueError, r"dropout must be in \[0.0, 1.0\).*1.0"),
    ("ctor-window-zero", lambda: MHA(16, 4, window=0), ValueError, r"window .*got 0"),
    ("ctor-scale-zero", lambda: MHA(16, 4, scale=0.0), ValueError, r"scale must be in \(0.0"),
    ("ctor-backend-unknown", lambda: MHA(16, 4, backend="flash9"), ValueError,
     r"backend must be one of \[.*'explicit'.*'sdpa'.*\], got 'flash9'"),
    # -- layer(x, ...) ----------------------------------------------------------------------
    ("x-not-a-tensor", fwd(np.zeros((B, S, E), dtype=np.float32)), TypeError, r"x must be a torch.Tensor"),
    ("x-2d", fwd(x32(S, E)), ValueError, r"x must have 3 dimensions, got 2"),
    ("x-4d", fwd(x32(B, 1, S, E)), ValueError, r"x must have 3 dimensions, got 4"),
    ("x-wrong-width", fwd(x32(B, S, 12)), ValueError, r"x must have last dim 16 .*\[2, 5, 12\]"),
    ("x-float64-into-float32-layer", fwd(x32(dtype=torch.float64)), TypeError,
     r"x must have dtype torch.float32 .*got torch.float64"),
    ("x-integer", fwd(torch.ones(B, S, E, dtype=torch.long)), TypeError, r"x must have dtype torch.float32"),
    ("x-on-meta-device", fwd(x32(device="meta")), ValueError, r"x must be on device cpu .*got meta"),
    ("context-wrong-width", fwd(x32(), x32(B, 7, 12)), ValueError, r"context must have last dim 16"),
    ("context-2d", fwd(x32(), x32(7, E)), ValueError, r"context must have 3 dimensions"),
    ("context-wrong-batch", fwd(x32(), x32(3, 7, E)), ValueError, r"context must have batch size 2 .*got 3"),
    ("context-float64", fwd(x32(), x32(B, 7, E, dtype=torch.float64)), TypeError, r"context must have dtype"),
    ("context-to-causal-layer", fwd(x32(), x32(B, 7, E), layer={"causal": True}), ValueError,
     r"context was given to a causal layer"),
    ("context-to-rope-layer", fwd(x32(), x32(B, 7, E), layer={"rope": mh.RoPE(4)}), ValueError,
     r"context was given to a layer with rope"),
    ("mask-float", fwd(x32(), mask=torch.ones(S, S)), TypeError, r"mask must be a bool tensor .*float32"),
    ("mask-int", fwd(x32(), mask=torch.ones(S, S, dtype=torch.long)), TypeError, r"mask must be a bool tensor .*int64"),
    ("mask-wrong-shape", fwd(x32(), mask=torch.ones(S, S + 1, dtype=BOOL)), ValueError,
     r"mask must be broadcastable to \[B, H, S, Sk\] = \[2, 4, 5, 5\], got shape \[5, 6\]"),
    ("mask-rank-5", fwd(x32(), mask=torch.ones(1, B, H, S, S, dtype=BOOL)), ValueError, r"mask must be broadcastable"),
    ("mask-not-a-tensor", fwd(x32(), mask=[[True] * S] * S), TypeError, r"mask must be a torch.Tensor"),
    ("mask-on-meta-device", fwd(x32(), mask=torch.ones(S, S, dtype=BOOL, device="meta")), ValueError,
     r"mask must be on device cpu"),
    ("key_mask-float", fwd(x32(), key_mask=torch.ones(B, S)), TypeError, r"key_mask must be a bool tensor"),
    ("key_mask-int", fwd(x32(), key_mask=torch.ones(B, S, dtype=torch.long)), TypeError, r"key_mask must be a bool"),
    ("key_mask-wrong-length", fwd(x32(), key_mask=torch.ones(B, S + 1, dtype=BOOL)), ValueError,
     r"key_mask must have shape \[B, Sk\] = \[2, 5\], got \[2, 6\]"),
    ("key_mask-wrong-batch", fwd(x32(), key_mask=torch.ones(1, S, dtype=BOOL)), ValueError,
     r"key_mask must have shape \[B, Sk\]"),
    ("key_mask-1d", fwd(x32(), key_mask=torch.ones(S, dtype=BOOL)), ValueError, r"key_mask must have 2 dimensions"),
    ("key_mask-length-of-x-not-context", fwd(x32(), x32(B, 7, E), key_mask=torch.ones(B, S, dtype=BOOL)),
     ValueError, r"key_mask must have shape \[B, Sk\] = \[2, 7\]"),
    ("positions-without-rope", fwd(x32(), positions=torch.arange(S)), ValueError, r"positions .*no rope"),
    ("positions-float", fwd(x32(), positions=torch.arange(S).float(), layer={"rope": mh.RoPE(4)}), TypeError,
     r"positions must be an integer tensor, got dtype torch.float32"),
    ("positions-wrong-length", fwd(x32(), positions=torch.arange(S + 1), layer={"rope": mh.RoPE(4)}), ValueError,
     r"positions must have shape \[S\] = \[5\]"),
    # -- mh.attention(q, k, v, ...) ---------------------------------------------------------
    ("attention-q-not-a-tensor", attn(q=np.zeros((B, 4, 5, 8))), TypeError, r"q must be a torch.Tensor"),
    ("attention-q-rank-3", attn(q=torch.randn(4, 5, 8)), ValueError, r"q must have 4 dimensions, got 3"),
    ("attention-k-rank-5", attn(k=torch.randn(1, B, 4, 5, 8)), ValueError, r"k must have 4 dimensions, got 5"),
    ("attention-v-rank-3", attn(v=torch.randn(4, 5, 8)), ValueError, r"v must have 4 dimensions, got 3"),
    ("attention-q-integer", attn(q=torch.ones(B, 4, 5, 8, dtype=torch.long)), TypeError,
     r"q must be a floating-point tensor"),
    ("attention-head-dim-mismatch", attn(k=torch.randn(B, 4, 5, 6)), ValueError, r"k must have head dim 8 .*got 6"),
    ("attention-v-length-mismatch", attn(v=torch.randn(B, 4, 6, 8)), ValueError,
     r"v must have shape \[B, Hkv, Sk, Dv\]"),
    ("attention-batch-mismatch", attn(k=torch.randn(1, 4, 5, 8), v=torch.randn(1, 4, 5, 8)), ValueError,
     r"batch size"),
    ("attention-heads-not-divisible-by-kv-heads", attn(k=torch.randn(B, 3, 5, 8), v=torch.randn(B, 3, 5, 8)),
     ValueError, r"query heads \(4\) must be a multiple of the number of K/V heads \(3\)"),
    ("attention-k-dtype-differs", attn(k=torch.randn(B, 4, 5, 8, dtype=torch.float64)), TypeError,
     r"k must have dtype torch.float32 like q, got torch.float64"),
    ("attention-v-on-meta-device", attn(v=torch.randn(B, 4, 5, 8, device="meta")), ValueError,
     r"v must be on device cpu like q"),
    ("attention-mask-float", attn(mask=torch.zeros(5, 5)), TypeError, r"mask must be a bool tensor"),
    ("attention-mask-wrong-shape", attn(mask=torch.ones(5, 4, dtype=BOOL)), ValueError,
     r"mask must be broadcastable to \[B, H, Sq, Sk\]"),
    ("attention-backend-unknown", attn(backend="nope"), ValueError,
     r"backend must be one of \[.*'explicit'.*'sdpa'.*\], got 'nope'"),
    ("attention-return_weights-with-sdpa", attn(return_weights=True, backend="sdpa"), ValueError,
     r"backend 'sdpa' cannot do returning attention weights"),
    ("attention-window-zero", attn(window=0), ValueError, r"window must be in \[1, .*got 0"),
    ("attention-window-float", attn(window=2.5), TypeError, r"window must be an int"),
    ("attention-dropout_p-one", attn(dropout_p=1.0), ValueError, r"dropout_p must be in \[0.0, 1.0\)"),
    ("attention-dropout_p-negative", attn(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0.0, 1.0\)"),
    ("attention-scale-negative", attn(scale=-1.0), ValueError, r"scale must be in \(0.0"),
    # -- RoPE --------------------------------------------------------------------------------
    ("rope-odd-head_dim", lambda: mh.RoPE(7), ValueError, r"head_dim must be even .*got 7"),
    ("rope-rotary_dim-above-head_dim", lambda: mh.RoPE(8, rotary_dim=10), ValueError,
     r"rotary_dim must be even and <= head_dim=8, got 10"),
    ("rope-odd-rotary_dim", lambda: mh.RoPE(8, rotary_dim=3), ValueError, r"rotary_dim must be even"),
    ("rope-base-zero", lambda: mh.RoPE(8, base=0.0), ValueError, r"base must be in \(0.0"),
    ("rope-x-wrong-head-dim", lambda: mh.RoPE(8)(torch.randn(1, 2, 5, 6)), ValueError, r"x must have head dim 8"),
    ("rope-x-rank-3", lambda: mh.RoPE(8)(torch.randn(2, 5, 8)), ValueError, r"x must have 4 dimensions"),
    ("rope-positions-float", lambda: mh.RoPE(8)(torch.randn(1, 2, 5, 8), torch.arange(5.0)), TypeError,
     r"positions must be an integer tensor, got dtype torch.float32"),
    ("rope-positions-bool", lambda: mh.RoPE(8)(torch.randn(1, 2, 5, 8), torch.ones(5, dtype=BOOL)), TypeError,
     r"positions must be an integer tensor"),
    ("rope-positions-wrong-length", lambda: mh.RoPE(8)(torch.randn(1, 2, 5, 8), torch.arange(4)), ValueError,
     r"positions must have shape \[S\] = \[5\] or \[B, S\] = \[1, 5\], got \[4\]"),
    ("rope-positions-rank-3", lambda: mh.RoPE(8)(torch.randn(1, 2, 5, 8), torch.zeros(1, 1, 5, dtype=torch.long)),
     ValueError, r"positions must have 1 or 2 dimensions"),
    ("interleaved_to_half-rows-not-multiple-of-heads", lambda: mh.interleaved_to_half(torch.randn(10, 4), 4),
     ValueError, r"weight must have a multiple of num_heads=4 rows, got 10"),
    ("interleaved_to_half-rotary_dim-above-head-dim", lambda: mh.interleaved_to_half(torch.randn(16, 4), 4, 6),
     ValueError, r"rotary_dim must be even and <= head dim 4, got 6"),
    # -- masks, reference, trace ------------------------------------------------------------
    ("causal_mask-sq-zero", lambda: mh.masks.causal_mask(0), ValueError, r"sq must be in \[1"),
    ("sliding_window_mask-window-zero", lambda: mh.masks.sliding_window_mask(4, window=0), ValueError,
     r"window must be in \[1"),
    ("key_padding_mask-float", lambda: mh.masks.key_padding_mask(torch.ones(2, 5)), TypeError,
     r"key_mask must be a bool tensor"),
    ("to_additive-not-bool", lambda: mh.masks.to_additive(torch.ones(2, 5)), TypeError, r"mask must be a bool tensor"),
    ("from_additive-integer", lambda: mh.masks.from_additive(torch.zeros(2, 5, dtype=torch.long)), TypeError,
     r"mask must be a floating-point additive mask"),
    ("reference-num_heads-does-not-divide-rows", lambda: mh.reference.multi_head_attention(
        np.ones((6, 3)), np.ones((6, 6)), np.ones((6, 6)), np.ones((6, 6)), np.ones((6, 6)), 4),
     ValueError, r"num_heads=4"),
    ("reference-X-rank-3", lambda: mh.reference.multi_head_attention(
        np.ones((1, 6, 3)), np.ones((6, 6)), np.ones((6, 6)), np.ones((6, 6)), np.ones((6, 6)), 2),
     ValueError, r"X must have 2 dimensions"),
    ("trace-not-a-layer", lambda: mh.trace(nn.Linear(4, 4), torch.randn(1, 2, 4)), TypeError,
     r"layer must be a multihead.MultiHeadAttention"),
]


# Layers whose context widths cannot work are refused up front.
CONTEXT_WIDTHS = [
    pytest.param(lambda: MHA(E, H, kdim=10, vdim=12), ValueError, r"vdim", id="ctor-kdim-differs-from-vdim"),
    pytest.param(fwd(x32(), layer={"kdim": 10}), ValueError, r"context", id="self-attention-on-layer-with-kdim"),
]


@pytest.fixture
def work_done(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every projection, rotation and attention backend call that completes."""
    done: list[str] = []

    def spy(name: str, real: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            out = real(*args, **kwargs)
            done.append(name)
            return out
        return wrapped

    monkeypatch.setattr(nn.Linear, "forward", spy("projection", nn.Linear.forward))
    real_linears = mh.linear.linears  # linear.linear goes through it too

    def linears(x, layers):
        out = real_linears(x, layers)
        done.extend(["projection"] * len(layers))
        return out

    monkeypatch.setattr(mh.linear, "linears", linears)
    monkeypatch.setattr(mh.rope, "apply_rotary", spy("rope", mh.rope.apply_rotary))
    for name in mh.backends.available_backends():
        spec = registry.get_spec(name)
        monkeypatch.setitem(registry._SPECS, name, dataclasses.replace(spec, fn=spy(name, spec.fn)))
    return done


@pytest.mark.parametrize("call, error, message",
                         [pytest.param(*c[1:], id=c[0]) for c in CASES] + CONTEXT_WIDTHS)
def test_bad_input_raises_before_any_work(call: Callable[[], object], error: type[Exception], message: str,
                                          work_done: list[str]) -> None:
    with pytest.raises(error, match=message):
        call()
    assert work_done == []


def test_work_done_fixture_sees_a_good_call(work_done: list[str]) -> None:
    """The spies of the test above do record real work (so that test can fail)."""
    MHA(E, H, rope=mh.RoPE(4))(x32())
    assert work_done.count("projection") == 4 and "rope" in work_done and "auto" in work_done


def test_unknown_backend_message_lists_every_registered_name() -> None:
    with pytest.raises(ValueError) as info:
        mh.backends.get_backend("nope")
    for name in mh.backends.available_backends():
        assert repr(name) in str(info.value)


def test_cli_rejects_non_positive_seq(capsys: pytest.CaptureFixture[str]) -> None:
    from multihead import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["explain", "--seq", "0"])
    assert info.value.code == 2
    assert "--seq must be a positive integer, got 0" in capsys.readouterr().err
