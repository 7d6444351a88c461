"""The native FlashAttention loop with an additive bias (``bias=``, T5's relative position bias
lowered by :func:`multihead.score_mods.lower`): against the float64 reference by flash-attention's
criterion, every broadcast, with the other features and a block mask; refused with gradients
(its backward does not apply it) and, at the operator's entry, for a bias of the wrong shape.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import native, score_mods
from multihead.backends.auto import auto_path

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler: " + native.status())


def _qkv(b: int, h: int, hkv: int, sq: int, sk: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, sq, 64, generator=g, dtype=torch.float64),
            torch.randn(b, hkv, sk, 64, generator=g, dtype=torch.float64),
            torch.randn(b, hkv, sk, 64, generator=g, dtype=torch.float64))


def _err(got: torch.Tensor, truth: torch.Tensor) -> float:
    return (got.double() - truth).abs().max().item()


@pytest.mark.parametrize("shape", [(1, 4, 300, 300), (2, 1, 300, 300), (2, 4, 300, 1), (300, 300)])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"softcap": 5.0, "alibi_slopes": True}])
def test_bias_within_twice_the_naive_error(shape: tuple[int, ...], kw: dict) -> None:  # type: ignore[type-arg]
    q, k, v = _qkv(2, 4, 2, 300, 300)
    g = torch.Generator().manual_seed(9)
    bias = torch.randn(*shape, generator=g, dtype=torch.float64) * 2
    if kw.get("alibi_slopes"):
        kw = {**kw, "alibi_slopes": mh.logits.alibi_slopes(4)}
    truth = mh.attention(q, k, v, bias=bias, backend="explicit", **kw)
    with torch.no_grad():
        low = tuple(t.float() for t in (q, k, v))
        ours = mh.attention(*low, bias=bias.float(), backend="native", **kw)
        naive = mh.attention(*low, bias=bias.float(), backend="explicit", **kw)
        half = mh.attention(*(t.bfloat16() for t in low), bias=bias.float(), backend="native", **kw)
    assert _err(ours, truth) <= 2 * _err(naive, truth)
    assert _err(half, truth) < 3e-2


def test_bias_with_a_block_mask_and_a_t5_score_mod_runs_natively() -> None:
    """A lowered T5 relative bias takes the native loop without gradients (the auto rule says so),
    with a block mask too, equal to the score_mod written out in float64."""
    q, k, v = _qkv(1, 4, 4, 512, 512, seed=3)
    table = torch.randn(4, 32, generator=torch.Generator().manual_seed(4))
    t5 = score_mods.relative_bias(table, score_mods.t5_buckets(32, 128, bidirectional=False))
    low = tuple(t.float() for t in (q, k, v))
    assert auto_path(*low, score_mod=t5) == "native (features)"
    docs = torch.arange(512) // 200

    def document(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
        return (docs[qi] == docs[ki]) & (qi >= ki)

    block = mh.BlockMask.from_mask_mod(document, None, None, 512, 512)
    truth = mh.attention(q, k, v, mask=block.dense(), score_mod=t5, backend="explicit")
    with torch.no_grad():
        ours = mh.attention(*low, block_mask=block, score_mod=t5)
        naive = mh.attention(*low, mask=block.dense(), score_mod=t5, backend="explicit")
    assert _err(ours, truth) <= 2 * _err(naive, truth)
    leaf = low[0].clone().requires_grad_()
    assert auto_path(leaf, low[1], low[2], score_mod=t5) == "sdpa (additive bias)"  # gradients: SDPA


def test_bias_with_gradients_is_refused_by_name() -> None:
    q, k, v = (t.float() for t in _qkv(1, 2, 2, 64, 64))
    with pytest.raises(ValueError, match="gradients with an additive bias"):
        mh.attention(q.requires_grad_(), k, v, bias=torch.zeros(64, 64), backend="native")


def test_operator_refuses_a_bias_that_does_not_fit() -> None:
    """The operator's own entry checks the bias before the kernel reads it (it may be called directly)."""
    q, k, v = (t.float() for t in _qkv(1, 2, 2, 64, 80))
    for bad, err in ((torch.zeros(64, 79), ValueError), (torch.zeros(2, 2, 64, 80), ValueError),
                     (torch.zeros(64, 80, dtype=torch.int32), TypeError)):
        with pytest.raises(err, match="bias"):
            torch.ops.multihead.attention(q, k, v, None, 0.125, False, None, False, None, None, None, None,
                                          None, None, 0, 0, bad)
    torch.library.opcheck(torch.ops.multihead.attention.default,
                          (q, k, v, None, 0.125, False, None, False, None, None, None, None, None, None, 0, 0,
                           torch.randn(64, 80)), test_utils=("test_schema", "test_faketensor"))
