"""Keys no query reads are not projected: a padded batch's k and v run on its real tokens only.

Notation: B batch, S tokens, Sk keys, E embed_dim, H query heads, Hkv key/value heads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import multihead as mh
import multihead.linear
import multihead.module
from conftest import ATOL64, np64, reference_layer

F64 = torch.float64


def _padded(b: int, sk: int, real: list[int]) -> torch.Tensor:
    """(B, Sk) key mask: row i has its first real[i] tokens."""
    return torch.arange(sk)[None, :] < torch.tensor(real)[:, None]


def test_read_keys_names_the_real_rows_of_a_key_padding_mask() -> None:
    keep = _padded(3, 8, [8, 5, 2])  # 9 of 24 keys hidden
    rows = mh.masks.read_keys(keep[:, None, None, :], 3, 8)
    assert rows is not None
    assert rows.tolist() == keep.reshape(-1).nonzero().squeeze(1).tolist()
    # one row of padding for the whole batch is broadcast over it
    rows = mh.masks.read_keys(keep[1:2, None, None, :], 3, 8)
    assert rows is not None and rows.tolist() == [j + 8 * b for b in range(3) for j in range(5)]


@pytest.mark.parametrize("mask, why", [
    (None, "no mask"),
    (_padded(2, 16, [16, 15])[:, None, None, :], "1 of 32 keys hidden: under an eighth"),
    (torch.ones(2, 1, 4, 8, dtype=torch.bool).tril(), "a mask per query"),
    (torch.ones(2, 3, 1, 8, dtype=torch.bool), "a mask per head"),
])
def test_read_keys_is_none_where_skipping_cannot_be_told_or_pays_little(mask: torch.Tensor | None, why: str) -> None:
    assert mh.masks.read_keys(mask, 2, mask.shape[-1] if mask is not None else 8) is None, why


@pytest.fixture
def projected_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every input the layers' projections run on (multihead.linear.linears, spied)."""
    seen: list[int] = []
    real = multihead.linear.linears

    def spy(x: torch.Tensor, layers: list) -> list[torch.Tensor]:
        seen.extend([x.reshape(-1, x.shape[-1]).shape[0]] * len(layers))
        return real(x, layers)

    monkeypatch.setattr(multihead.linear, "linears", spy)
    return seen


CASES = [  # (id, constructor kwargs, context width or None)
    ("bidirectional", dict(embed_dim=32, num_heads=4), None),
    ("causal-gqa-rope", dict(embed_dim=32, num_heads=4, num_kv_heads=2, causal=True, rope=lambda: mh.RoPE(8)), None),
    ("qk-norm-proj", dict(embed_dim=32, num_heads=4, qk_norm="proj"), None),
    ("cross-attention-kdim", dict(embed_dim=32, num_heads=4, kdim=12, vdim=12), 12),
]


@pytest.mark.parametrize("backend", ["auto", "sdpa", "explicit"])
@pytest.mark.parametrize("ctor, width", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_padded_batch_projects_real_keys_only_and_equals_the_reference(
        ctor: dict, width: int | None, backend: str, projected_rows: list[int]) -> None:
    torch.manual_seed(0)
    ctor = {k: (v() if callable(v) else v) for k, v in ctor.items()}
    layer = mh.MultiHeadAttention(**ctor, backend=backend, dtype=F64)
    for p in layer.parameters():  # biases matter: a zero key row would differ from a projected one
        torch.nn.init.normal_(p, std=0.5)
    b, s, sk = 3, 6, 6 if width is None else 9
    x = torch.randn(b, s, 32, dtype=F64)
    context = None if width is None else torch.randn(b, sk, width, dtype=F64)
    key_mask = _padded(b, sk, [sk, sk - 2, 1])  # the last row: one real key
    with torch.no_grad():
        got = layer(x, context, key_mask=key_mask)
    real = int(key_mask.sum())
    assert projected_rows == [b * s, real, real, b * s]  # q and o_proj on every row, k and v on the real keys
    full = layer(x, context, key_mask=key_mask)  # autograd on: every row projected
    assert projected_rows[4:] == [b * s, b * sk, b * sk, b * s]
    np.testing.assert_allclose(np64(got), np64(full), rtol=0, atol=ATOL64)
    if layer.qk_norm is None:  # the reference has no QK-norm
        want, _ = reference_layer(layer, x, context, key_mask=key_mask)  # every row, padded queries too
        np.testing.assert_allclose(np64(got), want, rtol=0, atol=ATOL64)


def test_mask_argument_of_key_padding_shape_skips_too_and_equals_full_projections(projected_rows: list[int]) -> None:
    torch.manual_seed(1)
    layer = mh.MultiHeadAttention(384, 12).eval()
    x = torch.randn(3, 24, 384)
    keep = _padded(3, 24, [24, 18, 10])  # the bench's bundled batch
    with torch.no_grad():
        got = layer(x, mask=keep[:, None, None, :])
    assert projected_rows == [72, 52, 52, 72]  # on the native kernels (auto, float32)
    full = layer(x, mask=keep[:, None, None, :])  # autograd on: every row projected
    assert projected_rows[4:] == [72] * 4
    torch.testing.assert_close(got, full.detach(), rtol=1e-5, atol=1e-5)


def test_watched_layer_and_autograd_project_every_row(projected_rows: list[int]) -> None:
    """A watcher sees K and V as projected at every row; gradients keep their summation."""
    layer = mh.MultiHeadAttention(16, 4, dtype=F64)
    x = torch.randn(2, 5, 16, dtype=F64)
    key_mask = _padded(2, 5, [5, 2])
    seen: dict[str, torch.Tensor] = {}
    with torch.no_grad(), layer.watched(lambda name, t: seen.setdefault(name, t)):
        layer(x, key_mask=key_mask)
    assert projected_rows == [10] * 4
    want_k = torch.nn.functional.linear(x, layer.k_proj.weight, layer.k_proj.bias)
    torch.testing.assert_close(seen["K"], want_k, rtol=0, atol=1e-12)  # padded rows too
    layer(x, key_mask=key_mask).sum().backward()
    assert projected_rows[4:] == [10] * 4


def test_hooked_projection_is_called_on_every_row() -> None:
    """A k_proj with a hook is the user's module: it sees the whole input, as without multihead."""
    layer = mh.MultiHeadAttention(16, 4)
    rows: list[int] = []
    layer.k_proj.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    with torch.no_grad():
        layer(torch.randn(2, 5, 16), key_mask=_padded(2, 5, [5, 2]))
    assert rows == [5]
