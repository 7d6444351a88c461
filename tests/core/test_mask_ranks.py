"""One mask rule for every backend and the module: any broadcastable bool mask, of any rank.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim.

A bool mask of rank 0 to 4 that broadcasts to (B, H, Sq, Sk) means the same thing
everywhere; anything else is refused with the same error by every backend, whatever the
problem size (which decides the path a backend takes: decoding loop, tiles, SDPA...).
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh

BACKENDS = ["explicit", "sdpa", "blocked", "native", "auto"]

# (id, B, H, Hkv, Sq, Sk, D, causal): sizes that take each backend's different paths
PROBLEMS = [
    ("prefill", 2, 4, 2, 6, 6, 8, False),
    ("decode_one_query", 2, 4, 2, 1, 40, 8, False),
    ("tiled_causal", 1, 2, 1, 70, 130, 16, True),
]


def ranks(full: torch.Tensor) -> dict[str, torch.Tensor]:
    """Masks of every rank cut from ``full`` (B, H, Sq, Sk), each broadcastable to it."""
    return {"0d": full[0, 0, 0, 0], "1d_Sk": full[0, 0, 0], "1d_one": full[0, 0, 0, :1], "2d": full[0, 0],
            "3d": full[0], "4d": full, "4d_singletons": full[:1, :1]}


def problem(b: int, h: int, hkv: int, sq: int, sk: int, d: int) -> tuple[torch.Tensor, ...]:
    torch.random.default_generator.manual_seed(0)
    return torch.randn(b, h, sq, d), torch.randn(b, hkv, sk, d), torch.randn(b, hkv, sk, d)


@torch.no_grad()
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("b, h, hkv, sq, sk, d, causal", [p[1:] for p in PROBLEMS], ids=[p[0] for p in PROBLEMS])
def test_every_mask_rank_gives_the_answer_of_its_full_mask(backend, b, h, hkv, sq, sk, d, causal) -> None:
    q, k, v = problem(b, h, hkv, sq, sk, d)
    full = torch.rand(b, h, sq, sk) > 0.3
    full[..., -1] = True  # every row keeps a key (fully masked rows are tested elsewhere)
    for name, mask in ranks(full).items():
        wide = mask.expand(b, h, sq, sk)  # (B, H, Sq, Sk): what the mask means
        expected = mh.attention(q.double(), k.double(), v.double(), mask=wide, causal=causal, backend="explicit")
        got = mh.attention(q, k, v, mask=mask, causal=causal, backend=backend)
        torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=0, msg=f"mask {name}")


BAD_MASKS = [
    ("5d", lambda full: full[None], ValueError, "mask must be broadcastable"),
    ("1d_wrong_length", lambda full: full[0, 0, 0, :-1], ValueError, "mask must be broadcastable"),
    ("2d_transposed", lambda full: full[0, 0].T if full.shape[-2] != full.shape[-1] else full[0, 0, :, :-1],
     ValueError, "mask must be broadcastable"),
    ("1d_float", lambda full: full[0, 0, 0].float(), TypeError, "mask must be a bool"),
    ("0d_int", lambda full: torch.tensor(1), TypeError, "mask must be a bool"),
]


@torch.no_grad()
@pytest.mark.parametrize("b, h, hkv, sq, sk, d, causal", [p[1:] for p in PROBLEMS], ids=[p[0] for p in PROBLEMS])
@pytest.mark.parametrize("cut, exc, match", [m[1:] for m in BAD_MASKS], ids=[m[0] for m in BAD_MASKS])
def test_a_bad_mask_is_refused_the_same_way_by_every_backend(b, h, hkv, sq, sk, d, causal, cut, exc, match) -> None:
    q, k, v = problem(b, h, hkv, sq, sk, d)
    mask = cut(torch.ones(b, h, sq, sk, dtype=torch.bool))
    messages = set()
    for backend in BACKENDS:
        with pytest.raises(exc, match=match) as err:
            mh.attention(q, k, v, mask=mask, causal=causal, backend=backend)
        messages.add(str(err.value))
    assert len(messages) == 1, messages


@torch.no_grad()
@pytest.mark.parametrize("backend", [None, *BACKENDS])
def test_the_module_takes_every_mask_rank(backend) -> None:
    torch.random.default_generator.manual_seed(0)
    lay = mh.MultiHeadAttention(16, 4, num_kv_heads=2, backend=backend).eval()
    x = torch.randn(2, 6, 16)
    full = torch.rand(2, 4, 6, 6) > 0.3
    full[..., -1] = True
    for name, mask in ranks(full).items():
        expected = lay(x, mask=mask.expand(2, 4, 6, 6).contiguous())
        torch.testing.assert_close(lay(x, mask=mask), expected, atol=1e-6, rtol=0, msg=f"mask {name}")
    for _, cut, exc, match in BAD_MASKS:
        with pytest.raises(exc, match=match):
            lay(x, mask=cut(full))
