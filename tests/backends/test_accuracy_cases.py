"""flash-attention's accuracy criterion on the cases its ported suite found failing.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim.

The criterion (flash-attention's ``test_flash_attn.py``): the error against the float64
ground truth at most 2× that of a naive implementation in the same precision (3× for
gradients), with no floor. Here the naive one is ``"explicit"`` in float32 (scores by
one GEMM, times the scale, softmax in float32, the weighted sum by a GEMM; gradients by
autograd through it), the ground truth ``"explicit"`` in float64 on the same values.

Each case is flash-attention's parametrisation: GQA with H=6, Hkv=2, local attention as
``window_size = torch.randint(0, Sk, (2,))`` (left != right: a boolean mask here,
flash-attention's ``construct_local_mask``), inputs ``torch.randn``.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead import native
from multihead.backends.blocked import blocked_attention, decode_attention

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler: " + native.status())


def local_mask(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    """(Sq, Sk) bool, True = may attend: query i (at key position i + Sk - Sq) sees the keys
    from ``left`` before it to ``right`` after it (flash-attention's ``window_size``)."""
    pos = torch.arange(sq)[:, None] + sk - sq  # (Sq, 1)
    key = torch.arange(sk)[None, :]  # (1, Sk)
    return (key >= pos - left) & (key <= pos + right)


def max_error(got: torch.Tensor, truth: torch.Tensor) -> float:
    return (got.double() - truth).abs().max().item()


@pytest.mark.parametrize("seed", [0, 3, 6])
def test_native_forward_gqa_asymmetric_window(seed: int) -> None:
    """Sq = Sk = 1024, D = 96, GQA 6/2, window_size (left, right) drawn as flash-attention
    does: the native float32 forward within 2× the naive float32 error (seed 0 was 3.9×:
    the q·kᵀ tile summed D products in one running sum, and q was rounded once more by its
    pre-multiplied scale)."""
    gen = torch.Generator().manual_seed(seed)
    left, right = torch.randint(0, 1024, (2,), generator=gen).tolist()
    q = torch.randn(1, 6, 1024, 96, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 1024, 96, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = local_mask(1024, 1024, left, right)
    truth = mh.attention(q, k, v, mask=mask, backend="explicit")
    with torch.no_grad():
        ours = mh.attention(q.float(), k.float(), v.float(), mask=mask, backend="native")
        naive = mh.attention(q.float(), k.float(), v.float(), mask=mask, backend="explicit")
    err, naive_err = max_error(ours, truth), max_error(naive, truth)
    assert err <= 2 * naive_err, f"window {(left, right)}: error {err:.3e} > 2 × naive {naive_err:.3e}"


def gradients(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, upstream: torch.Tensor,
              causal: bool, window: int | None = None) -> list[torch.Tensor]:
    """dq, dk, dv of ``(attention(q, k, v) · upstream).sum()`` through ``backend``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = mh.attention(*leaves, causal=causal, window=window, backend=backend)
    return list(torch.autograd.grad(out, leaves, upstream))


def test_native_gradients_causal_gqa_d96() -> None:
    """Sq = 512, Sk = 256 (bottom-right causal), D = 96, GQA 6/2, B = 4: the native
    backward's dq, dk, dv within 3× the naive float32 ones (dq was 3.4×: its recomputed
    scores carried the q·kᵀ tile's long running sums)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(4, 6, 512, 96, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(4, 2, 256, 96, generator=gen, dtype=torch.float64) for _ in range(2))
    upstream = torch.randn(4, 6, 512, 96, generator=gen, dtype=torch.float64)
    truth = gradients("explicit", q, k, v, upstream, causal=True)
    low = (q.float(), k.float(), v.float(), upstream.float())
    ours = gradients("native", *low, causal=True)
    naive = gradients("explicit", *low, causal=True)
    for name, got, want, base in zip(("dq", "dk", "dv"), ours, truth, naive):
        err, naive_err = max_error(got, want), max_error(base, want)
        assert err <= 3 * naive_err, f"{name}: error {err:.3e} > 3 × naive {naive_err:.3e}"


@pytest.mark.parametrize("seed", [0, 2])
def test_auto_gradients_causal_window_d111(seed: int) -> None:
    """Sq = 512, Sk = 256, D = 111, GQA 6/2, B = 4, causal with flash-attention's random left
    window: "auto"'s dq, dk, dv within 3× the naive float32 ones (it took SDPA, whose dq was
    3.0× and 3.2×; now the rule "explicit (gradients, accuracy)")."""
    gen = torch.Generator().manual_seed(seed)
    left = int(torch.randint(0, 256, (1,), generator=gen))
    q = torch.randn(4, 6, 512, 111, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(4, 2, 256, 111, generator=gen, dtype=torch.float64) for _ in range(2))
    upstream = torch.randn(4, 6, 512, 111, generator=gen, dtype=torch.float64)
    truth = gradients("explicit", q, k, v, upstream, causal=True, window=left + 1)
    low = (q.float(), k.float(), v.float(), upstream.float())
    ours = gradients("auto", *low, causal=True, window=left + 1)
    naive = gradients("explicit", *low, causal=True, window=left + 1)
    for name, got, want, base in zip(("dq", "dk", "dv"), ours, truth, naive):
        err, naive_err = max_error(got, want), max_error(base, want)
        assert err <= 3 * naive_err, f"{name}: error {err:.3e} > 3 × naive {naive_err:.3e}"


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("backend", ["blocked", "decode"])
def test_torch_kernels_large_logits_two_keys(backend: str, d: int) -> None:
    """S = 2, D = 64/96/128, GQA 6/2, large logits (q × 5, k × 3: scores of spread ~15),
    12 draws, causal and not: the torch-only kernels within 2× the naive float32 error over the
    12 draws (flash-attention's criterion on their stacked outputs), and no draw beyond 4× its own.
    "blocked" was 2.7-11× on 1 draw in 4: it padded 2 keys to 128 (MKL's wide kernel sums the
    products less accurately than its narrow one, which the naive call gets) and rounded every
    query once more by its pre-multiplied scale (D = 96, 128). One draw alone is not held to 2×:
    its error is a few roundings of 2 scores, so the GEMM's summation order decides it (on an Intel
    Xeon with AVX-512, torch's own SDPA reaches 3.6× the naive error on one draw at D = 64, this
    kernel 2.5× on another, while over the 12 draws both stay within 1.0×)."""
    kernel = blocked_attention if backend == "blocked" else decode_attention
    errors, naive_errors = [], []
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 6, 2, d, generator=gen, dtype=torch.float64) * 5
        k = torch.randn(2, 2, 2, d, generator=gen, dtype=torch.float64) * 3
        v = torch.randn(2, 2, 2, d, generator=gen, dtype=torch.float64)
        causal = seed % 2 == 1
        truth = mh.attention(q, k, v, causal=causal, backend="explicit")
        low = q.float(), k.float(), v.float()
        ours = kernel(*low, scale=d ** -0.5, causal=causal)
        naive = mh.attention(*low, causal=causal, backend="explicit")
        errors.append(max_error(ours, truth))
        naive_errors.append(max_error(naive, truth))
        assert errors[-1] <= 4 * naive_errors[-1], f"seed {seed}: error {errors[-1]:.3e} > 4 × naive " \
                                                  f"{naive_errors[-1]:.3e}"
    assert max(errors) <= 2 * max(naive_errors), f"error {max(errors):.3e} > 2 × naive {max(naive_errors):.3e}"


def test_native_softcap_30_long_causal() -> None:
    """Soft-capping 30 (Gemma-2's), causal, S = 2048, D = 64, inputs × 3 (scores of spread
    ~9, where the cap bends them): the native forward within 2× the naive float32 error
    (measured 1.3×)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 2048, 64, generator=gen, dtype=torch.float64) * 3 for _ in range(3))
    truth = mh.attention(q, k, v, causal=True, softcap=30.0, backend="explicit")
    with torch.no_grad():
        low = q.float(), k.float(), v.float()
        ours = mh.attention(*low, causal=True, softcap=30.0, backend="native")
        naive = mh.attention(*low, causal=True, softcap=30.0, backend="explicit")
    err, naive_err = max_error(ours, truth), max_error(naive, truth)
    assert err <= 2 * naive_err, f"error {err:.3e} > 2 × naive {naive_err:.3e}"
