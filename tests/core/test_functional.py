"""The functional core ``mh.attention``, its backends and the mask helpers.

Notation: B batch, H query heads, Hkv key/value heads, G = H // Hkv, Sq queries,
Sk keys, D head dim (Dv for values).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from conftest import ATOL64, np64, reference_core

F64 = torch.float64
BACKENDS = ("sdpa", "explicit")


def qkv(b=2, h=4, hkv=4, sq=5, sk=5, d=8, dv=None, dtype=F64, requires_grad=False):
    """Random q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv)."""
    dv = d if dv is None else dv
    q = torch.randn(b, h, sq, d, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(b, hkv, sk, d, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(b, hkv, sk, dv, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


# (id, qkv sizes, attention kwargs; "mask" is built from (B, H, Sq, Sk))
CASES = [
    ("bidirectional", {}, {}),
    ("causal", {}, {"causal": True}),
    ("h1", {"h": 1, "hkv": 1}, {"causal": True}),
    ("h3", {"h": 3, "hkv": 3}, {}),
    ("h12", {"h": 12, "hkv": 12, "d": 4}, {"causal": True}),
    ("gqa", {"h": 4, "hkv": 2}, {}),
    ("gqa-causal", {"h": 6, "hkv": 2}, {"causal": True}),
    ("mqa-causal", {"h": 4, "hkv": 1}, {"causal": True}),
    ("cross-sq-lt-sk", {"sq": 3, "sk": 7}, {}),
    ("causal-sq-lt-sk-bottom-right", {"sq": 3, "sk": 7}, {"causal": True}),
    ("causal-sq-gt-sk-bottom-right", {"sq": 7, "sk": 3}, {"causal": True}),
    ("causal-single-query-decoding", {"sq": 1, "sk": 6, "h": 4, "hkv": 2}, {"causal": True}),
    ("value-dim-differs", {"dv": 5}, {"causal": True}),
    ("mask-full", {}, {"mask": lambda b, h, sq, sk: torch.rand(b, h, sq, sk) > 0.3}),
    ("mask-broadcast-sq-sk", {"sq": 4, "sk": 6}, {"mask": lambda b, h, sq, sk: torch.rand(sq, sk) > 0.3}),
    ("mask-key-padding-shape", {}, {"mask": lambda b, h, sq, sk: torch.rand(b, 1, 1, sk) > 0.3}),
    ("mask-and-causal", {"h": 4, "hkv": 2},
     {"causal": True, "mask": lambda b, h, sq, sk: torch.rand(b, h, sq, sk) > 0.3}),
    ("window-causal", {"sq": 6, "sk": 6}, {"causal": True, "window": 3}),
    ("window-causal-sq-lt-sk", {"sq": 3, "sk": 8}, {"causal": True, "window": 2}),
    ("window-bidirectional", {"sq": 6, "sk": 6}, {"window": 2}),
    ("window-and-mask", {}, {"causal": True, "window": 2, "mask": lambda b, h, sq, sk: torch.rand(b, h, sq, sk) > 0.3}),
    ("custom-scale", {}, {"scale": 0.9}),
]


def _case(sizes: dict, kwargs: dict):
    q, k, v = qkv(**sizes)
    b, h, sq, _ = q.shape
    kwargs = {n: (f(b, h, sq, k.shape[2]) if callable(f) else f) for n, f in kwargs.items()}
    return q, k, v, kwargs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sizes, kwargs", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_attention_equals_reference(sizes: dict, kwargs: dict, backend: str) -> None:
    q, k, v, kwargs = _case(sizes, kwargs)
    want, _ = reference_core(q, k, v, **kwargs)
    got = mh.attention(q, k, v, **kwargs, backend=backend)
    assert got.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[-1])
    np.testing.assert_allclose(np64(got), want, rtol=0, atol=ATOL64)


@pytest.mark.parametrize("sizes, kwargs", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_weights_equal_reference_A_per_head(sizes: dict, kwargs: dict) -> None:
    q, k, v, kwargs = _case(sizes, kwargs)
    want_out, want_a = reference_core(q, k, v, **kwargs)
    out, weights = mh.attention(q, k, v, **kwargs, return_weights=True)
    assert weights.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    np.testing.assert_allclose(np64(weights), want_a, rtol=0, atol=ATOL64)
    np.testing.assert_allclose(np64(out), want_out, rtol=0, atol=ATOL64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_query_head_i_reads_kv_head_i_floordiv_group(backend: str) -> None:
    q, k, v = qkv(h=6, hkv=2)
    repeated = mh.attention(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), backend=backend)
    torch.testing.assert_close(mh.attention(q, k, v, backend=backend), repeated, rtol=0, atol=ATOL64)


def test_causal_is_bottom_right_not_sdpa_top_left() -> None:
    q, k, v = qkv(sq=3, sk=6)
    ours = mh.attention(q, k, v, causal=True)
    explicit_mask = mh.attention(q, k, v, mask=mh.masks.causal_mask(3, 6))
    torch.testing.assert_close(ours, explicit_mask, rtol=0, atol=ATOL64)
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (ours - top_left).abs().max() > 1e-3


def test_causal_with_equal_lengths_matches_sdpa_is_causal() -> None:
    q, k, v = qkv()
    torch.testing.assert_close(mh.attention(q, k, v, causal=True, backend="explicit"),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=0, atol=ATOL64)


def test_default_scale_is_one_over_sqrt_head_dim() -> None:
    q, k, v = qkv(d=16)
    torch.testing.assert_close(mh.attention(q, k, v), mh.attention(q, k, v, scale=1 / 4), rtol=0, atol=0)
    assert (mh.attention(q, k, v) - mh.attention(q, k, v, scale=1 / math.sqrt(64))).abs().max() > 1e-3


def test_default_backend_is_auto_and_weights_default_to_explicit() -> None:
    assert mh.functional.DEFAULT_BACKEND == "auto"
    assert set(BACKENDS) <= set(mh.backends.available_backends())
    q, k, v = qkv()
    torch.testing.assert_close(mh.attention(q, k, v), mh.attention(q, k, v, backend="auto"), rtol=0, atol=0)
    torch.testing.assert_close(mh.attention(q, k, v), mh.attention(q, k, v, backend="sdpa"))
    out, _ = mh.attention(q, k, v, return_weights=True)
    torch.testing.assert_close(out, mh.attention(q, k, v, backend="explicit"), rtol=0, atol=0)


def test_registered_backend_is_dispatched_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def spy(q, k, v, **kwargs):
        calls.append(kwargs)
        return torch.zeros_like(q), None

    monkeypatch.setitem(mh.backends._BACKENDS, "spy", spy)
    q, k, v = qkv()
    out = mh.attention(q, k, v, causal=True, backend="spy")
    assert out.abs().max() == 0 and len(calls) == 1
    assert calls[0]["causal"] is True and calls[0]["scale"] == pytest.approx(1 / math.sqrt(8))


def test_dropout_changes_output_only_when_positive() -> None:
    q, k, v = qkv()
    torch.testing.assert_close(mh.attention(q, k, v, dropout_p=0.0), mh.attention(q, k, v), rtol=0, atol=0)
    assert (mh.attention(q, k, v, dropout_p=0.5) - mh.attention(q, k, v)).abs().max() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_give_half_outputs_close_to_float32(dtype: torch.dtype, backend: str) -> None:
    q, k, v = qkv(h=4, hkv=2, dtype=torch.float32)
    want = mh.attention(q, k, v, causal=True, backend=backend)
    got = mh.attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, backend=backend)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2)


# -- fully masked rows: zeros, finite gradients, no NaN --------------------------------


def _fully_masked_setups():
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[1] = False  # query 1 may attend to nothing
    yield "user-mask-row", dict(sq=5, sk=5), dict(mask=mask), [1]
    # Sq > Sk, bottom-right: queries 0..2 sit before the first key.
    yield "causal-sq-gt-sk", dict(sq=6, sk=3), dict(causal=True), [0, 1, 2]
    # A window that a user mask empties: query 4 may see keys 3, 4; the mask blocks both.
    wmask = torch.ones(5, 5, dtype=torch.bool)
    wmask[4, 3:] = False
    yield "window-and-mask", dict(sq=5, sk=5), dict(causal=True, window=2, mask=wmask), [4]


SETUPS = list(_fully_masked_setups())


# sdpa cannot return weights (tested in test_errors), so weights come from "explicit" only.
PATHS = [("sdpa", False), ("explicit", False), ("explicit", True)]
PATH_IDS = ["sdpa", "explicit", "explicit-weights"]


@pytest.mark.parametrize("backend, return_weights", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("sizes, kwargs, rows", [s[1:] for s in SETUPS], ids=[s[0] for s in SETUPS])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_fully_masked_rows_output_zeros_with_finite_gradients(
    sizes: dict, kwargs: dict, rows: list[int], backend: str, return_weights: bool, dtype: torch.dtype
) -> None:
    q, k, v = qkv(h=4, hkv=2, dtype=dtype, requires_grad=True, **sizes)
    result = mh.attention(q, k, v, **kwargs, backend=backend, return_weights=return_weights)
    out = result[0] if return_weights else result
    assert torch.isfinite(out).all()
    assert out[:, :, rows].abs().max() == 0
    assert out.abs().max() > 0  # the other rows are real outputs
    if return_weights:
        weights = result[1]
        assert torch.isfinite(weights).all()
        assert weights[:, :, rows].abs().max() == 0
        others = [i for i in range(q.shape[2]) if i not in rows]
        torch.testing.assert_close(weights[:, :, others].sum(-1).double(),
                                   torch.ones(q.shape[0], q.shape[1], len(others), dtype=F64))
    out.sum().backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(t.grad).all(), name
    assert q.grad[:, :, rows].abs().max() == 0


def test_fully_masked_row_of_reference_is_zero() -> None:
    Q = np.ones((2, 3))
    out, A = mh.reference.attention_head(Q, Q, Q, scale=1.0, mask=np.array([[True] * 3, [False] * 3, [True] * 3]))
    assert np.all(out[:, 1] == 0) and np.all(A[1] == 0)
    np.testing.assert_allclose(A[[0, 2]].sum(1), 1.0)


# -- the accuracy criterion (flash-attention's) ----------------------------------------


def naive_attention32(q, k, v, *, causal: bool) -> torch.Tensor:
    """Plain float32 attention: matmul, softmax, matmul; K/V repeated for GQA."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(~mh.masks.causal_mask(q.shape[2], k.shape[2]), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


ACCURACY_SHAPES = [
    ("bidirectional", dict(b=2, h=4, hkv=4, sq=64, sk=64, d=32), False),
    ("causal", dict(b=2, h=4, hkv=4, sq=64, sk=64, d=32), True),
    ("gqa-causal", dict(b=1, h=8, hkv=2, sq=48, sk=48, d=16), True),
    ("causal-sq-lt-sk", dict(b=1, h=4, hkv=2, sq=16, sk=80, d=64), True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sizes, causal", [s[1:] for s in ACCURACY_SHAPES], ids=[s[0] for s in ACCURACY_SHAPES])
def test_float32_error_at_most_twice_naive_float32(sizes: dict, causal: bool, backend: str) -> None:
    q64, k64, v64 = qkv(**sizes)
    q64 = q64 * 2  # sharper softmax: a more demanding test of rounding
    truth, _ = reference_core(q64, k64, v64, causal=causal)
    q, k, v = q64.float(), k64.float(), v64.float()
    ours = np.abs(np64(mh.attention(q, k, v, causal=causal, backend=backend)) - truth).max()
    naive = np.abs(np64(naive_attention32(q, k, v, causal=causal)) - truth).max()
    # naive is a float32 computation of O(1) outputs: its error is ~1e-7, never 0, so no floor needed.
    assert naive > 0
    assert ours <= 2 * naive, f"{backend}: {ours:.2e} > 2 × naive {naive:.2e}"


# -- mask helpers ----------------------------------------------------------------------


def test_causal_mask_is_bottom_right_as_drawn_in_the_docstring() -> None:
    want = torch.tensor([[1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mh.masks.causal_mask(2, 5), want)


def test_causal_mask_square_is_lower_triangular() -> None:
    assert torch.equal(mh.masks.causal_mask(4), torch.ones(4, 4, dtype=torch.bool).tril())


def test_sliding_window_mask_sees_itself_and_window_minus_one_before() -> None:
    want = torch.tensor([[1, 0, 0, 0],
                         [1, 1, 0, 0],
                         [0, 1, 1, 0],
                         [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mh.masks.sliding_window_mask(4, window=2), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_argument_equals_sliding_window_mask(backend: str) -> None:
    q, k, v = qkv(sq=4, sk=9)
    torch.testing.assert_close(
        mh.attention(q, k, v, causal=True, window=3, backend=backend),
        mh.attention(q, k, v, mask=mh.masks.sliding_window_mask(4, 9, window=3), backend=backend),
        rtol=0, atol=ATOL64)


def test_key_padding_mask_broadcasts_over_heads_and_queries() -> None:
    km = torch.tensor([[True, False, True]])
    out = mh.masks.key_padding_mask(km)
    assert out.shape == (1, 1, 1, 3) and torch.equal(out[0, 0, 0], km[0])


def test_from_torch_mha_inverts_bool_polarity() -> None:
    ignore = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)  # torch: True = ignore
    assert torch.equal(mh.masks.from_torch_mha(ignore), mh.masks.causal_mask(4))


def test_from_torch_mha_reads_float_minus_inf_mask() -> None:
    additive = torch.nn.Transformer.generate_square_subsequent_mask(4)
    assert torch.equal(mh.masks.from_torch_mha(additive), mh.masks.causal_mask(4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, F64])
@pytest.mark.parametrize("blocked", ["-inf", "finfo.min"])
def test_from_additive_reads_minus_inf_and_finfo_min(blocked: str, dtype: torch.dtype) -> None:
    fill = float("-inf") if blocked == "-inf" else torch.finfo(dtype).min
    additive = torch.zeros(3, 3, dtype=dtype).masked_fill(~mh.masks.causal_mask(3), fill)
    assert torch.equal(mh.masks.from_additive(additive), mh.masks.causal_mask(3))


def test_from_additive_rejects_a_real_bias_like_alibi() -> None:
    alibi = -0.5 * (torch.arange(4)[:, None] - torch.arange(4)[None, :]).abs().float()
    with pytest.raises(ValueError, match="bias"):
        mh.masks.from_additive(alibi)


def test_to_additive_round_trips_through_from_additive() -> None:
    mask = torch.rand(3, 5) > 0.5
    additive = mh.masks.to_additive(mask)
    assert set(additive.unique().tolist()) <= {0.0, float("-inf")}
    assert torch.equal(mh.masks.from_additive(additive), mask)
