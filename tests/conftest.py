"""Shared helpers: the float64 reference run on a layer's own weights, and seeding.

Notation: B batch, S tokens (queries), Sk keys, E embed_dim, H query heads,
Hkv key/value heads, D head_dim.

The reference (:mod:`multihead.reference`) works on one sequence in the seed's
[features, tokens] convention; the helpers here run it per batch element and transpose
back, so tests can compare it elementwise with the [tokens, features] PyTorch paths.
"""

from __future__ import annotations

import os

# Tests never download anything: Hugging Face classes are built from configs.
os.environ["HF_HUB_OFFLINE"] = "1"
# The suite computes with oneDNN's GEMM wherever torch has it, whatever this machine would measure
# faster (multihead.backends.gemm.gemm_choice); tests/backends/test_gemm_choice.py covers the rest.
# Set MULTIHEAD_GEMM=torch to run the whole suite on torch.matmul instead.
os.environ.setdefault("MULTIHEAD_GEMM", "onednn")
# Under pytest-xdist (pyproject's addopts) the workers share the cores. Each keeps at least 2 torch
# threads, so the kernels' parallel splits are still what the tests exercise; OpenMP's idle threads
# sleep instead of spinning (2 workers of 2 spinning threads on 2 cores took 1.8x the serial time;
# sleeping: 0.67x). Set before torch is imported (OpenMP reads them once), inherited by subprocesses.
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OMP_NUM_THREADS", str(max(2, len(os.sched_getaffinity(0)) // int(workers))))

from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import multihead as mh  # noqa: E402

#: The machine build and its stand-in compiler, shared by the native build tests (one real compile).
pytest_plugins = ["native_builds"]

#: float64 paths agree with the float64 reference to this (absolute) tolerance.
ATOL64 = 1e-10


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test draws the same random numbers, whatever ran before it. (The CPU generator's own
    seeding: ``torch.manual_seed`` also queues a lazy CUDA/XPU seeding with a formatted stack each
    call, ~5 ms under pytest's deep stacks, and the suite seeds every test; the tests seed so too.)"""
    torch.random.default_generator.manual_seed(0)


def np64(t: torch.Tensor | None) -> np.ndarray | None:
    """A tensor as a float64 NumPy array (None stays None)."""
    return None if t is None else t.detach().cpu().to(torch.float64).numpy()


def reference_weights(layer: mh.MultiHeadAttention) -> dict[str, Any]:
    """The layer's parameters as the reference's keyword arguments (W_q .. b_o)."""
    out: dict[str, Any] = {}
    for proj, w, b in (("q_proj", "W_q", "b_q"), ("k_proj", "W_k", "b_k"),
                       ("v_proj", "W_v", "b_v"), ("o_proj", "W_o", "b_o")):
        linear = getattr(layer, proj)
        out[w] = np64(linear.weight)
        out[b] = np64(linear.bias)
    return out


def reference_layer(
    layer: mh.MultiHeadAttention,
    x: torch.Tensor,
    context: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Run the float64 reference with ``layer``'s weights and settings.

    Args: as :meth:`multihead.MultiHeadAttention.forward`; ``scale`` is the reference's
    (default 1/√d_head), never read from the layer, so a wrong default scale is caught.

    Returns:
        (y (B, S, E), weights (B, H, S, Sk)), float64 NumPy arrays.
    """
    b, s, _ = x.shape
    sk = s if context is None else context.shape[1]
    full = None if mask is None else mask.expand(b, layer.num_heads, s, sk)  # (B, H, S, Sk)
    rope = layer.rope
    outs, weights = [], []
    for i in range(b):
        pos = None
        if positions is not None:
            pos = np64(positions if positions.dim() == 1 else positions[i if positions.shape[0] > 1 else 0])
        O, steps = mh.reference.multi_head_attention(
            np64(x[i]).T, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
            **reference_weights(layer),
            causal=layer.causal, window=layer.window, scale=scale,
            rope_base=None if rope is None else rope.base,
            rope_interleaved=False if rope is None else rope.interleaved,
            rotary_dim=None if rope is None else rope.rotary_dim,
            positions=pos,
            context=None if context is None else np64(context[i]).T,
            mask=None if full is None else full[i].numpy(),
            key_mask=None if key_mask is None else key_mask[i].numpy(),
            return_steps=True,
        )
        outs.append(O.T)  # [E, S] -> (S, E)
        weights.append(np.stack(steps["A"]))  # h × [S, Sk] -> (H, S, Sk)
    return np.stack(outs), np.stack(weights)


def reference_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The functional core's float64 ground truth: the reference layer with identity projections.

    With ``W_q = I`` the reference's Q is the input itself; K and V come from one
    context ``[k; v]`` through ``W_k = [I 0]`` and ``W_v = [0 I]``; ``W_o = I`` returns
    the concatenated heads. So this runs exactly the reference's masking, grouping and
    per-head softmax on the given q, k, v.

    Args: as :func:`multihead.attention`; q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv).

    Returns:
        (out (B, H, Sq, Dv), weights (B, H, Sq, Sk)), float64 NumPy arrays.
    """
    b, h, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    nk, nv = hkv * d, hkv * dv
    full = None if mask is None else mask.expand(b, h, sq, sk)
    eye = np.eye
    outs, weights = [], []
    for i in range(b):
        X = np64(q[i]).transpose(0, 2, 1).reshape(h * d, sq)  # [H·D, Sq], head k in rows k·D..
        C = np.concatenate([np64(k[i]).transpose(0, 2, 1).reshape(nk, sk),
                            np64(v[i]).transpose(0, 2, 1).reshape(nv, sk)])  # [Hkv·(D+Dv), Sk]
        O, steps = mh.reference.multi_head_attention(
            X, eye(h * d), np.hstack([eye(nk), np.zeros((nk, nv))]),
            np.hstack([np.zeros((nv, nk)), eye(nv)]), eye(h * dv), h, num_kv_heads=hkv,
            causal=causal, window=window, scale=scale, context=C,
            mask=None if full is None else full[i].numpy(), return_steps=True,
        )
        outs.append(O.reshape(h, dv, sq).transpose(0, 2, 1))  # [H·Dv, Sq] -> (H, Sq, Dv)
        weights.append(np.stack(steps["A"]))
    return np.stack(outs), np.stack(weights)


def copy_weights(dst: mh.MultiHeadAttention, src: mh.MultiHeadAttention) -> None:
    """Copy every projection (weights and biases) from ``src`` into ``dst``."""
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            a, b = getattr(dst, name), getattr(src, name)
            a.weight.copy_(b.weight)
            if a.bias is not None:
                a.bias.copy_(b.bias)


#: Kinds of mask the kernel tests draw ("none" twice: unmasked calls are the common case).
MASK_KINDS = ["none", "none", "random", "keys", "heads", "2d"]


def core_mask(kind: str, b: int, h: int, sq: int, sk: int, gen: torch.Generator) -> torch.Tensor | None:
    """A bool mask for the attention core (True = may attend), broadcastable to (B, H, Sq, Sk).

    "random" empties some rows entirely; "keys" is key padding (B, 1, 1, Sk); "heads"
    masks whole (head, query) rows (1, H, Sq, 1); "2d" is one (Sq, Sk) mask for all.
    Every kind draws from ``gen`` (so the stream does not depend on the kind).
    """
    masks = {
        "none": None,
        "random": torch.rand(b, h, sq, sk, generator=gen) < 0.5,
        "keys": torch.rand(b, 1, 1, sk, generator=gen) < 0.5,
        "heads": torch.rand(1, h, sq, 1, generator=gen) < 0.7,
        "2d": torch.rand(sq, sk, generator=gen) < 0.6,
    }
    return masks[kind]


#: Layouts of (B, H, S, D) tensors (:func:`as_layout`).
LAYOUTS = ["contiguous", "transposed", "packed", "padded", "columns"]


def as_layout(kind: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The (B, H, S, D) ``tensors`` with the same values, laid out as ``kind`` (differentiably).

    "transposed": views of (B, S, H, D) buffers (the layer's heads, views of its projections);
    "packed": slices of one (B, S, Σ H·D) buffer, as a fused qkv projection gives (all the
    tensors must have the same B and S); "padded": each row the first D floats of a row of
    D + 3, the rest NaN (a kernel reading past a row's end poisons its results); "columns":
    views of (B, H, D, S) buffers, the one layout whose last dim is not contiguous.
    """
    if kind == "contiguous":
        return [t.contiguous() for t in tensors]
    if kind == "transposed":
        return [t.transpose(1, 2).contiguous().transpose(1, 2) for t in tensors]
    if kind == "columns":
        return [t.transpose(2, 3).contiguous().transpose(2, 3) for t in tensors]
    if kind == "padded":
        return [torch.cat([t, torch.full_like(t[..., :3], float("nan"))], -1)[..., : t.shape[-1]] for t in tensors]
    assert kind == "packed", kind
    b, _, s, _ = tensors[0].shape
    flat = [t.transpose(1, 2).reshape(b, s, -1) for t in tensors]  # (B, S, H·D) each
    buffer = torch.cat(flat, -1)
    views, at = [], 0
    for t, f in zip(tensors, flat):
        views.append(buffer[..., at : at + f.shape[-1]].view(b, s, t.shape[1], t.shape[3]).transpose(1, 2))
        at += f.shape[-1]
    return views


def record_ops() -> Any:
    """A TorchDispatchMode that runs every operator and records its name in ``.ops`` (as a
    tracer or a fake-tensor mode would see the call): ``with record_ops() as seen: ...``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    return RecordOps()


@pytest.fixture
def amd_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU taken to be AMD's (no AMX), where "auto" measured its native thresholds: tests of the
    native forward through "auto" then take it on any machine (an Intel CPU with AVX-512 takes it
    from 2^20 scores, bfloat16 with AMX never: tests/backends/test_router.py::test_intel_avx512_and_amx_rules)."""
    from multihead.backends import native

    monkeypatch.setattr(native, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(native, "amx_bf16", lambda: False)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's chromium under Playwright (tests/browser.py: the flags, RecordedPage)."""
    from playwright.sync_api import sync_playwright

    from browser import CHROMIUM, FLAGS

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()
