"""mh.trace and ``multihead explain``: the seed's section-7 table, observed while running.

The seed's example: d=768, h=12, d_head=64, S=1024.
"""

from __future__ import annotations

import json

import pytest
import torch

import multihead as mh
from multihead import cli

D, HEADS, D_HEAD, SEQ = 768, 12, 64, 1024
PARAMS = 4 * D * D + 4 * D  # 2,362,368


def seed_table(d: int = D, h: int = HEADS, s: int = SEQ) -> list[tuple[str, str, str]]:
    """The seed's table, row by row (step, tensor, shape), Q/K/V and split heads one row each."""
    whole, heads = f"[{d}, {s}]", f"{h} × [{d // h}, {s}]"
    return [
        ("input (after norm)", "X", whole),
        ("Q/K/V projection", "Q", whole), ("Q/K/V projection", "K", whole), ("Q/K/V projection", "V", whole),
        ("split heads", "Q_k", heads), ("split heads", "K_k", heads), ("split heads", "V_k", heads),
        ("RoPE", "RoPE(Q_k)", heads), ("RoPE", "RoPE(K_k)", heads),
        ("single-head attention", "head_k", heads),
        ("concat", "Concat", whole),
        ("W_o", "O", whole),
        ("residual", "X + O", whole),
    ]


def test_trace_of_the_seed_example_yields_exactly_the_seed_table() -> None:
    layer = mh.MultiHeadAttention(D, HEADS, causal=True, rope=mh.RoPE(D_HEAD))
    tr = mh.trace(layer, torch.randn(1, SEQ, D))
    assert [(r.step, r.tensor, r.shape) for r in tr.rows] == seed_table()
    assert sum(p.numel() for p in layer.parameters()) == PARAMS


def test_trace_rows_carry_the_torch_shapes() -> None:
    layer = mh.MultiHeadAttention(24, 3, num_kv_heads=1, rope=mh.RoPE(8))
    tr = mh.trace(layer, torch.randn(2, 5, 24))
    shapes = {r.tensor: r.torch_shape for r in tr.rows}
    assert shapes["X"] == shapes["Q"] == shapes["Concat"] == shapes["O"] == (2, 5, 24)
    assert shapes["K"] == shapes["V"] == (2, 5, 8)
    assert shapes["Q_k"] == shapes["RoPE(Q_k)"] == shapes["head_k"] == (2, 3, 5, 8)
    assert shapes["K_k"] == (2, 1, 5, 8)


def test_trace_output_is_the_layer_output_without_gradients() -> None:
    layer = mh.MultiHeadAttention(16, 4, causal=True)
    x = torch.randn(2, 5, 16)
    tr = mh.trace(layer, x)
    with torch.no_grad():  # the same kernels as the trace (with gradients "auto" picks SDPA)
        expected = layer(x)
    torch.testing.assert_close(tr.output, expected, rtol=0, atol=0)
    assert not tr.output.requires_grad


def test_trace_without_rope_has_no_rope_rows() -> None:
    tr = mh.trace(mh.MultiHeadAttention(16, 4), torch.randn(1, 3, 16))
    assert "RoPE" not in [r.step for r in tr.rows]
    assert [r.step for r in tr.rows][-1] == "residual"


def test_trace_of_cross_attention_has_no_residual_row() -> None:
    tr = mh.trace(mh.MultiHeadAttention(16, 4), torch.randn(1, 3, 16), torch.randn(1, 6, 16))
    assert "residual" not in [r.step for r in tr.rows]
    assert {r.tensor: r.shape for r in tr.rows}["K"] == "[16, 6]"


def test_trace_format_is_a_table_with_one_line_per_row() -> None:
    tr = mh.trace(mh.MultiHeadAttention(24, 3, rope=mh.RoPE(8)), torch.randn(1, 4, 24))
    lines = tr.format().splitlines()
    assert lines[0].split()[:2] == ["step", "tensor"]
    assert len(lines) == 2 + len(tr.rows)
    assert "3 × [8, 4]" in tr.format()
    assert tr.to_dict()[0] == {"step": "input (after norm)", "tensor": "X", "shape": "[24, 4]",
                               "torch_shape": [1, 4, 24]}


# -- the CLI ----------------------------------------------------------------------------


def _explain_json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    assert cli.main(["explain", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _check_explain(info: dict, seq: int) -> None:
    assert (info["embed_dim"], info["num_heads"], info["head_dim"], info["seq_len"]) == (D, HEADS, D_HEAD, seq)
    assert [(r["step"], r["tensor"], r["shape"]) for r in info["table"]] == seed_table(s=seq)
    assert info["parameters"] == PARAMS == 2362368
    assert info["max_abs_error_vs_float64_reference"] < 1e-4


def test_explain_json_short_sequence(capsys) -> None:
    _check_explain(_explain_json(capsys, "--seq", "128"), 128)


@pytest.mark.slow
def test_explain_json_default_is_the_seed_example(capsys) -> None:
    _check_explain(_explain_json(capsys), SEQ)


def test_explain_text_prints_the_table_parameters_and_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "d=768, h=12, d_head=64, S=16" in out
    assert "12 × [64, 16]" in out
    assert "parameters: 2,362,368" in out
    assert "float32 layer vs float64 reference" in out
