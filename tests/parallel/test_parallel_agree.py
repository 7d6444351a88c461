"""Ranks agree on a call's shapes before any data moves or any cache changes (shard_heads, and
context_parallel's prefill and decoding step), in a spawned gloo world of 2 ranks.

Notation: B batch, S tokens, Sn new tokens of a decoding step, P world size.

A call that differs on one rank (another B, S or Sn, or one rank's own refusal) must make
every rank raise the same ValueError within seconds: never gloo aborting on mismatched
sizes, never the other ranks blocked until the group's timeout (here 20 s, so a hang shows
as a timeout, not as a passing test), never one rank computing alone. The caches hold what
they held: a good call afterwards equals the single-process layer.
"""

from __future__ import annotations

from typing import Any

import pytest

from parallel_harness import run_world

P, COLLECTIVE_S, WITHIN_S = 2, 20.0, 8.0
ATOL = 1e-10
_WORLD: list[dict[str, Any]] = []


def ranks() -> list[dict[str, Any]]:
    """Every rank's results (the world is spawned once)."""
    if not _WORLD:
        _WORLD.extend(run_world(P, "parallel_agree_cases:agree_cases", timeout_s=120.0,
                                collective_timeout_s=COLLECTIVE_S))
    return _WORLD


def refused_together(key: str, match: str) -> list[dict[str, Any]]:
    """Every rank raised one ValueError (ParallelError is one) with one message, within seconds."""
    per_rank = [r[key] for r in ranks()]
    assert all(got["raised"] == "ParallelError" for got in per_rank), (key, per_rank)
    assert len({got["message"] for got in per_rank}) == 1, f"{key}: different messages {per_rank}"
    assert match in per_rank[0]["message"], (key, per_rank[0]["message"])
    assert all(got["seconds"] < WITHIN_S for got in per_rank), (key, [got["seconds"] for got in per_rank])
    return per_rank


@pytest.mark.parametrize("key, match", [
    ("heads/B", "head-parallel calls differ in (B, S,"),
    ("heads/S", "head-parallel calls differ in (B, S,"),
    ("heads/local", "rank 1: ValueError"),
])
def test_head_parallel_calls_that_differ_on_one_rank_fail_every_rank(key: str, match: str) -> None:
    refused_together(key, match)


@pytest.mark.parametrize("key, match", [
    ("heads/decode_Sn", "head-parallel calls differ in (B, S,"),
    ("heads/overflow", "rank 1: ValueError: cache overflow"),
])
def test_head_parallel_cached_steps_that_differ_fail_every_rank_and_advance_no_cache(key: str, match: str) -> None:
    for got in refused_together(key, match):
        assert got["held"] == [6, 6], got  # the prompt's 6 tokens, nothing of the refused step


@pytest.mark.parametrize("key, match", [
    ("context/decode_Sn", "decoding steps have different numbers of new tokens Sn [1, 2]"),
    ("context/decode_B", "rank 1: ValueError: x must have shape [B, Sn, E] = [2, Sn, 16], got [3, 1, 16]"),
    ("context/decode_vs_prefill", "the ranks disagree on (step"),
])
def test_context_parallel_decoding_steps_that_differ_fail_every_rank_and_advance_no_cache(key: str,
                                                                                         match: str) -> None:
    for got in refused_together(key, match):
        assert got["state"][0] == 6 and sum(got["state"][1]) == 6, got  # length, counts: the prompt only


def test_context_parallel_prefill_of_another_batch_fails_every_rank() -> None:
    refused_together("context/prefill_B", "rank 1: ValueError: cache holds batch 2; the prompt has batch 3")


@pytest.mark.parametrize("table", ["heads", "context"])
def test_after_the_refusals_the_caches_continue_as_the_single_process_layer(table: str) -> None:
    for got in ranks():
        assert got[f"{table}/after"]["err"] <= ATOL, got[f"{table}/after"]
    assert [r["alive"] for r in ranks()] == [float(P)] * P
