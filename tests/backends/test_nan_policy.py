"""NaN in, NaN out, on every backend and every path "auto" takes, as the float64 reference.

A NaN in a query row makes that row's output NaN; a NaN in a key makes NaN every row that
may see that key, and no other; a query that may attend to nothing still outputs zeros.
torch's unmasked CPU SDPA kernel returned zeros for a NaN query row, so "sdpa", and "auto"
on small problems, hid it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import multihead as mh

BACKENDS = ["explicit", "sdpa", "blocked", "native", "auto"]
#: (B, H, Hkv, Sq, Sk, D): small (auto: sdpa), decoding rows (native decode / decode), large (native).
SHAPES = [(1, 2, 2, 6, 6, 16), (1, 8, 2, 1, 300, 64), (1, 4, 4, 1, 2048, 64), (1, 2, 2, 256, 256, 64)]


def _reference_nan_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> np.ndarray:
    """(B, H, Sq): which output rows the float64 reference makes NaN (GQA: head j reads K/V j // G)."""
    b, h, sq, d = q.shape
    group = h // k.shape[1]
    mask = _causal(sq, k.shape[2]) if causal else None
    rows = np.zeros((b, h, sq), dtype=bool)
    for i in range(b):
        for j in range(h):
            head, _ = mh.reference.attention_head(q[i, j].T.numpy(), k[i, j // group].T.numpy(),
                                                  v[i, j // group].T.numpy(), scale=d ** -0.5, mask=mask)
            rows[i, j] = np.isnan(head).any(axis=0)  # head: [D, Sq]
    return rows


def _causal(sq: int, sk: int) -> np.ndarray:
    return np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq  # bottom-right


def _inputs(shape: tuple[int, ...], where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, hkv, sq, sk, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, s, d, generator=g) for n, s in ((h, sq), (hkv, sk), (hkv, sk)))
    if where == "q":
        q[0, h - 1, sq - 1, d // 2] = float("nan")  # the last query row of the last head
    else:
        k[0, 0, sk // 2, 1] = float("nan")  # a key in the middle: later rows see it, earlier do not
    return q, k, v


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_reaches_exactly_the_rows_the_reference_says(shape: tuple[int, ...], where: str, causal: bool) -> None:
    q, k, v = _inputs(shape, where)
    expected = _reference_nan_rows(q, k, v, causal)
    assert expected.any()
    for backend in BACKENDS:
        if backend == "blocked" and (shape[3] < 2 or shape[5] < 16):
            continue  # the blocked kernel's shapes are checked by its own tests; here it would be refused
        try:
            out = mh.attention(q, k, v, causal=causal, backend=backend)
        except ValueError as refused:  # a named backend that cannot take this call says so
            assert backend != "auto", refused
            continue
        got = out.isnan().any(dim=-1).numpy()
        assert (got == expected).all(), f"{backend}: NaN rows {np.argwhere(got)} expected {np.argwhere(expected)}"


def test_auto_small_call_keeps_a_nan_query_row() -> None:
    q, k, v = _inputs(SHAPES[0], "q")
    assert mh.backends.auto.auto_path(q, k, v) == "sdpa"
    out = mh.attention(q, k, v)
    assert out[0, -1, -1].isnan().all() and not out[0, :, :-1].isnan().any()


def test_a_query_with_nothing_to_see_still_outputs_zeros() -> None:
    q, k, v = _inputs(SHAPES[0], "q")
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[-1] = False  # the NaN query row may attend to nothing
    for backend in BACKENDS:
        out = mh.attention(q, k, v, mask=mask, backend=backend)
        assert (out[0, -1, -1] == 0).all() and not out.isnan().any(), backend


def test_the_layer_keeps_nan_rows() -> None:
    layer = mh.MultiHeadAttention(32, 4)
    x = torch.randn(1, 5, 32)
    x[0, 2, 0] = float("nan")
    with torch.no_grad():
        y = layer(x)
    # token 2's key and value are NaN: every query sees it, so every row is NaN (as in the reference)
    assert y.isnan().all(dim=-1).all()
