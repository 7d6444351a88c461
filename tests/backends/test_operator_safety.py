"""The public operators check what they are given before the kernels touch memory: called
directly (not through ``mh.attention`` or the layer), a tensor of the wrong shape, a capacity
overrun or a table too short is refused by name (``ValueError``/``TypeError``), never read or
written out of bounds.

Every case runs in one subprocess, each reported on its own line as it ends, so that a crash
(SIGSEGV, a heap abort) fails the cases it reached instead of killing the test run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys, torch
import multihead  # noqa: F401
from multihead.backends import native  # registers torch.ops.multihead.*
torch.random.default_generator.manual_seed(0)
A, B, D = torch.ops.multihead.attention, torch.ops.multihead.attention_backward, torch.ops.multihead.decode_step
r = torch.randn

def attn(q=(1, 2, 8, 16), k=(1, 2, 8, 16), v=(1, 2, 8, 16), mask=None, dtype=torch.float32, **kw):
    return A(r(*q, dtype=dtype), r(*k, dtype=dtype), r(*v, dtype=dtype), mask, 0.25, False, None, False, **kw)

def back(dout=(1, 2, 8, 16), lse=(1, 2, 8), delta=(1, 2, 8), k=(1, 2, 8, 16)):
    q, kk, v = r(1, 2, 8, 16), r(*k), r(1, 2, 8, 16)
    return B(r(*dout), q, kk, v, r(*lse), r(*delta), None, 0.25, False, None)

E, H, HKV, HD, C = 32, 2, 2, 16, 8

def step(lengths=(3,), hkv_arg=HKV, rows=1, cache=(1, HKV, C, HD), table=16, wk=(HKV * HD, E), rotary=16,
         norm=()):
    weights = [r(H * HD, E), r(*wk), r(HKV * HD, E), r(E, H * HD)]
    cos, sin = r(table, rotary // 2), r(table, rotary // 2)
    return D(r(rows, E), weights, [None] * 4, cos, sin, rotary, False, torch.zeros(*cache), torch.zeros(*cache),
             torch.tensor(lengths, dtype=torch.int64), H, hkv_arg, HD, 0.25, *norm)

CASES = {
    "valid attention": lambda: attn(),
    "k with fewer keys than v": lambda: attn(k=(1, 2, 4, 16), v=(1, 2, 64, 16)),
    "v with far more keys than k": lambda: attn(k=(1, 2, 4, 16), v=(1, 2, 100000, 16)),
    "k of another head dim": lambda: attn(k=(1, 2, 8, 8)),
    "q heads not a multiple of k's": lambda: attn(q=(1, 3, 8, 16)),
    "k of another batch": lambda: attn(k=(2, 2, 8, 16), v=(2, 2, 8, 16)),
    "a mask that does not broadcast": lambda: attn(mask=torch.ones(1, 1, 8, 9, dtype=torch.bool)),
    "a mask of five dims": lambda: attn(mask=torch.ones(2, 1, 1, 8, 8, dtype=torch.bool)),
    "ALiBi slopes of the wrong length": lambda: attn(alibi_slopes=r(5)),
    "sinks of the wrong length": lambda: attn(sinks=r(3)),
    "cu_seqlens past the sequence": lambda: attn(cu_seqlens=torch.tensor([0, 100], dtype=torch.int32)),
    "float64 with mismatched keys": lambda: attn(k=(1, 2, 4, 16), v=(1, 2, 64, 16), dtype=torch.float64),
    "valid backward": lambda: back(),
    "backward dout of the wrong shape": lambda: back(dout=(1, 2, 8, 64)),
    "backward lse of the wrong shape": lambda: back(lse=(1, 2, 4)),
    "backward k with more keys than v": lambda: back(k=(1, 2, 64, 16)),
    "valid decoding step": lambda: step(),
    "a length at the cache's capacity": lambda: step(lengths=(C,)),
    "a length of 2**40": lambda: step(lengths=(2 ** 40,)),
    "a negative length": lambda: step(lengths=(-1,)),
    "more K/V heads than the cache holds": lambda: step(hkv_arg=H * 4, wk=(H * 4 * HD, E)),
    "a RoPE table shorter than the position": lambda: step(lengths=(6,), table=4),
    "more rows than the step takes": lambda: step(lengths=(1,) * 9, rows=9, cache=(9, HKV, C, HD)),  # MAX_STEP_ROWS 8
    "a k weight of the wrong shape": lambda: step(wk=(HKV * HD + 1, E)),
    "rows of x and of the cache differ": lambda: step(lengths=(1, 1), rows=2),
    "a rotary dim past the head dim": lambda: step(rotary=2 * HD),
    "valid decoding step with a QK-norm": lambda: step(norm=(r(HD), r(HD), 1e-6, 1)),
    "a QK-norm weight shorter than the head dim": lambda: step(norm=(r(HD), r(HD // 2), 1e-6, 1)),
    "a QK-norm with one weight missing": lambda: step(norm=(r(HD), None, 1e-6, 2)),
    "a QK-norm of an unknown mode": lambda: step(norm=(r(HD), r(HD), 1e-6, 3)),
    "a QK-norm weight of another dtype": lambda: step(norm=(r(HD), r(HD, dtype=torch.float64), 1e-6, 1)),
}
for name, call in CASES.items():
    try:
        call()
        outcome = "ran"
    except (ValueError, TypeError) as err:
        outcome = f"refused: {type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001  (anything else is a finding, reported)
        outcome = f"other: {type(err).__name__}: {err}"
    print(json.dumps([name, outcome]), flush=True)
"""

VALID = ("valid attention", "valid backward", "valid decoding step", "valid decoding step with a QK-norm")
REFUSED = ("k with fewer keys than v", "v with far more keys than k", "k of another head dim",
           "q heads not a multiple of k's", "k of another batch", "a mask that does not broadcast",
           "a mask of five dims", "ALiBi slopes of the wrong length", "sinks of the wrong length",
           "cu_seqlens past the sequence", "float64 with mismatched keys", "backward dout of the wrong shape",
           "backward lse of the wrong shape", "backward k with more keys than v",
           "a length at the cache's capacity", "a length of 2**40", "a negative length",
           "more K/V heads than the cache holds", "a RoPE table shorter than the position",
           "more rows than the step takes", "a k weight of the wrong shape", "rows of x and of the cache differ",
           "a rotary dim past the head dim", "a QK-norm weight shorter than the head dim",
           "a QK-norm with one weight missing", "a QK-norm of an unknown mode", "a QK-norm weight of another dtype")


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    seen = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    seen["(exit)"] = f"code {done.returncode}: {done.stderr[-2000:]}"
    return seen


def test_the_process_survives_every_case(outcomes: dict[str, str]) -> None:
    assert outcomes["(exit)"].startswith("code 0"), outcomes["(exit)"]


@pytest.mark.parametrize("case", VALID)
def test_a_valid_call_runs(outcomes: dict[str, str], case: str) -> None:
    assert outcomes.get(case) == "ran", outcomes.get(case, "not reached: " + outcomes["(exit)"])


@pytest.mark.parametrize("case", REFUSED)
def test_a_hostile_call_is_refused_by_name_before_memory_is_touched(outcomes: dict[str, str], case: str) -> None:
    got = outcomes.get(case, "not reached (the process died before): " + outcomes["(exit)"])
    assert got.startswith("refused: "), got
    assert " must " in got, got  # names what is expected
