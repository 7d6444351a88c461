"""The native FlashAttention loop with an additive bias (``bias=``, and T5's relative position bias
lowered by :func:`multihead.score_mods.lower` to one value per head and distance): against the
float64 reference by flash-attention's criterion, every broadcast, with the other features and a
block mask, forward and backward (the bias' and the T5 table's gradients too); gradients with
another logit feature refused by name; at the operator's entry, a bias of the wrong shape refused.

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


def _t5(heads: int, bidirectional: bool, seed: int = 4) -> score_mods.RelativeBias:
    table = torch.randn(heads, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return score_mods.relative_bias(table, score_mods.t5_buckets(32, 128, bidirectional=bidirectional))


def test_t5_is_lowered_to_one_value_per_head_and_distance() -> None:
    """T5's buckets depend on the distance alone: the lowered feature is (1, H, Sq + Sk - 1), no dense
    bias; other buckets give the dense (1, H, Sq, Sk) bias."""
    from multihead.logits import Features, relative_dense

    t5 = _t5(4, bidirectional=True)
    lowered = score_mods.lower(Features(score_mod=t5), 30, 50, 4)
    assert lowered.bias is None and lowered.score_mod is None and lowered.relative is not None
    assert lowered.relative.shape == (1, 4, 79)
    q_idx, kv_idx = torch.arange(20, 50)[:, None], torch.arange(50)[None, :]  # bottom-right aligned
    assert torch.equal(relative_dense(lowered.relative, 30, 50)[0], t5.table[:, t5.buckets(q_idx, kv_idx)])
    other = score_mods.relative_bias(t5.table, lambda qi, ki: (ki % 32) + 0 * qi)
    dense = score_mods.lower(Features(score_mod=other), 30, 50, 4)
    assert dense.relative is None and dense.bias is not None and dense.bias.shape == (1, 4, 30, 50)


def test_bias_with_a_block_mask_and_a_t5_score_mod_runs_natively() -> None:
    """A lowered T5 relative bias takes the native loop, with a block mask too, equal to the score_mod
    written out in float64; with gradients too (the auto rules say so)."""
    q, k, v = _qkv(1, 4, 4, 512, 512, seed=3)
    t5 = _t5(4, bidirectional=False)
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
    assert auto_path(leaf, low[1], low[2], score_mod=t5) == "native (bias, gradients)"
    assert auto_path(leaf, low[1], low[2], bias=torch.zeros(512, 512)) == "native (bias, gradients)"
    assert auto_path(leaf, low[1], low[2], bias=torch.zeros(512, 512), softcap=5.0) != "native (bias, gradients)"


def _grads(run: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, learned: torch.Tensor,
           dout: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, learned)]
    out = run(*leaves)  # type: ignore[operator]
    out.backward(dout.to(dtype))
    return [t.grad for t in leaves]  # type: ignore[misc]


# (B, H, Hkv, Sq, Sk, structure): the fused backward (B·Hkv >= 4) and the two passes, GQA, Sq != Sk
_GRAD_CASES = [(2, 4, 2, 200, 200, {"causal": True}), (1, 4, 2, 96, 200, {}), (1, 2, 1, 150, 150, {"window": 40}),
               (3, 2, 2, 70, 70, {"causal": True, "block": True})]


@pytest.mark.parametrize("case", _GRAD_CASES, ids=lambda c: f"{c[0]}x{c[1]}/{c[2]}x{c[3]}x{c[4]}-{sorted(c[5])}")
@pytest.mark.parametrize("kind", ["dense", "broadcast", "t5"])
def test_bias_gradients_within_three_times_the_naive_error(case: tuple, kind: str) -> None:  # type: ignore[type-arg]
    """Gradients of q, k, v and of the bias (dense (B, H, Sq, Sk), broadcast (H, 1, Sk), or T5's
    learned table through the relative bias) on the native backward, within 3× the naive float32
    error against float64 (flash-attention's criterion for gradients)."""
    b, h, hkv, sq, sk, kw = case
    q, k, v = _qkv(b, h, hkv, sq, sk, seed=sq)
    dout = torch.randn(b, h, sq, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    kw = dict(kw)
    if kw.pop("block", False):
        kw["block_mask"] = mh.BlockMask.from_mask_mod(lambda b_, h_, qi, ki: (qi // 10) % 3 != (ki // 10) % 3,
                                                      None, None, sq, sk, block_size=32)
    g = torch.Generator().manual_seed(6)
    learned = {"dense": torch.randn(b, h, sq, sk, generator=g, dtype=torch.float64),
               "broadcast": torch.randn(h, 1, sk, generator=g, dtype=torch.float64),
               "t5": torch.randn(h, 32, generator=g, dtype=torch.float64)}[kind]
    buckets = score_mods.t5_buckets(32, 64, bidirectional=True)

    def run(backend: str) -> object:
        def call(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            if kind == "t5":
                return mh.attention(q_, k_, v_, score_mod=score_mods.relative_bias(x, buckets), backend=backend, **kw)
            return mh.attention(q_, k_, v_, bias=x, backend=backend, **kw)
        return call

    truth = _grads(run("explicit"), q, k, v, learned, dout, torch.float64)
    ours = _grads(run("native"), q, k, v, learned, dout, torch.float32)
    naive = _grads(run("explicit"), q, k, v, learned, dout, torch.float32)
    for name, o, n, t in zip(("dq", "dk", "dv", "dbias"), ours, naive, truth):
        assert o.shape == t.shape, name
        assert _err(o, t) <= 3 * _err(n, t), name


def test_bias_gradients_with_another_logit_feature_are_refused_by_name() -> None:
    """The native backward adds the bias but applies no soft-capping or ALiBi: gradients with them
    are refused by name (auto takes another path)."""
    q, k, v = (t.float() for t in _qkv(1, 2, 2, 64, 64))
    with pytest.raises(ValueError, match="gradients with logit soft-capping"):
        mh.attention(q.requires_grad_(), k, v, bias=torch.zeros(64, 64), softcap=5.0, backend="native")


def test_operator_refuses_a_bias_that_does_not_fit() -> None:
    """The operator's own entry checks the biases before the kernel reads them (it may be called directly)."""
    q, k, v = (t.float() for t in _qkv(1, 2, 2, 64, 80))
    plain = (None, 0.125, False, None, False, None, None, None, None, None, None, 0, 0)
    for bad, err in ((torch.zeros(64, 79), ValueError), (torch.zeros(2, 2, 64, 80), ValueError),
                     (torch.zeros(64, 80, dtype=torch.int32), TypeError)):
        with pytest.raises(err, match="bias"):
            torch.ops.multihead.attention(q, k, v, *plain, bad)
    for bad, err in ((torch.zeros(1, 2, 142), ValueError), (torch.zeros(1, 3, 143), ValueError),
                     (torch.zeros(2, 143), ValueError), (torch.zeros(1, 2, 143, dtype=torch.int64), TypeError)):
        with pytest.raises(err, match="rel_bias"):
            torch.ops.multihead.attention(q, k, v, *plain, None, bad)
    for args in ((torch.randn(64, 80),), (None, torch.randn(1, 2, 143)), (torch.randn(64, 80), torch.randn(1, 2, 143))):
        torch.library.opcheck(torch.ops.multihead.attention.default, (q, k, v, *plain, *args),
                              test_utils=("test_schema", "test_faketensor"))


def test_operator_bias_gradients_pass_opcheck() -> None:
    """The operator's autograd with a bias and a relative bias that need gradients (opcheck's
    autograd registration), and the backward operator's schema and fake with ``bias_grad``."""
    q, k, v = (t.float().requires_grad_() for t in _qkv(1, 2, 2, 48, 48))
    plain = (None, 0.125, True, None, False, None, None, None, None, None, None, 0, 0)
    bias, rel = torch.randn(2, 1, 48, requires_grad=True), torch.randn(1, 2, 95, requires_grad=True)
    torch.library.opcheck(torch.ops.multihead.attention.default, (q, k, v, *plain, bias, rel),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    out, lse = torch.ops.multihead.attention(q, k, v, *plain, bias, rel)
    dout = torch.randn_like(out)
    delta = (dout * out).sum(-1).detach()
    torch.library.opcheck(torch.ops.multihead.attention_backward.default,
                          (dout, q.detach(), k.detach(), v.detach(), lse.detach(), delta, None, 0.125, True, None,
                           None, None, 0, 0, bias.detach(), rel.detach(), True),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("batch", [1, 4], ids=["two-passes", "fused"])
def test_bias_gradients_do_not_depend_on_the_thread_count(batch: int) -> None:
    """The bias' and the relative bias' gradients are the same bits with 1 and 2 threads, in both
    forms of the backward (the two passes sum the relative bias' diagonals per key block, in order)."""
    q, k, v = (t.float() for t in _qkv(batch, 2, 1, 130, 130, seed=8))
    bias = torch.randn(2, 130, 130, generator=torch.Generator().manual_seed(1))
    t5 = score_mods.relative_bias(torch.randn(2, 32, generator=torch.Generator().manual_seed(2)),
                                  score_mods.t5_buckets(32, 64, bidirectional=True))

    def grads() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias, t5.table)]
        mod = score_mods.relative_bias(leaves[4], t5.buckets)
        mh.attention(*leaves[:3], bias=leaves[3], score_mod=mod, causal=True, backend="native").sum().backward()
        return [t.grad for t in leaves]  # type: ignore[misc]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = grads()
        torch.set_num_threads(2)
        two = grads()
    finally:
        torch.set_num_threads(threads)
    for name, a, b in zip(("dq", "dk", "dv", "dbias", "dtable"), one, two):
        assert torch.equal(a, b), name
        assert a.abs().sum() > 0, name
