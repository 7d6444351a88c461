"""The cases each rank of a spawned world runs (see parallel_harness.py and test_parallel*.py).

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads, D head_dim,
P world size, r rank.

Every case compares a sharded computation with the single-process layer (or
``mh.attention``) on the same float64 numbers, and returns the largest absolute error
over the forward and every gradient, or the refusal it got. The parent asserts.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

import multihead as mh
from multihead import parallel as mp_
from multihead.parallel import ring as ring_mod

GRID = ((8, 8), (8, 2), (8, 1), (6, 3), (6, 2))
E, D, B = 16, 4, 2
F64 = torch.float64


def make_layer(h: int, hkv: int, *, causal: bool, rope: bool = True, seed: int = 0,
               dtype: torch.dtype = F64, window: int | None = None, qk_norm: str | None = None,
               rope_scaling: mh.RopeScaling | None = None) -> mh.MultiHeadAttention:
    torch.random.default_generator.manual_seed(seed)
    layer = mh.MultiHeadAttention(E, h, num_kv_heads=hkv, head_dim=D, causal=causal, window=window,
                                  rope=mh.RoPE(D, scaling=rope_scaling) if rope else None, qk_norm=qk_norm,
                                  dtype=dtype)
    with torch.no_grad():  # non-zero biases, so "added once" is tested
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return layer


def inputs(s: int, seed: int = 1, dtype: torch.dtype = F64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (B, S, E), key_mask (B, S) with padding at both ends of row 1, upstream gradient gy."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, s, E, generator=g, dtype=dtype)
    km = torch.ones(B, s, dtype=torch.bool)
    km[1, :2] = False
    km[1, -1] = False
    gy = torch.randn(B, s, E, generator=g, dtype=dtype)
    return x, km, gy


def reference(layer: mh.MultiHeadAttention, x: torch.Tensor, km: torch.Tensor | None, gy: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The single-process layer: y, dx and every parameter's gradient."""
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = layer(x, key_mask=km)
    (y * gy).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    return y.detach(), x.grad.detach(), grads


def rms_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Root-mean-square error: the systematic part, which the final rounding does not mask."""
    return float((a.detach().double() - b.detach().double()).pow(2).mean().sqrt())


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def refusal(fn: Callable[[], object]) -> dict[str, Any]:
    """Run ``fn``; report what it raised (type, message, seconds) or that it returned."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return {"raised": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - t0}
    return {"raised": None, "message": "", "seconds": time.perf_counter() - t0}


@contextmanager
def count_comm() -> Iterator[Counter]:
    """Count torch.distributed calls (and bytes each rank sends or receives point to point)."""
    names = ("all_reduce", "all_gather", "all_gather_object", "all_to_all_single", "batch_isend_irecv",
             "broadcast", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor")
    counts: Counter = Counter()
    saved = {n: getattr(dist, n) for n in names}

    def wrap(name: str, fn: Callable) -> Callable:
        def inner(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            if name == "batch_isend_irecv":
                for op in args[0]:
                    nbytes = op.tensor.numel() * op.tensor.element_size()
                    counts["p2p_bytes_sent" if op.op is dist.isend else "p2p_bytes_recv"] += nbytes
                    counts["p2p_max_tensor_bytes"] = max(counts["p2p_max_tensor_bytes"], nbytes)
            if name == "all_gather":
                counts["all_gather_bytes"] += sum(t.numel() * t.element_size() for t in args[0])
            return fn(*args, **kwargs)
        return inner

    wrapped = {n: wrap(n, f) for n, f in saved.items()}
    for n, f in wrapped.items():
        setattr(dist, n, f)
    try:
        yield counts
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


# -- head parallelism ------------------------------------------------------------------
def head_cases(rank: int, p: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    s = 2 * p + 3
    x, km, gy = inputs(s)
    for h, hkv in GRID:
        for causal in (False, True):
            layer = make_layer(h, hkv, causal=causal)
            key = f"heads/{h},{hkv}/{'causal' if causal else 'full'}"
            try:
                hp = mp_.shard_heads(layer)
            except ValueError as exc:
                res[key] = {"refused": str(exc)}
                continue
            y_ref, dx_ref, g_ref = reference(layer, x, km, gy)
            xi = x.clone().requires_grad_()
            y = hp(xi, key_mask=km)
            (y * gy).sum().backward()
            e = max(err(y, y_ref), err(xi.grad, dx_ref))
            q_rows, kv_rows = hp._rows("q"), hp._rows("kv")
            for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
                proj = getattr(hp.local, name)
                e = max(e, err(proj.weight.grad, g_ref[f"{name}.weight"][rows]),
                        err(proj.bias.grad, g_ref[f"{name}.bias"][rows]))
            e = max(e, err(hp.local.o_proj.weight.grad, g_ref["o_proj.weight"][:, q_rows]))
            o_bias = hp.o_bias if hp.o_bias is not None else hp.local.o_proj.bias
            e = max(e, err(o_bias.grad, g_ref["o_proj.bias"]))
            full = hp.full_state_dict()
            same = full.keys() == layer.state_dict().keys() and all(
                torch.equal(full[k], v) for k, v in layer.state_dict().items())
            res[key] = {"err": e, "state_dict_round_trip": same, "kv_mode": hp.kv_mode}
    return res


def tp_plan_cases(rank: int, p: int) -> dict[str, Any]:
    """torch's parallelize_module with mh.parallel.tensor_parallel_plan: exact or refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    res: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (p,))
    s = 2 * p + 3
    x, km, gy = inputs(s)
    for h, hkv in GRID:
        layer = make_layer(h, hkv, causal=True)
        y_ref, dx_ref, g_ref = reference(layer, x, km, gy)
        tp = copy.deepcopy(layer)
        key = f"tp_plan/{h},{hkv}"
        try:
            parallelize_module(tp, mesh, mp_.tensor_parallel_plan(tp))
        except Exception as exc:  # noqa: BLE001 - torch's own refusal of uneven splits counts too
            res[key] = {"refused": f"{type(exc).__name__}: {exc}", "at": "parallelize_module"}
            continue
        xi = x.clone().requires_grad_()
        try:
            y = tp(xi, key_mask=km)
        except ValueError as exc:
            res[key] = {"refused": f"ValueError: {exc}", "at": "forward"}
            continue
        y = y.full_tensor() if hasattr(y, "full_tensor") else y
        (y * gy).sum().backward()
        e = max(err(y, y_ref), err(xi.grad, dx_ref))
        for n, prm in tp.named_parameters():
            grad = prm.grad.full_tensor() if hasattr(prm.grad, "full_tensor") else prm.grad
            e = max(e, err(grad, g_ref[n]))
        res[key] = {"err": e}
    return res


# -- context parallelism ---------------------------------------------------------------
def _cp_run(layer: mh.MultiHeadAttention, method: str, layout: str, x: torch.Tensor, km: torch.Tensor,
            gy: torch.Tensor) -> float:
    y_ref, dx_ref, g_ref = reference(layer, x, km, gy)
    cp = mp_.context_parallel(layer, layout=layout, method=method)
    xl = mp_.shard_sequence(x, layout=layout, dim=1).requires_grad_()
    kml = mp_.shard_sequence(km, layout=layout, dim=1)
    yl = cp(xl, key_mask=kml)
    (yl * mp_.shard_sequence(gy, layout=layout, dim=1)).sum().backward()
    e = max(err(mp_.unshard_sequence(yl.detach(), layout=layout, dim=1), y_ref),
            err(mp_.unshard_sequence(xl.grad, layout=layout, dim=1), dx_ref))
    for n, prm in layer.named_parameters():
        grad = prm.grad.clone()
        dist.all_reduce(grad)  # each rank holds its tokens' share of the parameter gradients
        e = max(e, err(grad, g_ref[n]))
    layer.zero_grad()
    return e


def cp_cases(rank: int, p: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    s = 4 * p + 1  # divisible by neither P nor 2P (for P > 1): uneven shards
    x, km, gy = inputs(s)
    for method in ("ring", "ulysses"):
        for h, hkv in GRID:
            for causal in (False, True):
                key = f"cp/{method}/zigzag/{h},{hkv}/{'causal' if causal else 'full'}"
                layer = make_layer(h, hkv, causal=causal)
                try:
                    res[key] = {"err": _cp_run(layer, method, "zigzag", x, km, gy)}
                except ValueError as exc:
                    res[key] = {"refused": str(exc)}
        for qk_norm in ("head", "proj"):  # RMSNorm (weights perturbed) on q and k, per head or per token
            h, hkv = (6, 3) if method == "ulysses" and p == 3 else (8, 2)
            key = f"cp/{method}/zigzag/{h},{hkv}/causal/qk_{qk_norm}"
            res[key] = {"err": _cp_run(make_layer(h, hkv, causal=True, qk_norm=qk_norm), method, "zigzag", x, km, gy)}
        layouts = ("contiguous", "striped") if method == "ring" else ("contiguous",)
        for layout in layouts:
            h, hkv = (8, 2) if method == "ring" or p != 3 else (6, 3)
            for causal, window in ((True, None), (True, 3), (False, None)):
                key = f"cp/{method}/{layout}/{h},{hkv}/{'causal' if causal else 'full'}/w{window}"
                layer = make_layer(h, hkv, causal=causal, window=window)
                res[key] = {"err": _cp_run(layer, method, layout, x, km, gy)}
    return res


def functional_cases(rank: int, p: int) -> dict[str, Any]:
    """ring/ulysses_attention vs mh.attention: windows both ways, a row with no visible key."""
    res: dict[str, Any] = {}
    s = 3 * p + 2
    g = torch.Generator().manual_seed(3)
    h, hkv = (6, 3) if p == 3 else (4, 2)
    q = torch.randn(B, h, s, D, generator=g, dtype=F64)
    k, v = (torch.randn(B, hkv, s, D, generator=g, dtype=F64) for _ in range(2))
    km = torch.ones(B, s, dtype=torch.bool)
    km[1] = False  # row 1 has no key at all: zeros, never NaN
    go = torch.randn(B, h, s, D, generator=g, dtype=F64)
    for fn_name in ("ring_attention", "ulysses_attention"):
        fn = getattr(mp_, fn_name)
        for layout in ("contiguous", "zigzag", "striped"):
            for causal, window in ((False, None), (True, None), (True, 2), (False, 2)):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = mh.attention(*leaves, causal=causal, window=window, mask=km[:, None, None, :])
                ref.backward(go)
                loc = [mp_.shard_sequence(t.detach(), layout=layout, dim=2).requires_grad_() for t in (q, k, v)]
                out = fn(*loc, causal=causal, window=window, key_mask=mp_.shard_sequence(km, layout=layout, dim=1),
                         layout=layout)
                out.backward(mp_.shard_sequence(go, layout=layout, dim=2))
                e = err(mp_.unshard_sequence(out.detach(), layout=layout, dim=2), ref)
                for leaf, lo in zip(leaves, loc):
                    e = max(e, err(mp_.unshard_sequence(lo.grad, layout=layout, dim=2), leaf.grad))
                finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(t.grad).all()) for t in loc)
                empty_row = out[1].abs().max().item() if out.numel() else 0.0
                res[f"fn/{fn_name}/{layout}/{causal}/w{window}"] = {"err": e, "finite": finite,
                                                                   "empty_row_max": empty_row}
    return res


def plan_cases(rank: int, p: int) -> dict[str, Any]:
    """The score elements the ring computes on this rank equal ring_work's plan."""
    res: dict[str, Any] = {}
    s = 8 * p
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, s, D, generator=g, dtype=F64) for _ in range(3))
    original = ring_mod.block_attention
    for layout in ("contiguous", "zigzag", "striped"):
        done = [0]

        def counting(qb: torch.Tensor, kb: torch.Tensor, *a: Any, **kw: Any) -> Any:
            done[0] += qb.shape[2] * kb.shape[2]  # noqa: B023 (called only in this iteration)
            return original(qb, kb, *a, **kw)

        ring_mod.block_attention = counting
        try:
            loc = [mp_.shard_sequence(t, layout=layout, dim=2) for t in (q, k, v)]
            if p > 1:
                mp_.ring_attention(*loc, causal=True, layout=layout)
        finally:
            ring_mod.block_attention = original
        planned = mp_.ring_work(s, p, layout=layout, causal=True)[rank].computed
        res[f"plan/{layout}"] = {"computed": done[0], "planned": planned}
    return res


def count_cases(rank: int, p: int) -> dict[str, Any]:
    """Collectives per call, and bytes sent around the ring against (P-1)/P of K and V."""
    res: dict[str, Any] = {}
    s = 4 * p
    g = torch.Generator().manual_seed(5)
    h, hkv = (6, 3) if p == 3 else (8, 2)
    q = torch.randn(B, h, s, D, generator=g, dtype=F64)
    k, v = (torch.randn(B, hkv, s, D, generator=g, dtype=F64) for _ in range(2))
    for fn_name in ("ring_attention", "ulysses_attention"):
        fn = getattr(mp_, fn_name)
        loc = [mp_.shard_sequence(t, layout="zigzag", dim=2).requires_grad_() for t in (q, k, v)]
        with count_comm() as fwd:
            out = fn(*loc, causal=True, layout="zigzag")
        with count_comm() as bwd:
            out.sum().backward()
        res[f"count/{fn_name}"] = {"forward": dict(fwd), "backward": dict(bwd),
                                   "kv_bytes_full": k.nbytes + v.nbytes,
                                   "kv_bytes_local": loc[1].nbytes + loc[2].nbytes}
    layer = make_layer(8, 2, causal=True)
    hp = mp_.shard_heads(layer) if 8 % p == 0 else None
    if hp is not None:
        x, km, gy = inputs(5)
        xi = x.clone().requires_grad_()
        with count_comm() as fwd:
            y = hp(xi)
        with count_comm() as bwd:
            (y * gy).sum().backward()
        res["count/heads"] = {"forward": dict(fwd), "backward": dict(bwd), "kv_mode": hp.kv_mode}
    return res


def cache_cases(rank: int, p: int) -> dict[str, Any]:
    """Prefill + 20 decoded tokens with a sharded cache vs the single-process cached layer."""
    res: dict[str, Any] = {}
    s0, steps = 2 * p + 3, 20
    for method, (h, hkv) in (("ring", (8, 2)), ("ulysses", (8, 8) if p != 3 else (6, 3))):
        for window in (None, 4):
            layer = make_layer(h, hkv, causal=True, window=window).eval()
            g = torch.Generator().manual_seed(6)
            prompt = torch.randn(B, s0, E, generator=g, dtype=F64)
            tokens = torch.randn(steps, B, 1, E, generator=g, dtype=F64)
            with torch.no_grad():
                ref_cache = layer.new_cache(B, s0 + steps)
                ref = [layer(prompt, cache=ref_cache)] + [layer(t, cache=ref_cache) for t in tokens]
                cp = mp_.context_parallel(layer, layout="zigzag", method=method)
                cache = cp.new_cache(B, s0 + steps)
                y0 = mp_.unshard_sequence(cp(mp_.shard_sequence(prompt, dim=1), cache=cache), dim=1)
                e = err(y0, ref[0])
                for t, r in zip(tokens, ref[1:]):
                    e = max(e, err(cp(t, cache=cache), r))
            res[f"cache/{method}/w{window}"] = {"err": e, "bytes": cache.nbytes, "full_bytes": ref_cache.nbytes,
                                                "counts": list(cache.counts)}
    return res


def cache_chunk_cases(rank: int, p: int) -> dict[str, Any]:
    """Prefill, then Sn = 3 tokens in one call, then 1, then 3 more, with a sharded cache vs the
    single-process cached layer ``layer(x, cache=layer.new_cache(...))``: non-causal layers too,
    whose new queries see the chunk's later tokens (and a window both ways), as the layer's own
    ``Structure`` says. Errors per step: ``steps[0]`` the prefill.

    Also QK-norm both ways, and a RoPE whose frequencies depend on the length (dynamic, past
    M = 4 positions): every rank rotates at the whole call's length, not at its shard's."""
    res: dict[str, Any] = {}
    s0, chunks = 2 * p + 3, (3, 1, 3)
    dynamic = mh.RopeScaling(rope_type="dynamic", factor=2.0, max_positions=4)
    layers: dict[str, dict[str, Any]] = {
        "full/wNone": {"causal": False}, "causal/wNone": {"causal": True},
        "causal/w3": {"causal": True, "window": 3}, "full/w3": {"causal": False, "window": 3},
        "full/qk_head": {"causal": False, "qk_norm": "head"}, "causal/qk_proj": {"causal": True, "qk_norm": "proj"},
        "causal/dynamic_rope": {"causal": True, "rope_scaling": dynamic},
    }
    for method, (h, hkv) in (("ring", (8, 2)), ("ulysses", (8, 8) if p != 3 else (6, 3))):
        for name, kwargs in layers.items():
            layer = make_layer(h, hkv, **kwargs).eval()  # RoPE
            g = torch.Generator().manual_seed(9)
            prompt = torch.randn(B, s0, E, generator=g, dtype=F64)
            tokens = [torch.randn(B, sn, E, generator=g, dtype=F64) for sn in chunks]
            with torch.no_grad():
                ref_cache = layer.new_cache(B, s0 + sum(chunks))
                ref = [layer(prompt, cache=ref_cache)] + [layer(t, cache=ref_cache) for t in tokens]
                cp = mp_.context_parallel(layer, layout="zigzag", method=method)
                cache = cp.new_cache(B, s0 + sum(chunks))
                steps = [err(mp_.unshard_sequence(cp(mp_.shard_sequence(prompt, dim=1), cache=cache), dim=1),
                             ref[0])]
                steps += [err(cp(t, cache=cache), r) for t, r in zip(tokens, ref[1:])]
            res[f"chunk/{method}/{name}"] = {"err": max(steps), "steps": steps}
    return res


def precision_cases(rank: int, p: int) -> dict[str, Any]:
    """fp32/bf16 ring error vs float64, against mh.attention's own error in that dtype."""
    res: dict[str, Any] = {}
    s = 32 * p
    g = torch.Generator().manual_seed(7)
    q64 = torch.randn(1, 4, s, 16, generator=g, dtype=F64)
    k64, v64 = (torch.randn(1, 2, s, 16, generator=g, dtype=F64) for _ in range(2))
    go64 = torch.randn(1, 4, s, 16, generator=g, dtype=F64)
    leaves = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    ref = mh.attention(*leaves, causal=True)
    ref.backward(go64)
    for dtype in (torch.float32, torch.bfloat16):
        single = [t.to(dtype).requires_grad_() for t in (q64, k64, v64)]
        out1 = mh.attention(*single, causal=True)
        out1.backward(go64.to(dtype))
        e_single = [rms_err(out1, ref)] + [rms_err(a.grad, b.grad) for a, b in zip(single, leaves)]
        loc = [mp_.shard_sequence(t.to(dtype), dim=2).requires_grad_() for t in (q64, k64, v64)]
        out = mp_.ring_attention(*loc, causal=True)
        out.backward(mp_.shard_sequence(go64.to(dtype), dim=2))
        full_out = mp_.unshard_sequence(out.detach(), dim=2)
        e_ring = [rms_err(full_out, ref)] + [
            rms_err(mp_.unshard_sequence(a.grad, dim=2), b.grad) for a, b in zip(loc, leaves)]
        res[f"precision/{str(dtype).split('.')[-1]}"] = {"single": e_single, "ring": e_ring,
                                                          "max_single": err(out1, ref), "max_ring": err(full_out, ref)}
    return res


def refusal_cases(rank: int, p: int) -> dict[str, Any]:
    """Each refusal raises on every rank, with one message, within the timeout; the group survives."""
    res: dict[str, Any] = {}
    if p == 1:
        return res
    bad_heads = {2: (6, 3), 3: (8, 2), 4: (6, 2)}[p]
    layer = make_layer(*bad_heads, causal=True)
    with count_comm() as c:
        res["refuse/shard_heads"] = refusal(lambda: mp_.shard_heads(layer))
    res["refuse/shard_heads"]["collectives"] = sum(v for n, v in c.items() if "bytes" not in n)
    q = torch.randn(1, {2: 3, 3: 8, 4: 6}[p], 8 * p, D, dtype=F64)  # H not divisible by P
    k = torch.randn(1, q.shape[1], 8 * p, D, dtype=F64)
    ql, kl = (mp_.shard_sequence(t, dim=2) for t in (q, k))
    with count_comm() as c:
        res["refuse/ulysses_heads"] = refusal(lambda: mp_.ulysses_attention(ql, kl, kl))
    res["refuse/ulysses_heads"]["collectives"] = sum(v for n, v in c.items() if "bytes" not in n)
    tiny = torch.randn(1, 2, 1 if rank == 0 else 0, D, dtype=F64)  # S = 1 < P
    res["refuse/short"] = refusal(lambda: mp_.ring_attention(tiny, tiny, tiny))
    res["refuse/shard_short"] = refusal(lambda: mp_.shard_sequence(torch.randn(1, p - 1, E)))
    d = 8 if rank == 0 else D  # rank 0 has another head dim
    odd = torch.randn(1, 2, 3, d, dtype=F64)
    res["refuse/shapes"] = refusal(lambda: mp_.ring_attention(odd, odd, odd))
    wrong = torch.randn(1, 2, 3, D, dtype=torch.float32 if rank == p - 1 else F64)
    res["refuse/dtype"] = refusal(lambda: mp_.ring_attention(wrong, wrong, wrong))
    good = torch.randn(1, 2, 3, D, dtype=F64)
    km = torch.ones(1, 3, dtype=torch.bool if rank != 1 else torch.float32)  # rank 1: a float mask
    res["refuse/local"] = refusal(lambda: mp_.ring_attention(good, good, good, key_mask=km))
    watched = make_layer(4, 2, causal=True)
    cp = mp_.context_parallel(watched)
    xs = mp_.shard_sequence(torch.randn(1, 4 * p, E, dtype=F64))
    with mh.heads.capture(cp):  # its attention runs across ranks, outside the layer's attend step
        res["refuse/capture_context_parallel"] = refusal(lambda: cp(xs))
    alive = torch.ones(1)
    dist.all_reduce(alive)
    res["alive_after_refusals"] = float(alive)
    return res


def world1_cases(rank: int, p: int) -> dict[str, Any]:
    """With one rank every method is the plain layer, bit for bit (forward and gradients)."""
    res: dict[str, Any] = {}
    if p != 1:
        return res
    x, km, gy = inputs(7)
    for name, make in (("heads", mp_.shard_heads),
                       ("ring", lambda lay: mp_.context_parallel(lay, method="ring")),
                       ("ulysses", lambda lay: mp_.context_parallel(lay, method="ulysses"))):
        layer = make_layer(8, 2, causal=True)
        y_ref, dx_ref, g_ref = reference(layer, x, km, gy)
        mod = make(layer)
        xi = x.clone().requires_grad_()
        y = mod(xi, key_mask=km)
        (y * gy).sum().backward()
        grads = dict(mod.local.named_parameters() if name == "heads" else layer.named_parameters())
        same = torch.equal(y, y_ref) and torch.equal(xi.grad, dx_ref) and all(
            torch.equal(grads[n].grad, g) for n, g in g_ref.items())
        res[f"world1/{name}"] = same
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(B, 4, 6, D, generator=g, dtype=F64) for _ in range(3))
    res["world1/ring_attention"] = torch.equal(mp_.ring_attention(q, k, v, causal=True),
                                               mh.attention(q, k, v, causal=True))
    return res


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise OSError(field)


@contextmanager
def arrive_at_once() -> Iterator[None]:
    """Every ring shift completes before it returns: the schedule where a slow rank's next shard
    is already received when it starts a step (a rank descheduled right after posting the
    transfer). Whatever the step still holds then is counted with the shard in flight."""
    original = ring_mod.ring_shift

    def eager(*args: Any, **kwargs: Any) -> Callable[[], list[torch.Tensor]]:
        got = original(*args, **kwargs)()
        return lambda: got

    ring_mod.ring_shift = eager  # type: ignore[assignment]
    try:
        yield
    finally:
        ring_mod.ring_shift = original  # type: ignore[assignment]


def _ring_peak(rank: int, p: int) -> dict[str, Any]:
    s, h, d = 8192, 4, 64
    n = mp_.shard_sizes(s, p, "zigzag")[rank]
    with torch.no_grad():  # warm at the measured shapes: threads, their arenas and buffers exist before
        mp_.ring_attention(*(torch.randn(1, h, n, d) for _ in range(3)), causal=True)
    peaks, finite = [], True
    for _ in range(2):  # the lower of two runs: an allocator's or a thread's passing extra is not the design's
        dist.barrier()
        base = _rss("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark
        with torch.no_grad():
            q, k, v = (torch.randn(1, h, n, d) for _ in range(3))
            out = mp_.ring_attention(q, k, v, causal=True)
        peaks.append(_rss("VmHWM:") - base)
        finite = finite and bool(torch.isfinite(out).all())
        del q, k, v, out
    return {"peak": min(peaks), "kv_full": 2 * h * s * d * 4, "finite": finite}


def memory_cases(rank: int, p: int) -> dict[str, Any]:
    """Peak RSS increase of one ring forward (float32, causal zigzag, S = 8192) on this rank, as
    scheduled and with every shard arriving at once (:func:`arrive_at_once`).

    The harness fixes glibc's mmap threshold, so large tensors are mapped and unmapped and
    the high-water mark counts live tensors. The parent compares the worlds: O(S/P).
    """
    res = {"memory/ring": _ring_peak(rank, p)}
    with arrive_at_once():
        res["memory/ring_at_once"] = _ring_peak(rank, p)
    return res


def all_cases(rank: int, p: int) -> dict[str, Any]:
    """Every table, timed per table (seconds per table in ``"timing"``)."""
    out: dict[str, Any] = {"timing": {}}
    for fn in (world1_cases, refusal_cases, head_cases, tp_plan_cases, cp_cases, functional_cases, plan_cases,
               count_cases, cache_cases, cache_chunk_cases, precision_cases, memory_cases):
        t0 = time.perf_counter()
        out.update(fn(rank, p))
        out["timing"][fn.__name__] = time.perf_counter() - t0
    return out
