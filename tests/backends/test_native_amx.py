"""The bfloat16 FlashAttention loop on AMX tiles (csrc/attention_amx.cpp), against float64.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim, Dv value
head dim.

Where the CPU has AMX (``amx_bf16``) the bfloat16 kernel runs there; ``native.amx_enabled(False)``
runs the AVX-512 loop instead, as on a CPU without it, so both run here. The loop rounds the
probabilities p to bfloat16 before p · v (as FlashAttention and torch's SDPA do): its error
against float64 is held to the issue's criterion (at most 2× that of a naive bfloat16
implementation, max and RMS) and, tighter, to 1.5× the RMS error of the float32 computation
rounded once (the AVX-512 loop's, itself within 1.1× of it: test_native_bf16.py). The grid covers
the tile edges (16 rows, 16 and 32 keys, 32 dims, 16 value columns), the blocks of 256 keys, the
lazy softmax reference (its rescaling when a row's maximum grows by more than 2^8), GQA, every
mask and logit feature.
"""

from __future__ import annotations

import os

import pytest
import torch

import multihead as mh
from multihead.backends import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler: " + native.status())

BF16, F64 = torch.bfloat16, torch.float64


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ · scale) v in bfloat16 as written, each op rounding its output."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    probs = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return probs @ v


def _allowed(sq: int, sk: int, causal: bool, window: int | None, mask: torch.Tensor | None) -> torch.Tensor:
    i, j = torch.arange(sq)[:, None] + (sk - sq), torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= (j > i - window) & (j < i + window if not causal else True)
    return ok if mask is None else ok & mask


def _errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = out.double() - ref
    return diff.abs().max().item(), diff.square().mean().sqrt().item()


def test_the_amx_loop_runs_where_the_cpu_has_amx() -> None:
    """On a CPU with AMX and a build for it (-march=native), the bfloat16 loop runs on the tiles:
    the tests below then test it, not the fallback; the switch turns it off and back on."""
    expected = native.amx_bf16() and native.vector_bits() == 512 and not os.environ.get("MULTIHEAD_NATIVE_ARCH")
    assert native.amx() == expected, (native.amx(), expected, native.status())
    with native.amx_enabled(False):
        assert not native.amx()
        with native.amx_enabled(True):
            assert native.amx() == expected
        assert not native.amx()
    assert native.amx() == expected
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with native.amx_enabled(1):  # type: ignore[arg-type]
            pass


# (B, H, Hkv, Sq, Sk, D, Dv, causal, window, mask kind)
CASES = {
    "one-tile": (1, 2, 2, 16, 32, 32, 16, False, None, None),
    "blocks-gqa": (1, 8, 2, 300, 700, 64, 64, False, None, None),  # 3 blocks of keys, the last partial
    "causal-blocks": (2, 4, 2, 530, 530, 64, 64, True, None, None),
    "causal-sq-lt-sk": (1, 4, 1, 77, 600, 128, 128, True, None, None),  # D = 128: o's columns 64+ in memory
    "window": (1, 4, 4, 400, 400, 32, 32, True, 50, None),
    "window-bidirectional": (1, 3, 1, 260, 300, 48, 40, False, 33, None),  # D, Dv padded to 64, 48
    "key-padding": (2, 4, 2, 90, 257, 80, 96, False, None, "keys"),  # Sk past a block by one key
    "dense-mask": (1, 2, 1, 64, 96, 64, 64, False, None, "dense"),
    "odd-dims": (1, 3, 3, 37, 41, 13, 20, True, None, None),
    "wide-head": (1, 2, 1, 40, 300, 256, 256, False, None, None),
}


def _problem(name: str) -> tuple:
    b, h, hkv, sq, sk, d, dv, causal, window, kind = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    q, k = torch.randn(b, h, sq, d, generator=gen), torch.randn(b, hkv, sk, d, generator=gen)
    v = torch.randn(b, hkv, sk, dv, generator=gen)
    mask = None
    if kind == "keys":
        mask = torch.ones(b, 1, 1, sk, dtype=torch.bool)
        mask[1, ..., sk - 100:] = False
    elif kind == "dense":
        mask = torch.rand(b, h, sq, sk, generator=gen) < 0.6
        mask[0, 1, 5] = False  # a row with no key at all
    return (q.to(BF16), k.to(BF16), v.to(BF16)), causal, window, mask


@pytest.mark.parametrize("name", list(CASES))
def test_amx_within_the_criterion_of_float64(name: str) -> None:
    (q, k, v), causal, window, mask = _problem(name)
    scale = q.shape[-1] ** -0.5
    kw = dict(scale=scale, causal=causal, window=window, mask=mask)
    out, lse = native.run(q, k, v, return_lse=True, **kw)  # type: ignore[arg-type]
    with native.amx_enabled(False):
        fallback = native.run(q, k, v, **kw)[0]  # type: ignore[arg-type]
    ref, ref_lse = mh.attention(q.double(), k.double(), v.double(), backend="explicit", return_lse=True, **kw)
    naive = _naive(q, k, v, scale, _allowed(q.shape[2], k.shape[2], causal, window, mask))
    ours, theirs, one_rounding = _errors(out, ref), _errors(naive, ref), _errors(fallback, ref)
    assert out.dtype == BF16 and not out.isnan().any()
    assert ours[0] <= 2 * theirs[0] and ours[1] <= 2 * theirs[1], (ours, theirs)
    assert ours[1] <= 1.5 * one_rounding[1] + 1e-7, (ours, one_rounding)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)  # type: ignore[union-attr]
    if mask is not None and not mask.all(-1).all():
        empty = ~_allowed(q.shape[2], k.shape[2], causal, window, mask).any(-1)
        assert (out[empty.expand(out.shape[:-1])] == 0).all()


@pytest.mark.parametrize("direction", ["rising", "falling", "jumps"])
def test_the_lazy_reference_rescales_when_a_row_maximum_grows(direction: str) -> None:
    """Scores that grow along the keys by far more than 2^8 per block (rising), shrink (falling:
    the reference never moves) or jump in the last block: o and l are rescaled exactly when
    they must be, and the result stays within the criterion."""
    gen = torch.Generator().manual_seed(3)
    sk, d = 900, 64
    q = torch.randn(1, 2, 40, d, generator=gen)
    k, v = torch.randn(1, 2, sk, d, generator=gen), torch.randn(1, 2, sk, d, generator=gen)
    ramp = torch.linspace(0, 6, sk) if direction != "falling" else torch.linspace(6, 0, sk)
    if direction == "jumps":
        ramp = torch.where(torch.arange(sk) > 800, 8.0, 0.5)
    k = k + ramp[None, None, :, None] * q.mean(2, keepdim=True).sign()  # q·k grows with the ramp
    q, k, v = q.to(BF16), k.to(BF16), v.to(BF16)
    out = native.run(q, k, v, scale=0.125, causal=False, window=None, mask=None)[0]
    with native.amx_enabled(False):
        fallback = native.run(q, k, v, scale=0.125, causal=False, window=None, mask=None)[0]
    ref = mh.attention(q.double(), k.double(), v.double(), scale=0.125, backend="explicit")
    naive = _naive(q, k, v, 0.125, torch.ones(40, sk, dtype=torch.bool))
    ours, theirs, one_rounding = _errors(out, ref), _errors(naive, ref), _errors(fallback, ref)
    assert ours[0] <= 2 * theirs[0] and ours[1] <= 2 * theirs[1], (ours, theirs)
    assert ours[1] <= 1.5 * one_rounding[1] + 1e-7, (ours, one_rounding)


@pytest.mark.parametrize("names", [("softcap",), ("alibi",), ("sinks",), ("packed",),
                                   ("softcap", "alibi", "sinks", "packed")])
def test_amx_with_logit_features(names: tuple[str, ...]) -> None:
    gen = torch.Generator().manual_seed(5)
    lengths = [37, 0, 300, 5, 90]
    s = sum(lengths)
    q, k, v = (torch.randn(2, 6, s, 64, generator=gen) for _ in range(3))
    q, k, v = (t.to(BF16) for t in (q, k, v))
    kw: dict = {"causal": True}
    if "softcap" in names:
        kw["softcap"] = 4.0
    if "alibi" in names:
        kw["alibi_slopes"] = mh.logits.alibi_slopes(6)
    if "sinks" in names:
        kw["sinks"] = torch.randn(6, generator=gen)
    if "packed" in names:
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    wide = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}
    ref = mh.attention(q.double(), k.double(), v.double(), backend="explicit", **wide)
    with torch.no_grad():
        out = mh.attention(q, k, v, backend="native", **kw)
        with native.amx_enabled(False):
            fallback = mh.attention(q, k, v, backend="native", **kw)
        naive = mh.attention(q, k, v, backend="explicit", **kw)  # float32 inside, one rounding
    ours, one_rounding = _errors(out, ref), _errors(fallback, ref)
    assert ours[0] <= 2 * max(_errors(naive, ref)[0], one_rounding[0]), (ours, one_rounding)
    assert ours[1] <= 1.5 * one_rounding[1] + 1e-7, (ours, one_rounding)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_stays_in_its_packed_sequence(bad: float) -> None:
    """Packed sequences are independent: a NaN or inf in one sequence's V reaches its own rows only.
    The AMX loop's row groups of 16 straddle sequences and its tiles read 32 keys at a time, which
    would weigh another sequence's values by p = 0 (0 · NaN is NaN): such a call runs the loop that
    reads each sequence's keys alone, and the other sequences' rows equal those of the same call
    with that value finite (to bfloat16's rounding: the finite call may run on the tiles)."""
    gen = torch.Generator().manual_seed(11)
    lengths = [5, 27, 20, 44]  # bounds off the 16-row groups and the 32-key tiles
    s = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v = (torch.randn(1, 4, s, 64, generator=gen).to(BF16) for _ in range(3))
    poisoned = v.clone()
    poisoned[0, :, 5 + 3] = bad  # the second sequence's fourth key
    with torch.no_grad():
        clean = mh.attention(q, k, v, cu_seqlens=cu, backend="native")
        out = mh.attention(q, k, poisoned, cu_seqlens=cu, backend="native")
    own = torch.zeros(s, dtype=torch.bool)
    own[5:32] = True
    assert out[:, :, ~own].isfinite().all()
    assert (out[:, :, ~own].float() - clean[:, :, ~own].float()).abs().max() <= 0.05
    assert not out[:, :, own].isfinite().all()  # its own rows see it, as SDPA's would


def test_amx_results_do_not_depend_on_the_thread_count() -> None:
    """3 heads: one thread takes them whole, packing each (b, K/V head) itself; two share the
    packing, then the work items (3 pairs do not split evenly over 2 threads): the same bits."""
    q, k, v = (torch.randn(1, 3, 600, 64).to(BF16) for _ in range(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.run(q, k, v, scale=0.125, causal=True, window=None, mask=None)[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, native.run(q, k, v, scale=0.125, causal=True, window=None, mask=None)[0])
