"""The installed builds of the native kernels for other vector widths than the one this machine
uses (``MULTIHEAD_NATIVE_ISA``), run here: the AVX-512 and AVX2 builds on an AMX machine, the
AVX2 build on an AVX-512 one, and the 128-bit ``baseline`` build (no AVX) anywhere.

The register tiles, the decoding loop and the GEMV are chosen when the kernels are compiled, so a
CI machine would only ever run its own width's code; this runs every other build this CPU can run
(each in a subprocess) against float64 references: the FlashAttention loop
(GQA, causal, window, key padding) in float32 and bfloat16, the decoding loop, the layer's fused
decoding step against a whole-sequence forward (float32 and bfloat16, RoPE, GQA), and the
native backward's gradients.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from multihead.backends import native
from multihead.backends.native import isa

_SCRIPT = r"""
import sys
import torch
import multihead as mh
from multihead import decode
from multihead.backends import native
from multihead.backends.native import isa

assert native.available(), native.status()
bits = native.vector_bits()
assert bits == int(sys.argv[1]), (bits, sys.argv[1])
torch.random.default_generator.manual_seed(0)
D64 = torch.float64


def close(name, got, want, tol):
    err = (got.to(D64) - want.to(D64)).abs().max().item()
    assert err <= tol, (name, err, tol)


# The FlashAttention loop: GQA 8/2, S = 77 (tile edges), causal, window, key padding; float32 and bf16.
q, k, v = torch.randn(2, 8, 77, 64), torch.randn(2, 2, 77, 64), torch.randn(2, 2, 77, 64)
keys = torch.ones(2, 1, 1, 77, dtype=torch.bool)
keys[1, ..., 60:] = False
for kw in ({}, {"causal": True}, {"causal": True, "window": 17}, {"mask": keys}):
    want = mh.attention(q.double(), k.double(), v.double(), backend="explicit", **kw)
    close(f"f32 {kw}", mh.attention(q, k, v, backend="native", **kw), want, 2e-5)
    half = [t.bfloat16() for t in (q, k, v)]
    want = mh.attention(*[t.double() for t in half], backend="explicit", **kw)
    close(f"bf16 {kw}", mh.attention(*half, backend="native", **kw), want, 2e-2)

# The decoding loop: one query row per head, 32/8 heads, 300 keys (splits, tails).
q, k, v = torch.randn(1, 32, 1, 64), torch.randn(1, 8, 300, 64), torch.randn(1, 8, 300, 64)
want = mh.attention(q.double(), k.double(), v.double(), causal=True, backend="explicit")
close("decode f32", mh.attention(q, k, v, causal=True, backend="native"), want, 2e-5)
half = [t.bfloat16() for t in (q, k, v)]
want = mh.attention(*[t.double() for t in half], causal=True, backend="explicit")
close("decode bf16", mh.attention(*half, causal=True, backend="native"), want, 2e-2)

# The fused decoding step (projections, RoPE, cache write, attention, W_o in one call) against a
# whole-sequence causal forward of the same layer.
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
    layer = mh.MultiHeadAttention(256, 8, num_kv_heads=2, causal=True, rope=mh.RoPE(32)).eval().to(dtype)
    x = torch.randn(1, 40, 256).to(dtype)
    with torch.no_grad():
        whole = layer.double()(x.double()) if dtype == torch.float32 else None
        layer.to(dtype)
        ref = layer(x) if whole is None else whole
        cache = layer.new_cache(1, 64)
        layer(x[:, :32], cache=cache)
        steps = [layer(x[:, i : i + 1], cache=cache) for i in range(32, 40)]
        why = decode.why_not_fused(layer, x[:, :1], cache)
        assert (why is None) == (bits >= 256), why  # fused with AVX2 and AVX-512 builds only
    close(f"fused step {dtype}", torch.cat(steps, 1), ref[:, 32:], tol)

# The native backward (FlashAttention-2's) against float64 gradients.
q, k, v = (torch.randn(1, 4, 70, 64, requires_grad=True) for _ in range(3))
g = torch.randn(1, 4, 70, 64)
ours = torch.autograd.grad(mh.attention(q, k, v, causal=True, backend="native"), (q, k, v), g)
ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
want = torch.autograd.grad(mh.attention(*ref, causal=True, backend="explicit"), ref, g.double())
for name, a, b in zip("qkv", ours, want):
    close(f"grad {name}", a, b, 5e-5)
print("ok", bits)
"""

#: Each installed build's vector width.
_BITS = {"amx": 512, "avx512": 512, "avx2": 256, "baseline": 128}


def _other_builds() -> list[str]:
    """The installed builds this CPU can run but does not use (the one it uses, the rest of the
    suite runs). Asked at collection."""
    used = native.build_name()
    return [name for name in isa.runnable() if name != used and name in _BITS]


def test_this_cpu_runs_more_than_one_installed_build() -> None:
    """Every x86-64 CPU runs at least its own build and the 128-bit baseline: the test below is
    never empty on CI."""
    assert native.build_name() in isa.runnable() and _other_builds(), (native.status(), isa.runnable())


@pytest.mark.parametrize("build", _other_builds())
def test_installed_builds_for_other_widths_run_here(tmp_path, build: str) -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(_BITS[build])], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "MULTIHEAD_NATIVE_ISA": build,
                                            "MULTIHEAD_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0 and done.stdout.startswith("ok"), (done.stdout + done.stderr)[-4000:]
    assert list(tmp_path.iterdir()) == []  # nothing compiled


def test_a_target_that_is_not_a_cpu_name_is_refused(tmp_path) -> None:
    code = "from multihead import native; print(native.available(), native.status())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MULTIHEAD_NATIVE_ARCH": "native -fplugin=x",
                               "MULTIHEAD_NATIVE_ISA": "machine", "MULTIHEAD_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("False the machine's own build cannot be compiled: MULTIHEAD_NATIVE_ARCH must name "
                                  "a CPU"), done.stdout
    assert list(tmp_path.iterdir()) == []
