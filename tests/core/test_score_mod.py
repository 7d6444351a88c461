"""Additive biases and score_mods (FlexAttention's ``score_mod``): exact, differentiable, refused by name.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim,
NB buckets.

Oracles: the float64 ``"explicit"`` backend with the bias written out densely; Hugging
Face's T5 (its bucketing and its ``compute_bias``); flash-attention's accuracy criterion for
gradients (error against float64 at most 3x that of the naive float32 computation,
``"explicit"`` in float32: tests/backends/test_accuracy_cases.py).
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from multihead import score_mods as sm
from multihead.backends import auto, native, registry
from multihead.mask_mods import causal_mask_mod


def qkv(b: int = 2, h: int = 4, hkv: int = 2, sq: int = 24, sk: int = 40, d: int = 16,
        dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, h, sq, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hkv, sk, d, generator=gen, dtype=dtype)
    return q, k, torch.randn(b, hkv, sk, d, generator=gen, dtype=dtype)


def max_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    return (got.double() - truth).abs().max().item()


def positions(sq: int, sk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Sq, 1) query positions i + Sk - Sq and (1, Sk) key positions."""
    return torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]


# -- T5 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20), (6, 7)])
def test_t5_buckets_are_transformers_exactly(bidirectional: bool, num_buckets: int, max_distance: int) -> None:
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    relative = torch.arange(-600, 601)
    want = t5.T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    got = sm.t5_buckets(num_buckets, max_distance, bidirectional)(torch.zeros_like(relative), relative)
    assert torch.equal(got, want)


@pytest.mark.parametrize("is_decoder, sq, sk", [(False, 9, 9), (True, 9, 9), (True, 1, 12), (False, 5, 11)])
def test_a_t5_relative_bias_score_mod_is_t5s_compute_bias(is_decoder: bool, sq: int, sk: int) -> None:
    """T5's position_bias from its own module (a decoder step at cache position Sk - 1 included),
    as a bias and as the score_mod; T5 does not scale its logits."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(d_model=32, d_kv=8, num_heads=4, relative_attention_num_buckets=16,
                                   relative_attention_max_distance=40, is_decoder=is_decoder)
    layer = transformers.models.t5.modeling_t5.T5Attention(config, has_relative_attention_bias=True).double()
    with torch.no_grad():
        position_bias = layer.compute_bias(sq, sk, past_seen_tokens=sk - sq)  # (1, H, Sq, Sk)
    table = layer.relative_attention_bias.weight.T.detach()  # (H, NB)
    mod = sm.relative_bias(table, sm.t5_buckets(16, 40, bidirectional=not is_decoder))
    q, k, v = qkv(h=4, hkv=4, sq=sq, sk=sk)
    want = mh.attention(q, k, v, scale=1.0, bias=position_bias, backend="explicit")
    for backend in ("explicit", "auto"):
        torch.testing.assert_close(mh.attention(q, k, v, scale=1.0, score_mod=mod, backend=backend), want)
    torch.testing.assert_close(mh.attention(q, k, v, scale=1.0, bias=position_bias, backend="sdpa"), want)


# -- building blocks -----------------------------------------------------------------------------


def test_building_blocks_equal_their_written_out_logits() -> None:
    q, k, v = qkv()
    slopes = mh.logits.alibi_slopes(4).double()
    scales = torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=torch.float64)
    qp, kp = positions(24, 40)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.25  # (B, H, Sq, Sk)
    cases = {
        "alibi": (sm.alibi(slopes), scores - slopes[:, None, None] * (qp - kp).abs()),
        "soft_cap": (sm.soft_cap(2.0), 2.0 * torch.tanh(scores / 2.0)),
        "head_scale": (sm.head_scale(scales), scores * scales[:, None, None]),
        "tanh": (sm.tanh, torch.tanh(scores)),
        "clamp": (sm.clamp(-0.5, 0.7), scores.clamp(-0.5, 0.7)),
        "compose": (sm.compose(sm.head_scale(scales), sm.soft_cap(1.5), sm.clamp(-1.0, 1.0)),
                    (1.5 * torch.tanh(scores * scales[:, None, None] / 1.5)).clamp(-1.0, 1.0)),
    }
    for name, (mod, logits) in cases.items():
        want = torch.softmax(logits, -1) @ v.repeat_interleave(2, 1)
        got = mh.attention(q, k, v, scale=0.25, score_mod=mod)
        torch.testing.assert_close(got, want, msg=name)


def test_alibi_and_soft_cap_score_mods_equal_the_built_in_features() -> None:
    q, k, v = qkv()
    slopes = mh.logits.alibi_slopes(4).double()
    torch.testing.assert_close(mh.attention(q, k, v, causal=True, score_mod=sm.alibi(slopes)),
                               mh.attention(q, k, v, causal=True, alibi_slopes=slopes, backend="explicit"))
    torch.testing.assert_close(mh.attention(q, k, v, score_mod=sm.soft_cap(3.0)),
                               mh.attention(q, k, v, softcap=3.0, backend="explicit"))


def test_the_score_mod_sees_the_logits_after_softcap_and_the_bias_before_masking() -> None:
    q, k, v = qkv()
    bias = torch.randn(1, 4, 24, 40, dtype=torch.float64)
    seen = {}

    def spy(score, b, h, q_idx, kv_idx):
        seen["score"] = score.clone()
        return score
    mh.attention(q, k, v, softcap=2.0, bias=bias, causal=True, score_mod=spy)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.25
    torch.testing.assert_close(seen["score"], 2.0 * torch.tanh(scores / 2.0) + bias)  # no -inf yet


# -- gradients -----------------------------------------------------------------------------------


def test_gradients_into_a_learned_table_of_a_score_mod_are_the_float64_references() -> None:
    """A Python score_mod capturing a (H, NB) table: its gradient (and dq, dk, dv) equal those
    of the same bias written out densely, in float64."""
    q, k, v = qkv()
    table = torch.randn(4, 16, dtype=torch.float64)
    buckets = sm.t5_buckets(16, 30, bidirectional=False)
    upstream = torch.randn(2, 4, 24, 16, dtype=torch.float64)

    def mine(score, b, h, q_idx, kv_idx):  # an arbitrary callable, not a building block
        return score + table_leaf[h, buckets(q_idx, kv_idx)] * torch.sigmoid(score)

    table_leaf = table.clone().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = mh.attention(*leaves, causal=True, score_mod=mine)
    got = torch.autograd.grad(out, [*leaves, table_leaf], upstream)

    qp, kp = positions(24, 40)
    ref_table = table.clone().requires_grad_()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    scores = (ref[0] @ ref[1].repeat_interleave(2, 1).transpose(-1, -2)) * 0.25  # (B, H, Sq, Sk)
    scores = scores + ref_table[:, buckets(qp, kp)] * torch.sigmoid(scores)
    scores = scores.masked_fill(kp > qp, float("-inf"))
    want_out = torch.softmax(scores, -1) @ ref[2].repeat_interleave(2, 1)
    want = torch.autograd.grad(want_out, [*ref, ref_table], upstream)
    for name, g, w in zip(("dq", "dk", "dv", "dtable"), got, want):
        torch.testing.assert_close(g, w, msg=name)
    assert got[3].abs().sum() > 0


def test_score_mod_gradients_in_float32_meet_flash_attentions_criterion() -> None:
    """A T5 relative bias as a score_mod, float32: dq, dk, dv and the table's gradient within 3x
    the errors of the naive float32 computation (the same bias gathered densely, ``bias=``)."""
    q, k, v = qkv(b=2, h=4, hkv=4, sq=64, sk=64, d=32)
    table = torch.randn(4, 32, dtype=torch.float64)
    buckets = sm.t5_buckets(32, 128, bidirectional=False)
    qp, kp = positions(64, 64)
    upstream = torch.randn(2, 4, 64, 32, dtype=torch.float64)

    def grads(dtype: torch.dtype, as_mod: bool) -> tuple[torch.Tensor, ...]:
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, table)]
        if as_mod:
            out = mh.attention(*leaves[:3], causal=True, score_mod=sm.relative_bias(leaves[3], buckets))
        else:
            out = mh.attention(*leaves[:3], causal=True, bias=leaves[3][:, buckets(qp, kp)], backend="explicit")
        return torch.autograd.grad(out, leaves, upstream.to(dtype))
    truth, naive, ours = grads(torch.float64, False), grads(torch.float32, False), grads(torch.float32, True)
    for name, got, want, base in zip(("dq", "dk", "dv", "dtable"), ours, truth, naive):
        err, naive_err = max_error(got, want), max_error(base, want)
        assert err <= 3 * naive_err, f"{name}: error {err:.3e} > 3 x naive {naive_err:.3e}"


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_bias_gradients_meet_flash_attentions_criterion(backend: str) -> None:
    """dq, dk, dv and dbias in float32 within 3x the naive float32 errors (float64 as the truth);
    a causal mask and a per-head bias, Sq != Sk, GQA 4/2, D = 64."""
    q, k, v = qkv(b=2, h=4, hkv=2, sq=96, sk=128, d=64)
    bias = torch.randn(1, 4, 96, 128, dtype=torch.float64) * 2
    upstream = torch.randn(2, 4, 96, 64, dtype=torch.float64)

    def grads(name: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, bias)]
        out = mh.attention(*leaves[:3], causal=True, bias=leaves[3], backend=name)
        return torch.autograd.grad(out, leaves, upstream.to(dtype))
    truth, naive = grads("explicit", torch.float64), grads("explicit", torch.float32)
    ours = grads(backend, torch.float32)
    for name, got, want, base in zip(("dq", "dk", "dv", "dbias"), ours, truth, naive):
        err, naive_err = max_error(got, want), max_error(base, want)
        assert err <= 3 * naive_err, f"{name}: error {err:.3e} > 3 x naive {naive_err:.3e}"


@pytest.mark.parametrize("backend", ["explicit", "sdpa"])
def test_rows_with_no_key_give_zeros_and_zero_gradients_with_a_bias(backend: str) -> None:
    q, k, v = qkv(dtype=torch.float32)
    bias = torch.randn(2, 1, 24, 40).requires_grad_()
    mask = torch.ones(2, 1, 24, 40, dtype=torch.bool)
    mask[1, :, 5] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = mh.attention(*leaves, mask=mask, bias=bias, backend=backend)
    assert out[1, :, 5].abs().max() == 0
    dq, dbias = torch.autograd.grad(out.sum(), [leaves[0], bias])
    assert dq[1, :, 5].abs().max() == 0 and dbias[1, :, 5].abs().max() == 0 and dbias.abs().sum() > 0


def test_a_bias_with_a_mask_mod_equals_the_float64_reference() -> None:
    q, k, v = qkv(dtype=torch.float32)
    bias = torch.randn(24, 40)
    dense = torch.arange(40)[None, :] <= torch.arange(24)[:, None] + 16
    want = mh.attention(q.double(), k.double(), v.double(), mask=dense, bias=bias.double(), backend="explicit")
    for backend in ("explicit", "sdpa", "auto"):
        got = mh.attention(q, k, v, mask_mod=causal_mask_mod, bias=bias, backend=backend)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


# -- the registry and auto -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", [n for n in ("blocked", "native") if n in registry.available_backends()])
def test_a_backend_without_bias_or_score_mod_refuses_them_by_name(backend: str) -> None:
    q, k, v = qkv(dtype=torch.float32)
    if backend == "blocked":  # the native loop adds a bias in its forward (tests/backends/test_native_bias.py)
        refusal = (r"backend 'blocked' cannot do an additive bias \(bias=...\); "
                   r"backends that can: \[.*'explicit', 'sdpa'")
        with torch.no_grad(), pytest.raises(ValueError, match=refusal):
            mh.attention(q, k, v, bias=torch.zeros(24, 40), backend=backend)
    clamped = sm.clamp(-1.0, 1.0)  # no fast path runs it (tanh is soft-capping at 1: native)
    with torch.no_grad(), pytest.raises(ValueError, match=rf"backend '{backend}' cannot do a score_mod"):
        mh.attention(q, k, v, score_mod=clamped, backend=backend)
    with pytest.raises(ValueError, match=r"backend 'sdpa' cannot do a score_mod \(score_mod=...\); "
                                         r"backends that can: \['explicit', 'auto'\]"):
        mh.attention(q, k, v, score_mod=clamped, backend="sdpa")


def test_auto_routes_a_bias_to_sdpa_or_explicit_and_a_score_mod_to_explicit() -> None:
    q, k, v = qkv(dtype=torch.float32)
    bias = torch.zeros(24, 40)
    native_runs = native.available() and native.vector_bits() in auto.NATIVE_MIN_SCORES
    assert auto.auto_path(q, k, v, bias=bias) == ("native (features)" if native_runs else "sdpa (additive bias)")
    tiny = qkv(dtype=torch.float32, sq=4, sk=4)  # 128 scores: below the native loop's threshold
    assert auto.auto_path(*tiny, bias=torch.zeros(4, 4)) == "sdpa (additive bias)"
    assert auto.auto_path(q.requires_grad_(), k, v, bias=bias) == "sdpa (additive bias)"
    assert auto.auto_path(q, k, v, bias=bias, softcap=5.0) == "explicit (additive bias)"
    assert auto.auto_path(q, k, v, bias=bias, return_lse=True) == "explicit (additive bias)"
    assert auto.auto_path(q, k, v, score_mod=sm.clamp(-1.0, 1.0)) == "explicit (score_mod)"
    wide = qkv(dtype=torch.float32, d=96)
    assert auto.auto_path(wide[0].requires_grad_(), *wide[1:], bias=bias) == "explicit (additive bias)"
    assert "SDPA with the bias merged" in auto.AUTO_PATHS["sdpa (additive bias)"]


def test_bad_biases_and_score_mods_are_refused_naming_the_argument() -> None:
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(TypeError, match="bias must be a floating tensor .* got dtype torch.bool"):
        mh.attention(q, k, v, bias=torch.ones(24, 40, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"bias must be broadcastable to \[B, H, Sq, Sk\] = \[2, 4, 24, 40\], "
                                         r"got shape \[24, 41\]"):
        mh.attention(q, k, v, bias=torch.zeros(24, 41))
    with pytest.raises(TypeError, match="score_mod must be a callable"):
        mh.attention(q, k, v, score_mod=3.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="score_mod must return a floating tensor .* got dtype torch.bool"):
        mh.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: qi >= ki)
    with pytest.raises(ValueError, match=r"score_mod must return scores broadcastable to \(B, H, Sq, Sk\)"):
        mh.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s[..., :3])
    with pytest.raises(ValueError, match="compose needs at least one score_mod"):
        sm.compose()
    with pytest.raises(ValueError, match=r"hi must be in \[1.0, inf\], got 0.0"):
        sm.clamp(1.0, 0.0)



def _written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mod: sm.ScoreMod) -> torch.Tensor:
    """float64 softmax(score_mod(q·kᵀ/√D))·v with the score_mod called on broadcast indices."""
    qd, kd, vd = (t.double() for t in (q, k, v))
    s = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, Sq, Sk)
    sq, sk = q.shape[2], k.shape[2]
    idx_q = torch.arange(sk - sq, sk)[None, None, :, None]
    idx_k = torch.arange(sk)[None, None, None, :]
    s = mod(s, torch.zeros(1, 1, 1, 1, dtype=torch.long), torch.arange(q.shape[1])[None, :, None, None], idx_q, idx_k)
    return torch.softmax(s, -1) @ vd


def test_building_blocks_are_lowered_to_the_features_the_fast_paths_run() -> None:
    """soft_cap, alibi and relative_bias run as the native loop's features (a bias), relative_bias
    with gradients on SDPA (its gradient reaching the table); out of the features' order, a
    composition stays a score_mod on "explicit"; every one equals the score_mod written out in float64."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 300, 32, generator=g) for _ in range(3))
    table = torch.randn(4, 16, generator=g)
    rel = sm.relative_bias(table, sm.t5_buckets(16, 64, bidirectional=True))
    native = mh.native.available()  # the native loop takes soft-capping, ALiBi and a bias without gradients
    cases = [(sm.soft_cap(20.0), "native (features)" if native else "explicit (softcap)"),
             (sm.alibi(mh.logits.alibi_slopes(4)), "native (features)" if native else "sdpa (bias)"),
             (rel, "native (features)" if native else "sdpa (additive bias)"),
             (sm.compose(sm.soft_cap(20.0), rel), "native (features)" if native else "explicit (additive bias)"),
             (sm.compose(rel, sm.soft_cap(20.0)), "explicit (score_mod)")]
    for mod, path in cases:
        assert auto.auto_path(q, k, v, score_mod=mod) == path, mod
        with torch.no_grad():
            got = mh.attention(q, k, v, score_mod=mod)
        assert (got.double() - _written_out(q, k, v, mod)).abs().max() < 1e-5, mod
    leaf, table64 = table.clone().requires_grad_(), table.double().requires_grad_()
    assert auto.auto_path(q, k, v, score_mod=sm.relative_bias(leaf, rel.buckets)) == "sdpa (additive bias)"
    mh.attention(q, k, v, score_mod=sm.relative_bias(leaf, rel.buckets)).square().sum().backward()
    _written_out(q, k, v, sm.relative_bias(table64, rel.buckets)).square().sum().backward()
    assert leaf.grad is not None and table64.grad is not None
    torch.testing.assert_close(leaf.grad.double(), table64.grad, rtol=1e-4, atol=1e-5)


def test_head_scale_and_tanh_are_lowered_first_and_stay_exact() -> None:
    """head_scale (first in a composition) becomes each head's queries times its scale, and tanh
    soft-capping at 1: both take the native loop's path, equal the score_mod written out in float64
    within twice the naive float32 error, and the scales get their gradient. A head_scale after
    another building block stays a score_mod on "explicit"."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 300, 32, generator=g, dtype=torch.float64) for _ in range(3))
    scales = torch.rand(4, generator=g, dtype=torch.float64) + 0.5
    native = mh.native.available()
    cases = [(sm.head_scale(scales), "native" if native else "sdpa"),
             (sm.tanh, "native (features)" if native else "explicit (softcap)"),
             (sm.compose(sm.head_scale(scales), sm.soft_cap(5.0), sm.alibi(mh.logits.alibi_slopes(4))),
              "native (features)" if native else "explicit (softcap)"),
             (sm.compose(sm.soft_cap(5.0), sm.head_scale(scales)), "explicit (score_mod)")]
    low = tuple(t.float() for t in (q, k, v))
    for mod, path in cases:
        low_mod = mod if not isinstance(mod, (sm.HeadScale, sm.Compose)) else _as_float(mod)
        assert auto.auto_path(*low, score_mod=low_mod) == path, mod
        truth = _written_out(q, k, v, mod)
        with torch.no_grad():
            got = mh.attention(*low, score_mod=low_mod)
            naive = mh.attention(*low, score_mod=low_mod, backend="explicit")
        assert (got.double() - truth).abs().max() <= 2 * (naive.double() - truth).abs().max() + 1e-7, mod
    leaf, leaf64 = scales.float().requires_grad_(), scales.clone().requires_grad_()
    mh.attention(*low, score_mod=sm.head_scale(leaf)).square().sum().backward()
    _written_out(q, k, v, sm.head_scale(leaf64)).square().sum().backward()
    torch.testing.assert_close(leaf.grad.double(), leaf64.grad, rtol=1e-4, atol=1e-5)


def _as_float(mod: sm.ScoreMod) -> sm.ScoreMod:
    """mod with its float64 tensors in float32 (the scales and slopes the float32 call takes)."""
    if isinstance(mod, sm.HeadScale):
        return sm.head_scale(mod.scales.float())
    if isinstance(mod, sm.Alibi):
        return sm.alibi(mod.slopes.float())
    if isinstance(mod, sm.Compose):
        return sm.compose(*(_as_float(m) for m in mod.mods))
    return mod
