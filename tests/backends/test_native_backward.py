"""The native backward (``csrc/backward.cpp``, FlashAttention-2's) against float64 oracles.

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim,
Dv value head dim.

Ground truth: autograd through the float64 ``"explicit"`` path (softmax(q·kᵀ)·v written
out), itself checked against the seed's reference in ``tests/core``. Criterion
(flash-attn's for gradients): our float32 error is at most 3× the naive float32 one
(autograd through ``"explicit"`` in float32); the property test adds a floor of 8 ulps (as
the forward's test) of the largest gradient for its tiny cases, whose gradients can be
exactly 0; the shapes at the tiles' edges and the issue's MQA case are held to it with no
floor. gradcheck runs in float64 through the registered operator, whose float64 path
instantiates the plain templated C++ backward (the algorithm and its masking); the float32
register tiles (fused and two-pass) are held to the criterion against float64 above.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import LAYOUTS, MASK_KINDS, as_layout, core_mask, reference_layer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multihead as mh
from multihead import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler: " + native.status())

SCALE = float(os.environ.get("MULTIHEAD_PROPERTY_EXAMPLES", "1"))
PROFILE = settings(max_examples=max(1, int(60 * SCALE)), deadline=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SIZES = [1, 2, 13, 31, 33, 63, 64, 65, 130]


def _grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, dtype: torch.dtype,
           layout: str = "contiguous", **kw: object) -> list[torch.Tensor]:
    """dq, dk, dv, the attention given q, k, v and dout laid out as ``layout`` (conftest.as_layout;
    "packed" packs q, k, v and gives dout "transposed")."""
    leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out = mh.attention(*as_layout(layout, *leaves), **kw)
    out.backward(as_layout("transposed" if layout == "packed" else layout, dout.to(dtype))[0])
    return [t.grad for t in leaves]


def _assert_criterion(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, floor_ulps: int = 8,
                      layout: str = "contiguous", **kw: object) -> None:
    """dq, dk, dv of backend "native" by the gradient criterion (see the module docstring):
    error ≤ 3 × naive + ``floor_ulps`` ulps of the largest gradient; with q, k, v and dout laid
    out as ``layout``, also bit for bit those of contiguous inputs."""
    dout = torch.randn(q.shape[:-1] + v.shape[-1:], dtype=torch.float64)
    truth = _grads(q, k, v, dout, torch.float64, backend="explicit", **kw)
    naive = _grads(q, k, v, dout, torch.float32, backend="explicit", **kw)
    ours = _grads(q, k, v, dout, torch.float32, layout, backend="native", **kw)
    if layout != "contiguous":
        for name, strided, contiguous in zip("qkv", ours, _grads(q, k, v, dout, torch.float32, backend="native", **kw)):
            assert torch.equal(strided, contiguous), name
    # A gradient can be exactly 0 (dq of a row with one key); its float32 rounding is
    # then measured against the largest of the three.
    floor = floor_ulps * 2.0**-23 * max(t.abs().max().item() for t in truth)
    for name, t, n, o in zip("qkv", truth, naive, ours):
        assert o.dtype == torch.float32 and o.shape == t.shape and torch.isfinite(o).all(), name
        err, naive_err = (o.double() - t).abs().max().item(), (n.double() - t).abs().max().item()
        assert err <= 3 * naive_err + floor, (name, err, naive_err, floor)


@st.composite
def problems(draw: st.DrawFn) -> dict:
    b = draw(st.sampled_from([1, 2]))
    hkv, g = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3]))
    sq = draw(st.sampled_from(SIZES))
    sk = draw(st.sampled_from([sq, sq] + SIZES))
    d = draw(st.sampled_from([1, 7, 16, 33, 64]))
    dv = draw(st.sampled_from([d, 8, 24]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return {"q": randn(b, hkv * g, sq, d), "k": randn(b, hkv, sk, d), "v": randn(b, hkv, sk, dv),
            "mask": core_mask(draw(st.sampled_from(MASK_KINDS)), b, hkv * g, sq, sk, gen),
            "causal": draw(st.booleans()), "window": draw(st.sampled_from([None, None, 1, 5, 40])),
            "scale": draw(st.sampled_from([None, 0.3]))}


@PROFILE
@given(problems())
def test_native_gradients_meet_the_criterion_across_blocks(p: dict) -> None:
    """Key blocks of 64 and query tiles of 16 (edges 63-65, 130), GQA/MQA, masks with
    empty rows, windows, causal with Sq ≠ Sk (bottom-right)."""
    _assert_criterion(p["q"], p["k"], p["v"], mask=p["mask"], causal=p["causal"], window=p["window"],
                      scale=p["scale"])


def test_mqa_case_where_torch_flash_backward_is_six_times_naive() -> None:
    """The issue's case: MQA, Sq=128, Sk=217, D=111 (torch's CPU flash backward: 5.9× naive on dq)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64)
               for s in ((2, 8, 128, 111), (2, 1, 217, 111), (2, 1, 217, 111)))
    _assert_criterion(q, k, v, floor_ulps=0)
    _assert_criterion(q, k, v, floor_ulps=0, causal=True)


# (H, Hkv, Sq, Sk, D, Dv, causal, window, mask): the float32 tiles' edges. Query tiles of
# 6·16 / 12·16 rows and 6 / 12 row tiles (AVX2 / AVX-512), key panels of 16 / 32, dK/dV
# blocks of 96 keys, chunks of 256 keys; D and Dv padded to whole vectors of 8 / 16.
EDGES = [
    (4, 4, 97, 97, 40, 40, False, None, None),          # G = 1, D = 5 vectors of 8
    (8, 2, 70, 130, 72, 24, True, None, None),          # G = 4, Dv ≠ D, Sq < Sk (bottom-right)
    (8, 1, 300, 257, 96, 96, True, 37, None),           # G = 8, causal + window, Sq > Sk
    (4, 2, 101, 290, 111, 40, False, 50, None),         # D = 111 (7 floats past the last vector)
    (4, 1, 61, 203, 33, 17, False, None, "padded"),     # key padding, one batch entry entirely padded
    (2, 2, 150, 50, 64, 64, True, None, "rows"),        # rows with no key: causal (Sq > Sk) and masked
]


def _edge_mask(kind: str | None, b: int, h: int, sq: int, sk: int) -> torch.Tensor | None:
    gen = torch.Generator().manual_seed(5)
    if kind == "padded":  # key padding (B, 1, 1, Sk): entry 0 keeps its first keys, entry 1 none
        keep = torch.rand(b, 1, 1, sk, generator=gen) < 0.7
        keep[0] = False
        keep[0, ..., : sk - 40] = True
        if b > 1:
            keep[1] = False
        return keep
    if kind == "rows":  # random, some (head, query) rows empty
        mask = torch.rand(b, h, sq, sk, generator=gen) < 0.8
        mask[:, :, ::7] = False
        return mask
    return None


@pytest.mark.parametrize("b", [1, 4], ids=["two-pass", "fused"])
@pytest.mark.parametrize("h, hkv, sq, sk, d, dv, causal, window, mask", EDGES)
def test_tile_edges_meet_the_criterion_with_no_floor(b: int, h: int, hkv: int, sq: int, sk: int, d: int, dv: int,
                                                      causal: bool, window: int | None, mask: str | None) -> None:
    """Sizes that are not multiples of the tiles, D not a multiple of the vector, Dv ≠ D,
    Sq ≠ Sk, GQA with G = 1, 4, 8, windows, padding and rows with no key: error ≤ 3× naive.
    With B·Hkv ≥ 4 the float32 backward runs fused (one pass), else in two passes (dQ, then
    dK/dV); B = 1 takes two passes except for the first case (Hkv = 4)."""
    gen = torch.Generator().manual_seed(sq * 1000 + sk)
    q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64)
               for s in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv)))
    _assert_criterion(q, k, v, floor_ulps=0, mask=_edge_mask(mask, b, h, sq, sk), causal=causal, window=window)


# (H, Hkv, S, D, Dv, causal, window, mask): q, k, v and dout at other strides; S = Sq = Sk (packed).
STRIDED = [
    (4, 4, 70, 64, 64, False, None, None),       # D a multiple of the vector: dQ summed in place (fused)
    (8, 2, 97, 40, 24, True, None, "rows"),      # GQA, D padded (a dQ buffer), Dv ≠ D, rows with no key
    (6, 1, 130, 33, 33, True, 37, "padded"),     # MQA, causal + window, key padding
]


@pytest.mark.parametrize("b", [1, 4], ids=["two-pass", "fused"])
@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("h, hkv, s, d, dv, causal, window, mask", STRIDED)
def test_strided_inputs_give_the_contiguous_gradients_bitwise(b: int, layout: str, h: int, hkv: int, s: int, d: int,
                                                             dv: int, causal: bool, window: int | None,
                                                             mask: str | None) -> None:
    """The backward reads q, k, v and dout at their strides (the layer's heads are views of its
    projections; a fused qkv projection's are slices of one buffer): the gradients are those of
    contiguous inputs bit for bit (the same sums in the same order), so within the criterion."""
    gen = torch.Generator().manual_seed(s * 10 + d)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64)
               for shape in ((b, h, s, d), (b, hkv, s, d), (b, hkv, s, dv)))
    _assert_criterion(q, k, v, floor_ulps=0, layout=layout, mask=_edge_mask(mask, b, h, s, s), causal=causal,
                      window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_the_operator_reads_strides_and_lays_out_its_gradients(dtype: torch.dtype, layout: str) -> None:
    """Through the operator itself (float32's tiles and float64's plain loop): bitwise the
    contiguous gradients; each with its input's strides where those are dense with contiguous
    rows (the layer's heads: their backward is then a view, no copy), else laid out (B, S, H, D)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(*shape, generator=gen, dtype=dtype)
                     for shape in ((2, 6, 45, 24), (2, 2, 45, 24), (2, 2, 45, 24), (2, 6, 45, 24)))
    mask = torch.rand(2, 1, 45, 45, generator=gen) < 0.8
    op = torch.ops.multihead
    out, lse = op.attention(q, k, v, mask, 0.3, True, 20, False)
    delta = (dout * out).sum(-1)
    want = op.attention_backward(dout, q, k, v, lse, delta, mask, 0.3, True, 20)
    strided = as_layout(layout, q, k, v)
    d_out = as_layout("transposed" if layout == "packed" else layout, dout)[0]
    got = op.attention_backward(d_out, *strided, lse, delta, mask, 0.3, True, 20)
    for name, g, w, t in zip("qkv", got, want, strided):
        assert torch.equal(g, w), name
        b, h, s, d = t.shape
        expected = t.stride() if layout == "transposed" else (s * h * d, d, h * d, 1)  # dense rows, else (B, S, H, D)
        assert g.stride() == expected, (name, g.stride())


@pytest.mark.parametrize("b", [1, 2], ids=["two-pass", "fused"])
def test_gradients_do_not_depend_on_the_thread_count(b: int) -> None:
    """Every sum runs in an order fixed by the shapes: 1 and 2 threads agree bit for bit."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(*s, generator=gen) for s in ((b, 8, 203, 72), (b, 2, 203, 72), (b, 2, 203, 40)))
    dout = torch.randn(b, 8, 203, 40, generator=gen)
    mask = torch.rand(b, 1, 203, 203, generator=gen) < 0.9
    before = torch.get_num_threads()
    grads = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            grads.append(_grads(q, k, v, dout, torch.float32, backend="native", mask=mask, causal=True, window=90))
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*grads):
        assert torch.equal(one, two)


def test_fully_masked_rows_get_zero_gradients_not_nan() -> None:
    q, k, v = (torch.randn(1, 2, 6, 16, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 2, :] = False  # query 2 sees nothing
    out = mh.attention(q, k, v, mask=mask, backend="native")
    out.backward(torch.ones_like(out))
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert torch.equal(q.grad[:, :, 2], torch.zeros_like(q.grad[:, :, 2]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("causal, window, masked, layout", [(False, None, False, "contiguous"),
                                                            (True, None, True, "transposed"),
                                                            (True, 3, False, "padded"), (False, 2, True, "contiguous")])
def test_gradcheck_in_float64_through_the_operator(causal: bool, window: int | None, masked: bool,
                                                   layout: str) -> None:
    """The float64 instantiation of the plain C++ backward, against finite differences;
    GQA (2 heads per K/V head), Sq ≠ Sk, a row with no key when masked; q, k, v (and so the
    gradient of out) read at other strides in two cases."""
    q = torch.randn(1, 4, 7, 5, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 9, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 9, 3, dtype=torch.float64, requires_grad=True)
    mask = None
    if masked:
        mask = torch.rand(1, 1, 7, 9) < 0.7
        mask[..., 1, :] = False
    op = torch.ops.multihead.attention
    assert torch.autograd.gradcheck(lambda *t: op(*as_layout(layout, *t), mask, 0.4, causal, window, False)[0],
                                    (q, k, v), fast_mode=True)


def test_gradcheck_of_the_log_sum_exp_output() -> None:
    """lse is an output too: its gradient enters as ds += p · dlse (delta − dlse)."""
    q, k, v = (torch.randn(1, 2, s, 4, dtype=torch.float64, requires_grad=True) for s in (5, 6, 6))
    op = torch.ops.multihead.attention
    assert torch.autograd.gradcheck(lambda *t: [x.sin() for x in op(*t, None, 0.5, True, None, False)], (q, k, v),
                                    fast_mode=True)


def test_every_layer_parameter_gradient_matches_the_float64_reference() -> None:
    """Through the module (projections, GQA, RoPE, causal) with backend="native"."""
    torch.random.default_generator.manual_seed(3)
    layer = mh.MultiHeadAttention(96, 6, num_kv_heads=2, causal=True, rope=mh.RoPE(16, 10000.0), backend="native")
    wide = mh.MultiHeadAttention(96, 6, num_kv_heads=2, causal=True, rope=mh.RoPE(16, 10000.0),
                                 backend="explicit").double()
    wide.load_state_dict(layer.state_dict())
    naive = mh.MultiHeadAttention(96, 6, num_kv_heads=2, causal=True, rope=mh.RoPE(16, 10000.0), backend="explicit")
    naive.load_state_dict(layer.state_dict())
    x = torch.randn(2, 70, 96, dtype=torch.float64)
    dy = torch.randn(2, 70, 96, dtype=torch.float64)
    for m, dt in ((layer, torch.float32), (wide, torch.float64), (naive, torch.float32)):
        m(x.to(dt)).backward(dy.to(dt))
    for (name, p), p64, pn in zip(layer.named_parameters(), wide.parameters(), naive.parameters()):
        err = (p.grad.double() - p64.grad).abs().max().item()
        naive_err = (pn.grad.double() - p64.grad).abs().max().item()
        assert err <= 3 * naive_err + 4 * 2.0**-23 * p64.grad.abs().max().item(), (name, err, naive_err)
    assert reference_layer is not None  # the float64 layer above is checked against it in tests/core


_MEMORY_PROBE = """
import resource, torch, multihead as mh
torch.set_num_threads(2)
S = 4096
q, k, v = (torch.randn(1, 1, S, 64, requires_grad=True) for _ in range(3))
out = mh.attention(q, k, v, causal=True, backend="native")
dout = torch.randn_like(out)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out.backward(dout)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""


def test_backward_memory_is_linear_in_the_sequence() -> None:
    """At S = 4096 one S×S float32 matrix is 64 MiB; q, k, v, out and their gradients
    are 1 MiB each. The backward's peak must stay far below the matrix (in a fresh
    process, so the peak resident size measures this call alone)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    grown = int(done.stdout.split()[-1])
    assert grown < 24 * 2**20, f"the backward grew the peak by {grown / 2**20:.0f} MiB"
