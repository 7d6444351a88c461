"""Property-based equivalence: every path agrees with the float64 reference.

Random configurations (hypothesis, fixed seed): batch, Sq and Sk (1, primes, sizes off
any block size), heads and K/V heads, head_dim (odd without RoPE), bias, causal /
bidirectional / sliding window, random boolean masks with fully masked rows, key
padding, both RoPE pairings, cross-attention, float32 and float64, bfloat16/float16.

Accuracy criterion (flash-attention's tests): versus the float64 ground truth, our
error is at most 2× the error of a naive implementation in the same precision, plus a
floor of a few ulps of the output's scale (a tiny tensor's naive error can be 0 by luck).

Examples per test come from ``MULTIHEAD_PROPERTY_EXAMPLES`` (a multiplier; CI runs the
fixed-seed default, ``MULTIHEAD_PROPERTY_EXAMPLES=25`` is the thorough profile of
about 18,000 examples; the explicit ``@example`` cases run at every profile).
"""

from __future__ import annotations

import math

import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import reference_layer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead.backends.registry import get_spec, missing_capability

SCALE = float(os.environ.get("MULTIHEAD_PROPERTY_EXAMPLES", "1"))


def profile(examples: int) -> settings:
    """Fixed seed (derandomize), no deadline: CPU timing varies on a shared machine."""
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


SIZES = [1, 2, 3, 5, 7, 13, 16, 17, 31, 33, 64, 65]
EPS = {torch.float64: 2.0**-52, torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@dataclass
class Case:
    batch: int
    sq: int
    sk: int
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool
    causal: bool
    window: int | None
    rope: str | None
    cross: bool
    mask_kind: str
    dtype: torch.dtype
    seed: int

    def build(self) -> mh.MultiHeadAttention:
        torch.random.default_generator.manual_seed(self.seed)
        rope = None if self.rope is None else mh.RoPE(self.head_dim, 10000.0, interleaved=self.rope == "interleaved")
        layer = mh.MultiHeadAttention(self.embed_dim, self.num_heads, num_kv_heads=self.num_kv_heads,
                                      head_dim=self.head_dim, bias=self.bias, causal=self.causal,
                                      window=self.window, rope=rope, dtype=torch.float64)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0, 0.5)
        return layer.eval()

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        gen = torch.Generator().manual_seed(self.seed + 1)
        x = torch.randn(self.batch, self.sq, self.embed_dim, generator=gen, dtype=torch.float64)
        context = (torch.randn(self.batch, self.sk, self.embed_dim, generator=gen, dtype=torch.float64)
                   if self.cross else None)
        sk = self.sk if self.cross else self.sq
        mask = key_mask = None
        if self.mask_kind == "random":
            mask = torch.rand(self.batch, 1, self.sq, sk, generator=gen) < 0.6  # (B, 1, S, Sk)
            mask[:, :, torch.rand(self.sq, generator=gen) < 0.2] = False  # some fully masked rows
        elif self.mask_kind == "per_head":
            mask = torch.rand(1, self.num_heads, self.sq, sk, generator=gen) < 0.5
        elif self.mask_kind == "padding":
            lengths = torch.randint(0, sk + 1, (self.batch,), generator=gen)
            key_mask = torch.arange(sk)[None, :] < lengths[:, None]  # (B, Sk), some rows all padding
        return x, context, mask, key_mask


@st.composite
def cases(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)) -> Case:
    hkv = draw(st.sampled_from([1, 2, 3]))
    h = hkv * draw(st.sampled_from([1, 2, 4]))
    rope = draw(st.sampled_from([None, "half", "interleaved"]))
    cross = rope is None and draw(st.booleans())
    causal = not cross and draw(st.booleans())
    d = draw(st.sampled_from([2, 4, 6, 8, 16])) if rope else draw(st.integers(1, 17))
    return Case(
        batch=draw(st.integers(1, 3)),
        sq=draw(st.sampled_from(SIZES)),
        sk=draw(st.sampled_from(SIZES)),
        embed_dim=draw(st.integers(1, 24)),
        num_heads=h,
        num_kv_heads=hkv,
        head_dim=d,
        bias=draw(st.booleans()),
        causal=causal,
        window=draw(st.one_of(st.none(), st.integers(1, 9))),
        rope=rope,
        cross=cross,
        mask_kind=draw(st.sampled_from(["none", "random", "per_head", "padding"])),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**16)),
    )


def case(**fields: object) -> Case:
    """A :class:`Case` for an explicit ``@example``: E=12, H=4, Hkv=2, D=8, B=2, S=17, float32, bias,
    no RoPE, no mask, unless ``fields`` say otherwise."""
    base: dict[str, object] = dict(batch=2, sq=17, sk=17, embed_dim=12, num_heads=4, num_kv_heads=2, head_dim=8,
                                   bias=True, causal=False, window=None, rope=None, cross=False, mask_kind="none",
                                   dtype=torch.float32, seed=5)
    return Case(**{**base, **fields})  # type: ignore[arg-type]


#: Explicit examples run before the drawn ones: the paths a sweep of the drawn size could miss (each
#: was taken by the larger sweep these replaced, checked with coverage.py's branch coverage of
#: src/multihead), and the sizes the larger sweep drew. The widest problem: B·H·Sq·Sk = 152,100
#: scores, where "auto" takes the native FlashAttention loop for a forward (D = 16).
WIDEST = dict(batch=3, sq=65, sk=65, embed_dim=24, num_heads=12, num_kv_heads=3, head_dim=16)


def naive_layer(layer: mh.MultiHeadAttention, x: torch.Tensor, context: torch.Tensor | None,
                allowed: torch.Tensor, *, return_weights: bool = False,
                reverse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The textbook computation in x's dtype: no grouping tricks, no safe softmax.

    ``reverse`` sums every projection's products in the opposite order: the same
    computation with different rounding (see :func:`naive_errors`).
    """
    src = x if context is None else context
    b, s, _ = x.shape
    sk = src.shape[1]
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    flip = (lambda t: t.flip(-1)) if reverse else (lambda t: t)  # noqa: E731

    def lin(m: torch.nn.Linear, t: torch.Tensor) -> torch.Tensor:
        return flip(t) @ flip(m.weight.to(t.dtype)).T + (0 if m.bias is None else m.bias.to(t.dtype))

    q = lin(layer.q_proj, x).view(b, s, h, d).transpose(1, 2)
    k = lin(layer.k_proj, src).view(b, sk, hkv, d).transpose(1, 2)
    v = lin(layer.v_proj, src).view(b, sk, hkv, d).transpose(1, 2)
    if layer.rope is not None:
        q, k = naive_rope(q, layer.rope), naive_rope(k, layer.rope)
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) * layer.scale
    weights = torch.softmax(scores.float().masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    out = (weights.to(x.dtype) @ v).transpose(1, 2).reshape(b, s, h * d)
    y = lin(layer.o_proj, out)
    return (y, weights.to(x.dtype)) if return_weights else y


def naive_rope(t: torch.Tensor, rope: mh.RoPE) -> torch.Tensor:
    """Textbook RoPE; below float64 its angles are float32 products, as in Hugging Face's
    table (which the layer uses on purpose): the naive baseline must share that input,
    or an ill-conditioned case (large logits) charges the table's rounding to us."""
    s, d = t.shape[2], t.shape[3]
    if t.dtype == torch.float64:
        pos = torch.arange(s, dtype=torch.float64)[:, None]
        theta = pos * rope.base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (S, D/2)
    else:
        theta = torch.arange(s, dtype=torch.float32)[:, None] * rope.inv_freq  # (S, D/2), float32
    cos, sin = theta.cos().to(t.dtype), theta.sin().to(t.dtype)
    if rope.interleaved:
        a, c = t[..., 0::2], t[..., 1::2]
        return torch.stack((a * cos - c * sin, c * cos + a * sin), dim=-1).flatten(-2)
    a, c = t[..., : d // 2], t[..., d // 2 :]
    return torch.cat((a * cos - c * sin, c * cos + a * sin), dim=-1)


def allowed_mask(layer: mh.MultiHeadAttention, b: int, sq: int, sk: int,
                 mask: torch.Tensor | None, key_mask: torch.Tensor | None) -> torch.Tensor:
    off = torch.arange(sk)[None, :] - (torch.arange(sq)[:, None] + sk - sq)
    allowed = torch.ones(b, layer.num_heads, sq, sk, dtype=torch.bool)
    if layer.causal:
        allowed &= off <= 0
    if layer.window is not None:
        allowed &= (off > -layer.window) & (off < layer.window)
    if mask is not None:
        allowed &= mask
    if key_mask is not None:
        allowed &= key_mask[:, None, None, :]
    return allowed


def naive_errors(layer: mh.MultiHeadAttention, x: torch.Tensor, context: torch.Tensor | None,
                 allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two naive outputs, projections summed forwards and backwards.

    A naive implementation's error is a random variable: on a tiny, badly conditioned
    case (a few features, an output that cancels) one rounding order can land within an
    ulp of the truth while any other lands 10 ulps away. The criterion compares with the
    worse of two orders, so that it measures accuracy, not luck; a real bug is far
    outside both (tests/test_kernels.py and test_native.py mutate kernels to check).
    """
    return (naive_layer(layer, x, context, allowed), naive_layer(layer, x, context, allowed, reverse=True))


def assert_within_criterion(got: torch.Tensor, truth: np.ndarray, naive: torch.Tensor | tuple[torch.Tensor, ...],
                            dtype: torch.dtype, what: str, scale: float | None = None, ulps: int = 8) -> None:
    """``max|got - truth| <= 2 · max|naive - truth| + ulps · eps · (1 + scale)`` (8 ulps by default).

    ``naive`` may be several naive results (the largest error counts). ``scale``
    defaults to max|truth|; gradients pass the largest gradient of the layer, since a
    gradient that is exactly 0 in theory (one key: softmax is constant) comes out of
    fused backward formulas as a cancellation at the scale of the others.
    """
    truth_t = torch.from_numpy(truth)
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    err = (got.double() - truth_t).abs().max().item() if got.numel() else 0.0
    naives = naive if isinstance(naive, tuple) else (naive,)
    naive_err = max((n.double() - truth_t).abs().max().item() for n in naives) if got.numel() else 0.0
    if scale is None:
        scale = truth_t.abs().max().item() if truth_t.numel() else 0.0
    floor = ulps * EPS[dtype] * (1.0 + scale)
    assert err <= 2 * naive_err + floor, f"{what}: error {err:.3e} > 2 × naive {naive_err:.3e} + {floor:.1e}"


def capable(backend: str, dtype: torch.dtype, grad: bool) -> bool:
    """Whether the registry lets ``backend`` run a call of this dtype (with gradients)."""
    q = torch.zeros(1, 1, 1, 1, dtype=dtype, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        return missing_capability(get_spec(backend), q, q, q) is None


def check_every_backend(case: Case) -> None:
    """Run the case through every registered backend (weights too where offered)."""
    layer64 = case.build()
    x, context, mask, key_mask = case.inputs()
    truth, truth_w = reference_layer(layer64, x, context, mask=mask, key_mask=key_mask)
    layer = layer64.to(case.dtype)
    xd = x.to(case.dtype)
    cd = None if context is None else context.to(case.dtype)
    sk = case.sk if case.cross else case.sq
    allowed = allowed_mask(layer, case.batch, case.sq, sk, mask, key_mask)
    naive = naive_errors(layer, xd, cd, allowed)
    naive_w = naive_layer(layer, xd, cd, allowed, return_weights=True)[1]
    with torch.no_grad():
        for backend in mh.backends.available_backends():
            layer.backend = backend
            if not capable(backend, case.dtype, grad=False):
                with pytest.raises(ValueError, match=f"backend '{backend}' cannot do"):
                    layer(xd, cd, mask=mask, key_mask=key_mask)
                continue
            if backend == "explicit":
                got, weights = layer(xd, cd, mask=mask, key_mask=key_mask, return_weights=True)
                # The same criterion as the outputs: half-precision logits inherit the
                # projections' rounding (bf16 keeps 8 bits), so weights move by ~1e-2 in both.
                assert_within_criterion(weights, truth_w, naive_w, case.dtype, f"{case.dtype} weights", scale=1.0)
            else:
                got = layer(xd, cd, mask=mask, key_mask=key_mask)
            assert_within_criterion(got, truth, naive, case.dtype, f"{case.dtype} backend {backend}")


@given(cases())
@example(case(**WIDEST))
@example(case(embed_dim=18, head_dim=10, causal=True, window=3, mask_kind="random"))
@example(case(embed_dim=23, head_dim=10, cross=True, sk=33, mask_kind="padding", dtype=torch.float64))
@profile(350)
def test_every_backend_agrees_with_the_float64_reference(case: Case) -> None:
    check_every_backend(case)


@given(cases(dtypes=(torch.bfloat16, torch.float16)))
@example(case(**WIDEST, dtype=torch.float16))
@example(case(embed_dim=11, head_dim=12, window=3, rope=None, dtype=torch.bfloat16))
@example(case(embed_dim=13, head_dim=14, causal=True, mask_kind="random", dtype=torch.float16))
@example(case(embed_dim=3, head_dim=3, cross=True, sk=65, mask_kind="per_head", dtype=torch.bfloat16))
@profile(100)
def test_half_precision_paths_meet_the_criterion(case: Case) -> None:
    """bfloat16/float16 on the CPU: logits and softmax accumulate in float32."""
    check_every_backend(case)


@st.composite
def decode_cases(draw: st.DrawFn) -> tuple[Case, list[int], int]:
    case = draw(cases(dtypes=(torch.float64, torch.float32)))
    case.cross, case.causal = False, True
    case.mask_kind = "none"
    case.sq = draw(st.integers(2, 24))
    lengths = draw(st.lists(st.integers(1, case.sq), min_size=case.batch, max_size=case.batch))
    return case, lengths, draw(st.integers(0, 6))


@given(decode_cases())
@example((case(sq=8, causal=True), [8, 5], 3))  # no RoPE: the fused decoding step reads no tables
@example((case(sq=17, embed_dim=10, head_dim=10, causal=True, dtype=torch.float64), [17, 4], 2))
@example((case(sq=4, embed_dim=15, head_dim=11, causal=True, window=3), [4, 1], 6))
@example((case(sq=13, embed_dim=18, head_dim=8, causal=True, rope="half"), [13, 7], 1))
@example((case(sq=9, embed_dim=22, head_dim=16, causal=True, rope="interleaved", batch=1), [9], 4))
@example((case(sq=5, embed_dim=23, head_dim=6, causal=True, rope="half", batch=3), [5, 2, 3], 0))
@profile(175)
def test_cache_decoding_agrees_with_the_reference(params: tuple[Case, list[int], int]) -> None:
    """Right-padded prompts of random lengths, then single tokens, per-row lengths."""
    case, lengths, steps = params
    layer64 = case.build()
    x, *_ = case.inputs()  # (B, S, E); row b's prompt is x[b, :lengths[b]]
    total = case.sq + steps
    gen = torch.Generator().manual_seed(case.seed + 2)
    seq = torch.randn(case.batch, total, case.embed_dim, generator=gen, dtype=torch.float64)
    layer = layer64.to(case.dtype)
    pad = max(lengths)
    prompt = torch.zeros(case.batch, pad, case.embed_dim, dtype=torch.float64)
    key_mask = torch.zeros(case.batch, pad, dtype=torch.bool)
    for b, n in enumerate(lengths):
        prompt[b, :n] = seq[b, :n]
        key_mask[b, :n] = True
    with torch.no_grad():
        cache = layer.new_cache(case.batch, pad + steps)
        first = layer(prompt.to(case.dtype), cache=cache, key_mask=key_mask)
        later = [layer(torch.stack([seq[b, n + t] for b, n in enumerate(lengths)])[:, None].to(case.dtype), cache=cache)
                 for t in range(steps)]
    for b, n in enumerate(lengths):
        row = seq[b : b + 1, : n + steps]
        truth, _ = reference_layer(layer64, row)
        naive = naive_errors(layer, row.to(case.dtype), None, allowed_mask(layer, 1, n + steps, n + steps, None, None))
        got = torch.cat([first[b, :n]] + [o[b] for o in later], dim=0)[None]
        assert_within_criterion(got, truth, naive, case.dtype, f"row {b} (prompt {n}, {steps} steps)")


@given(cases(dtypes=(torch.float32,)))
# q, k, v whose gradients the native backward lays out (B, S, H, D) (not dense: H·D rows of 1 query)
@example(case(batch=1, sq=2, sk=16, embed_dim=5, num_heads=6, num_kv_heads=3, head_dim=2, causal=True,
              rope="half", mask_kind="per_head", seed=9406))
@example(case(sq=13, embed_dim=14, head_dim=10, window=5))
@example(case(sq=31, sk=65, embed_dim=2, head_dim=17, cross=True, mask_kind="padding"))
@example(case(sq=64, embed_dim=3, head_dim=16, causal=True, rope="interleaved", num_heads=6, num_kv_heads=3))
@example(case(sq=7, embed_dim=5, head_dim=4, rope="half", batch=3, mask_kind="random"))
@profile(90)
def test_float32_gradients_agree_with_float64_gradients(case: Case) -> None:
    """Gradients of x (and context) and of every parameter, every backend, vs float64 autograd."""
    x, context, mask, key_mask = case.inputs()
    gen = torch.Generator().manual_seed(case.seed + 3)
    upstream = torch.randn(case.batch, case.sq, case.embed_dim, generator=gen, dtype=torch.float64)

    def grads(layer: mh.MultiHeadAttention, dtype: torch.dtype, backend: str) -> list[torch.Tensor]:
        layer = layer.to(dtype)
        layer.backend = backend
        layer.zero_grad(set_to_none=True)
        xs = x.to(dtype).clone().requires_grad_()
        cs = None if context is None else context.to(dtype).clone().requires_grad_()
        (layer(xs, cs, mask=mask, key_mask=key_mask) * upstream.to(dtype)).sum().backward()
        out = [xs.grad] + ([cs.grad] if cs is not None else []) + [p.grad for p in layer.parameters()]
        return [g.double() for g in out]

    truth = grads(case.build(), torch.float64, "explicit")
    naive_layer32 = case.build().float()
    naive_layer32.zero_grad(set_to_none=True)
    xs = x.float().clone().requires_grad_()
    cs = None if context is None else context.float().clone().requires_grad_()
    sk = case.sk if case.cross else case.sq
    allowed = allowed_mask(naive_layer32, case.batch, case.sq, sk, mask, key_mask)
    (naive_layer(naive_layer32, xs, cs, allowed) * upstream.float()).sum().backward()
    naive = [xs.grad] + ([cs.grad] if cs is not None else []) + [p.grad for p in naive_layer32.parameters()]
    scale = max(t.abs().max().item() for t in truth if t.numel())
    for backend in mh.backends.available_backends():
        if not capable(backend, torch.float32, grad=True):
            with pytest.raises(ValueError, match=f"backend '{backend}' cannot do gradients"):
                grads(case.build(), torch.float32, backend)
            continue
        got = grads(case.build(), torch.float32, backend)
        for i, (g, t, n) in enumerate(zip(got, truth, naive)):
            # Floor: 16·√(B·Sq) ulps of the largest gradient. Where a gradient is 0 in theory
            # (a query with one allowed key) SDPA's fused backward returns cancellation
            # noise, and a weight's gradient sums B·Sq tokens' worth of it (random-walk
            # growth). Seen at the thorough profile: 14 ulps at B·Sq = 3, 22 at 32. A
            # wrong gradient is off by the gradient's size, millions of ulps.
            assert_within_criterion(g, t.numpy(), n.double(), torch.float32, f"backend {backend}, gradient {i}",
                                    scale=scale, ulps=round(16 * math.sqrt(case.batch * case.sq)))


@pytest.mark.parametrize("backend", ["explicit", "sdpa"])
@pytest.mark.parametrize("causal, window, hkv", [(False, None, 2), (True, None, 1), (True, 2, 2)])
def test_gradcheck_float64(backend: str, causal: bool, window: int | None, hkv: int) -> None:
    torch.random.default_generator.manual_seed(0)
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, hkv, 5, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, hkv, 5, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False, True, True]]).expand(4, 5)
    fn = lambda q, k, v: mh.attention(q, k, v, causal=causal, window=window, mask=mask, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_module_parameters_float64() -> None:
    torch.random.default_generator.manual_seed(0)
    layer = mh.MultiHeadAttention(6, 2, num_kv_heads=1, causal=True, rope=mh.RoPE(4), head_dim=4,
                                  dtype=torch.float64)
    x = torch.randn(1, 4, 6, dtype=torch.float64, requires_grad=True)
    params = tuple(layer.parameters())

    def fn(x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(layer, dict(zip([n for n, _ in layer.named_parameters()], ps)), (x,))

    assert torch.autograd.gradcheck(fn, (x, *[p.detach().requires_grad_() for p in params]))
