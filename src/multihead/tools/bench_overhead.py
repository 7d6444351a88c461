"""The benchmark suite's cases where a call's fixed cost is the whole story: small attention
calls against SDPA, the layer at the bundled model's shapes against Hugging Face's BERT
attention, and a fresh process's start-up (import, ``--help``, the first call).

Notation: B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys, D head dim,
E embed_dim.

Each timed sample of a small case is :data:`CALLS` calls in a row (one call is a few µs: the
timer's own cost would show), on one thread (the cost of the call, not of a parallel region);
the suite's loop interleaves the implementations. Start-up is timed in fresh subprocesses, each
measurement the median of :data:`STARTS` processes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["CALLS", "STARTS", "GEMMS_ONLY", "one_thread", "call_cases", "bundled_layer_case", "startup"]

Fn = Callable[[], object]
#: Calls per timed sample of a small case.
CALLS = 200
#: Fresh processes per start-up measurement.
STARTS = 5
#: A layer case's floor: its projections' GEMMs alone, timed among its peers.
GEMMS_ONLY = "(projection GEMMs only)"


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread within the block (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _repeat(fn: Fn, calls: int) -> Fn:
    def run() -> None:
        for _ in range(calls):
            fn()
    return run


def call_cases(quick: bool = False) -> list[tuple[dict[str, Any], dict[str, Fn]]]:
    """``mh.attention`` (``"auto"``) against SDPA at (1, 12, 16, 32) with 16 keys (a short prefill)
    and (1, 32, 1, 128) with 512 keys (a decoding step): (spec, fns) per shape."""
    import multihead as mh

    calls = 10 if quick else CALLS
    cases = []
    for (b, h, sq, d), sk in (((1, 12, 16, 32), 16), ((1, 32, 1, 128), 512)):
        q, k, v = torch.randn(b, h, sq, d), torch.randn(b, h, sk, d), torch.randn(b, h, sk, d)
        fns: dict[str, Fn] = {
            "multihead": _repeat(functools.partial(mh.attention, q, k, v), calls),
            "torch SDPA": _repeat(functools.partial(F.scaled_dot_product_attention, q, k, v), calls),
            "multihead backend=sdpa": _repeat(functools.partial(mh.attention, q, k, v, backend="sdpa"), calls),
        }
        spec = {"case": "call/attention", "shape": f"({b},{h},{sq},{d})", "keys": sk, "calls": calls,
                "path": mh.backends.auto.auto_path(q, k, v), "flops": 4.0 * b * h * sq * sk * d * calls}
        cases.append((spec, fns))
    return cases


#: The bundled layer case's row of the same layer on the batch's real tokens, packed.
PACKED = "multihead, packed (52 real tokens)"


def bundled_layer_case(quick: bool = False) -> tuple[dict[str, Any], dict[str, Fn]] | None:
    """The layer at the bundled MiniLM's shapes (B=3, S=24, E=384, 12 heads, key padding)
    against Hugging Face's ``BertAttention`` (sdpa and eager) on the same tokens, and the same
    layer on the batch's 52 real tokens packed into one row (:data:`PACKED`: what the patched
    model runs), and the floor (:data:`GEMMS_ONLY`): the layer's four projections on the padded
    batch, ``F.linear`` with its weights, as the layer and HF run them at this size; None without
    transformers."""
    try:
        import transformers as tf
        from transformers.models.bert.modeling_bert import BertAttention
    except ImportError:
        return None
    import multihead as mh

    b, s, e, h = 3, 24, 384, 12
    calls = 2 if quick else 20
    x = torch.randn(b, s, e)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[1, 18:], keep[2, 10:] = False, False  # three sentences of 24, 18 and 10 tokens
    additive = (1.0 - keep[:, None, None, :].float()) * torch.finfo(torch.float32).min  # HF's (B, 1, 1, S)
    layer = mh.MultiHeadAttention(e, h).eval()
    # the real tokens packed into one row once, as mh.hf.pack_padding does once per model call
    packed = x[keep][None]  # (1, 52, E)
    positions = torch.cat([torch.arange(int(n)) for n in keep.sum(1)])[None]  # (1, 52): each sentence from 0
    heads = torch.randn(b, s, e)  # stands for the attention's output
    projections = [(p.weight, p.bias, src) for p, src in ((layer.q_proj, x), (layer.k_proj, x), (layer.v_proj, x),
                                                          (layer.o_proj, heads))]
    fns: dict[str, Fn] = {"multihead": _repeat(functools.partial(layer, x, mask=keep[:, None, None, :]), calls),
                          PACKED: _repeat(functools.partial(layer, packed, positions=positions, packed=True), calls),
                          GEMMS_ONLY: _repeat(lambda: [F.linear(src, w, bias) for w, bias, src in projections], calls)}
    for impl in ("sdpa", "eager"):
        cfg = tf.BertConfig(hidden_size=e, num_attention_heads=h, attention_probs_dropout_prob=0.0,
                            hidden_dropout_prob=0.0)
        cfg._attn_implementation = impl
        bert = BertAttention(cfg).eval()
        fns[f"HF BertAttention {impl}"] = _repeat(functools.partial(bert, x, attention_mask=additive), calls)
    flops = calls * (4 * 2.0 * b * s * e * e + 4.0 * b * s * s * e)
    return {"case": "layer/bundled", "batch": b, "seq": s, "embed_dim": e, "heads": h, "calls": calls,
            "flops": flops, "gemm_flops": calls * 4 * 2.0 * b * s * e * e, "gemm_count": 4}, fns


_FIRST_CALL = """
import time, torch, multihead as mh
q, k, v = (torch.randn(1, 8, 256, 64) for _ in range(3))
t = time.perf_counter(); mh.attention(q, k, v, causal=True, backend="native"); print(time.perf_counter() - t)
"""


def _process_seconds(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, env=env, timeout=300)
    return time.perf_counter() - start


def startup(quick: bool = False) -> dict[str, float]:
    """Seconds (medians of :data:`STARTS` fresh processes, each with an empty cache folder) of:
    Python alone, ``import torch``, ``import multihead`` (``import multihead as mh`` and its
    layer module: what a program uses), ``multihead --help``, and the first native
    ``mh.attention`` call of a process (timed inside it)."""
    starts = 1 if quick else STARTS
    py = sys.executable
    runs: dict[str, list[float]] = {k: [] for k in ("python", "import torch", "import multihead", "multihead --help",
                                                     "first mh.attention")}
    for _ in range(starts):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "MULTIHEAD_CACHE_DIR": cache}
            runs["python"].append(_process_seconds([py, "-c", "pass"], env))
            runs["import torch"].append(_process_seconds([py, "-c", "import torch"], env))
            runs["import multihead"].append(_process_seconds(
                [py, "-c", "import torch, multihead as mh; mh.MultiHeadAttention"], env))
            runs["multihead --help"].append(_process_seconds([py, "-m", "multihead", "--help"], env))
            done = subprocess.run([py, "-c", _FIRST_CALL], check=True, capture_output=True, text=True, env=env,
                                  timeout=300)
            runs["first mh.attention"].append(float(done.stdout.strip().splitlines()[-1]))
    return {name: statistics.median(times) for name, times in runs.items()}


def format_startup(times: dict[str, float]) -> list[str]:
    """The start-up measurements as report lines."""
    python, torch_s = times["python"], times["import torch"]
    return ["", "== start-up (fresh processes, empty cache folder; medians) ==",
            f"python alone {python:.2f} s; import torch {torch_s:.2f} s; import torch + multihead "
            f"{times['import multihead']:.2f} s (+{times['import multihead'] - torch_s:.2f} s); multihead --help "
            f"{times['multihead --help']:.2f} s (+{times['multihead --help'] - python:.2f} s beyond Python); "
            f"first native mh.attention {times['first mh.attention'] * 1e3:.0f} ms"]
