"""multihead.parallel against the single-process layer, in spawned gloo worlds of 1–4 ranks.

Notation: B batch, S tokens, H query heads, Hkv key/value heads, P world size.

Each world size is started once (from a forkserver that has imported torch: parallel_harness.py) and runs every table of
``parallel_cases.py``; the tests below read one behaviour each from those tables.
float64 results must equal the single-process layer to 1e-10 (forward, dx and every
parameter gradient); a split that cannot be done must be refused, never run wrong.
"""

from __future__ import annotations

from typing import Any

import pytest

from multihead import parallel as mp_
from multihead.parallel.bench import ring_model_bytes
from parallel_harness import COLLECTIVE_TIMEOUT_S, run_world

ATOL = 1e-10
WORLDS = (1, 2, 3, 4)
_RESULTS: dict[int, list[dict[str, Any]]] = {}


def world(p: int) -> list[dict[str, Any]]:
    """Every rank's case table for a world of ``p`` ranks (spawned once per session)."""
    if p not in _RESULTS:
        try:
            _RESULTS[p] = run_world(p, "parallel_cases:all_cases")
        except RuntimeError as exc:  # remembered: one failed world fails its tests without respawning
            _RESULTS[p] = exc  # type: ignore[assignment]
    if isinstance(_RESULTS[p], Exception):
        raise _RESULTS[p]
    return _RESULTS[p]


def entries(p: int, prefix: str) -> dict[str, list[Any]]:
    """``key -> [rank 0's value, rank 1's, ...]`` for the keys starting with ``prefix``."""
    ranks = world(p)
    keys = [k for k in ranks[0] if k.startswith(prefix)]
    assert keys, f"no case {prefix!r} ran"
    return {k: [r[k] for r in ranks] for k in keys}


def assert_exact_or_refused(p: int, prefix: str, should_refuse) -> None:  # noqa: ANN001
    for key, per_rank in entries(p, prefix).items():
        for rank, got in enumerate(per_rank):
            if should_refuse(key):
                assert "refused" in got, f"{key} at P={p} rank {rank} should be refused, got {got}"
            else:
                assert "err" in got, f"{key} at P={p} rank {rank} was refused: {got}"
                assert got["err"] <= ATOL, f"{key} at P={p} rank {rank}: error {got['err']}"


def _heads(key: str) -> tuple[int, int]:
    h, hkv = key.split("/")[-2 if key.count("/") >= 2 else -1].split(",")[:2]
    return int(h), int(hkv)


def _grid(key: str) -> tuple[int, int]:
    part = next(s for s in key.split("/") if "," in s)
    h, hkv = part.split(",")
    return int(h), int(hkv)


@pytest.mark.parametrize("p", WORLDS)
def test_head_parallel_equals_the_layer_or_refuses(p: int) -> None:
    def refuse(key: str) -> bool:
        h, hkv = _grid(key)
        return bool(h % p or (hkv % p and p % hkv))

    assert_exact_or_refused(p, "heads/", refuse)
    for key, per_rank in entries(p, "heads/").items():
        for got in per_rank:
            if "err" in got:
                assert got["state_dict_round_trip"], f"{key}: full_state_dict() is not the layer's state dict"
                h, hkv = _grid(key)
                assert got["kv_mode"] == ("shard" if hkv % p == 0 else "replicate")


@pytest.mark.parametrize("p", WORLDS)
def test_parallelize_module_with_the_standard_plan_is_exact_or_refused(p: int) -> None:
    """torch's parallelize_module: the single-process numbers, or a ValueError; never a mis-split."""
    def refuse(key: str) -> bool:
        h, hkv = _grid(key)
        return bool(h % p or hkv % p)

    assert_exact_or_refused(p, "tp_plan/", refuse)
    for per_rank in entries(p, "tp_plan/").values():
        for got in per_rank:
            if "refused" in got:
                assert got["refused"].startswith("ValueError") and "whole heads" in got["refused"], got


@pytest.mark.parametrize("p", WORLDS)
def test_ring_context_parallel_layer_equals_the_layer(p: int) -> None:
    """Every layout, causal or not, windows, the GQA grid, RoPE, key padding, S = 4P + 1 (uneven)."""
    assert_exact_or_refused(p, "cp/ring/", lambda key: False)


@pytest.mark.parametrize("p", WORLDS)
def test_ulysses_context_parallel_layer_equals_the_layer_or_refuses(p: int) -> None:
    def refuse(key: str) -> bool:
        h, hkv = _grid(key)
        return bool(h % p or (hkv % p and p % hkv))

    assert_exact_or_refused(p, "cp/ulysses/", refuse)


@pytest.mark.parametrize("p", WORLDS)
def test_ring_and_ulysses_functions_equal_attention_with_windows_and_empty_rows(p: int) -> None:
    for key, per_rank in entries(p, "fn/").items():
        for rank, got in enumerate(per_rank):
            assert got["err"] <= ATOL, f"{key} P={p} rank {rank}: {got}"
            assert got["finite"], f"{key}: NaN/Inf in the output or gradients"
            assert got["empty_row_max"] == 0.0, f"{key}: a row with no visible key is not zeros"


def test_world_of_one_is_bit_identical_to_the_plain_layer() -> None:
    for key, per_rank in entries(1, "world1/").items():
        assert per_rank == [True], f"{key}: not bit-identical with one rank"


@pytest.mark.parametrize("p", WORLDS)
def test_the_ring_runs_the_planned_blocks(p: int) -> None:
    for key, per_rank in entries(p, "plan/").items():
        for rank, got in enumerate(per_rank):
            if p > 1:
                assert got["computed"] == got["planned"], f"{key} rank {rank}: {got}"


@pytest.mark.parametrize("p", (2, 3, 4))
def test_collectives_per_call_are_the_designs(p: int) -> None:
    for got in entries(p, "count/ring_attention")["count/ring_attention"]:
        fwd, bwd = got["forward"], got["backward"]
        # one metadata all-gather, then P-1 K/V steps; backward: P-1 K/V steps + P dK/dV steps
        assert (fwd.get("all_gather"), fwd.get("batch_isend_irecv")) == (1, p - 1), fwd
        assert bwd.get("batch_isend_irecv") == 2 * p - 1 and "all_gather" not in bwd, bwd
        assert fwd["p2p_bytes_sent"] == (p - 1) * got["kv_bytes_full"] // p, "ring must send (P-1)/P of K and V"
    for got in entries(p, "count/ulysses_attention")["count/ulysses_attention"]:
        assert got["forward"].get("all_to_all_single") == 4 and got["forward"].get("all_gather") == 1, got
        assert got["backward"] == {"all_to_all_single": 4}, got
    if 8 % p == 0:
        for got in entries(p, "count/heads")["count/heads"]:
            # one metadata all-gather (9 int64 + the refusal flag per rank: shapes agreed first), one all-reduce
            assert got["forward"] == {"all_gather": 1, "all_gather_bytes": 10 * 8 * p, "all_reduce": 1}, got
            replicas = 4 if got["kv_mode"] == "replicate" else 0  # k/v weight and bias gradients summed
            assert got["backward"] == {"all_reduce": 1 + replicas}, got


@pytest.mark.parametrize("p", (2, 3, 4))
def test_ring_never_gathers_k_and_v(p: int) -> None:
    """Would fail if K/V were all-gathered: every message is at most one shard, and the only
    all-gather carries a few integers of metadata."""
    for got in entries(p, "count/ring_attention")["count/ring_attention"]:
        for phase in ("forward", "backward"):
            counts = got[phase]
            assert counts.get("p2p_max_tensor_bytes", 0) <= got["kv_bytes_local"] // 2, counts
            assert counts.get("all_gather_bytes", 0) < got["kv_bytes_local"] // 2, counts
            assert not {"all_to_all_single", "all_gather_into_tensor", "broadcast"} & counts.keys(), counts


@pytest.mark.parametrize("p", WORLDS)
def test_sharded_cache_prefill_and_20_tokens_equal_the_cached_layer(p: int) -> None:
    for key, per_rank in entries(p, "cache/").items():
        for rank, got in enumerate(per_rank):
            assert got["err"] <= ATOL, f"{key} P={p} rank {rank}: {got}"
            total = sum(got["counts"])
            assert max(got["counts"]) - min(got["counts"]) <= 1, got["counts"]
            linear = got["full_bytes"] if key.endswith("wNone") else None
            if linear is not None:  # a rank's cache is 1/P of a single-process cache
                assert got["bytes"] == pytest.approx(linear / p, rel=(p - 1) / total + 1e-9), got


@pytest.mark.parametrize("p", WORLDS)
def test_sharded_cache_decoding_chunks_equals_the_cached_layer_causal_or_not(p: int) -> None:
    """Sn = 3 tokens in one call, then 1, then 3: each new query sees what the layer's structure
    allows, its chunk's later tokens included when the layer is not causal (a window both ways)."""
    for key, per_rank in entries(p, "chunk/").items():
        for rank, got in enumerate(per_rank):
            assert got["err"] <= ATOL, f"{key} P={p} rank {rank}: error per step (prefill first) {got['steps']}"


@pytest.mark.parametrize("p", (2, 3, 4))
def test_low_precision_ring_error_does_not_grow_with_the_world(p: int) -> None:
    """fp32/bf16 ring vs float64, against mh.attention's own error in that dtype (one process):
    root-mean-square errors of out, dq, dk, dv within 1.5× (the maxima are the final rounding's
    luck), and the largest forward error by flash-attention's criterion (2×: the ring's blocks
    run the native loop, the one-process call SDPA's, each with its own summation order)."""
    for key, per_rank in entries(p, "precision/").items():
        got = per_rank[0]
        assert got["max_ring"] <= 2 * got["max_single"], (key, got)
        for what, single, ring in zip(("out", "dq", "dk", "dv"), got["single"], got["ring"]):
            assert ring <= 1.5 * single, f"{key} {what} at P={p}: ring {ring:.3g} vs one process {single:.3g} ({got})"


@pytest.mark.parametrize("p", (2, 3, 4))
def test_refusals_raise_on_every_rank_with_one_message_and_no_hang(p: int) -> None:
    for key, per_rank in entries(p, "refuse/").items():
        messages = {got["message"] for got in per_rank}
        assert all(got["raised"] in ("ValueError", "ParallelError") for got in per_rank), (key, per_rank)
        assert len(messages) == 1, f"{key}: ranks raised different messages {messages}"
        assert all(got["seconds"] < COLLECTIVE_TIMEOUT_S / 3 for got in per_rank), (key, per_rank)
        if "collectives" in per_rank[0]:  # decided from shared sizes: before any communication
            assert all(got["collectives"] == 0 for got in per_rank), (key, per_rank)
    assert [r["alive_after_refusals"] for r in world(p)] == [float(p)] * p


@pytest.mark.parametrize("p", (2, 3, 4))
def test_zigzag_balances_causal_work_and_contiguous_does_not(p: int) -> None:
    s = 16 * 2 * p
    zig = mp_.ring_work(s, p, layout="zigzag")
    striped = mp_.ring_work(s, p, layout="striped")
    contiguous = mp_.ring_work(s, p, layout="contiguous")
    ratio = lambda works, field: max(getattr(w, field) for w in works) / min(getattr(w, field) for w in works)  # noqa: E731
    assert ratio(zig, "computed") <= 1.05 and ratio(zig, "visible") <= 1.05
    assert ratio(striped, "visible") <= 1.1
    assert ratio(contiguous, "visible") > 2.5  # about 2.9 at P = 2: rank P-1 sees every shard


def test_layouts_cover_every_position_once() -> None:
    for p in (1, 2, 3, 4):
        for s in (p, p + 1, 2 * p + 1, 17):
            for layout in mp_.LAYOUTS:
                got = sorted(int(t) for r in range(p) for t in mp_.shard_positions(s, p, r, layout))
                assert got == list(range(s)), (layout, s, p)


def test_ring_memory_per_rank_falls_as_one_over_p() -> None:
    """Peak memory of a ring forward per rank is O(S/P). In units u of a local shard of q at
    P = 2: q, k, v, the float32 accumulator and one foreign K/V shard make ~7.5u at P = 2; at
    P >= 3 a second foreign shard is in flight (overlap) and the shards halve: ~4.75u, a ratio
    of ~0.63-0.66 (measured). All-gathering K and V instead (torch's CPU fallback) holds 3u + 2P
    shards: 7u then 5.5u, a ratio of ~0.79, so this would fail."""
    peak = {p: max(r["memory/ring"]["peak"] for r in world(p)) for p in (2, 4)}
    assert all(r["memory/ring"]["finite"] for p in (2, 4) for r in world(p))
    assert peak[4] <= 0.7 * peak[2], f"per-rank peak {peak} does not fall as 1/P"
    # However the ranks are scheduled: with every shard received before its step starts, a
    # step that still held the previous shard while the next one arrives (three foreign
    # shards at P = 4, a ratio of ~0.75, as one CI run measured) would fail here.
    at_once = {p: max(r["memory/ring_at_once"]["peak"] for r in world(p)) for p in (2, 4)}
    assert at_once[4] <= 0.7 * at_once[2], f"per-rank peak, shards arriving at once: {at_once}"
    # And what the design holds (q, k, v, out + min(P-1, 2) foreign K/V shards), plus the
    # blocks' temporaries: on this 2-core AVX2 VM (blocked kernel) 1.98x and 1.89x of the design
    # at this small size (at S = 16384, H = 8 the benchmark sees 1.2-1.3x: their part is partly
    # fixed). All-gathering K/V at P = 4 would add the design's whole size again.
    design = {p: ring_model_bytes(8192, p, 4, 64) for p in (2, 4)}
    ratio = {p: round(peak[p] / design[p], 3) for p in (2, 4)}
    assert all(0.9 <= r <= 2.3 for r in ratio.values()), f"peak / design bytes per rank: {ratio}"


@pytest.mark.parametrize("feature", [{"softcap": 30.0}, {"alibi": True}, {"sinks": True}])
def test_context_parallel_refuses_the_logit_features_it_does_not_run(feature: dict[str, Any]) -> None:
    """Ring, Ulysses and the sharded cache compute plain softmax(QKᵀ)V: a layer with soft-capping,
    ALiBi or sinks is refused by name (before any group is needed), never run without them."""
    import multihead as mh

    layer = mh.MultiHeadAttention(16, 2, causal=True, **feature)
    name = next(iter(feature))
    with pytest.raises(ValueError, match=f"does not run the layer's {name}"):
        mp_.context_parallel(layer)
