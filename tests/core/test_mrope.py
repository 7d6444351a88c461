"""M-RoPE (multihead.mrope.MRoPE): each frequency slot reads the position row of its section.

Oracles: transformers' own Qwen2-VL and Qwen3-VL text rotary embeddings with their
``apply_rotary_pos_emb`` (bit for bit in float32), and the definition written out in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

import multihead as mh
from multihead.mrope import MRoPE, slot_rows

B, H, S, D = 2, 3, 7, 16


def _rows(seed: int = 0) -> torch.Tensor:
    """(3, B, S) positions whose rows differ (as an image's grid coordinates do)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.arange(S).expand(3, B, S).clone()
    rows[1:, :, 2:6] = torch.randint(0, 40, (2, B, 4), generator=g)
    return rows


@pytest.mark.parametrize(("family", "layout", "sections"), [("qwen2_vl", "chunked", [2, 3, 3]),
                                                             ("qwen3_vl", "interleaved", [4, 2, 2])])
def test_mrope_equals_transformers_rotary_embedding(family: str, layout: str, sections: list[int]) -> None:
    transformers = pytest.importorskip("transformers")
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl import modeling_qwen2_vl as modeling
        cfg, rotary_cls = transformers.Qwen2VLTextConfig, modeling.Qwen2VLRotaryEmbedding
    else:
        from transformers.models.qwen3_vl import modeling_qwen3_vl as modeling
        cfg, rotary_cls = transformers.Qwen3VLTextConfig, modeling.Qwen3VLTextRotaryEmbedding
    config = cfg(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=H, head_dim=D,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections})
    q, k = torch.randn(B, H, S, D), torch.randn(B, 1, S, D)
    rows = _rows()
    want = modeling.apply_rotary_pos_emb(q, k, *rotary_cls(config)(q, rows))
    got = MRoPE(D, 10000.0, sections=sections, layout=layout).rotate((q, k), rows)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_mrope_in_float64_is_its_definition() -> None:
    """Slot p of token (b, s) rotates by rows[r(p), b, s] · θ^(-2p/D), r(p) its section's row."""
    sections = [2, 3, 3]
    x = torch.randn(B, H, S, D, dtype=torch.float64)
    rows = _rows(1)
    got = MRoPE(D, 500.0, sections=sections).rotate((x,), rows)[0]
    row_of = [0] * 2 + [1] * 3 + [2] * 3
    want = x.clone()
    for p in range(D // 2):
        angle = rows[row_of[p]].to(torch.float64) * 500.0 ** (-2 * p / D)  # (B, S)
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]
        a, b = x[..., p], x[..., p + D // 2]
        want[..., p], want[..., p + D // 2] = a * cos - b * sin, b * cos + a * sin
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_mrope_with_equal_rows_is_plain_rope() -> None:
    """Text tokens (three equal rows) and (B, S) positions: RoPE's rotation, bit for bit."""
    x = torch.randn(B, H, S, D)
    text = torch.arange(3, 3 + S).expand(B, S)
    mrope = MRoPE(D, sections=[2, 3, 3])
    plain = mh.RoPE(D).rotate((x,), text)[0]
    assert torch.equal(mrope.rotate((x,), text.expand(3, B, S))[0], plain)
    assert torch.equal(mrope.rotate((x,), text)[0], plain)


def test_mrope_sections_matter() -> None:
    """A different section split (or the rows ignored) gives another rotation where rows differ."""
    x, rows = torch.randn(B, H, S, D), _rows(2)
    got = MRoPE(D, sections=[2, 3, 3]).rotate((x,), rows)[0]
    assert not torch.equal(MRoPE(D, sections=[3, 3, 2]).rotate((x,), rows)[0], got)
    assert not torch.equal(MRoPE(D, sections=[2, 3, 3]).rotate((x,), rows[0])[0], got)


def test_slot_rows_layouts() -> None:
    assert slot_rows([2, 3, 3], "chunked", 8).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert slot_rows([4, 2, 2], "interleaved", 8).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]


@pytest.mark.parametrize(("sections", "layout", "error", "match"), [
    ([2, 3, 2], "chunked", ValueError, r"sections must sum to rotary_dim / 2 = 8 .*\[2, 3, 2\]"),
    ([4, 4], "chunked", ValueError, "sections must be 3 ints"),
    ([2, 3, -3, 6], "chunked", ValueError, "sections must be 3 ints"),
    ("233", "chunked", TypeError, "sections must be a list of 3 ints"),
    ([2, 3, 3], "zigzag", ValueError, "layout must be one of"),
])
def test_mrope_refuses_sections_by_name(sections: object, layout: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        MRoPE(D, sections=sections, layout=layout)  # type: ignore[arg-type]


def test_mrope_refuses_positions_of_another_shape() -> None:
    rope, x = MRoPE(D, sections=[2, 3, 3]), torch.randn(B, H, S, D)
    with pytest.raises(ValueError, match=r"positions must have shape \[3, B, S\]"):
        rope.rotate((x,), torch.zeros(4, B, S, dtype=torch.long))
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        rope.rotate((x,), torch.zeros(3, B, S))


def test_mrope_in_a_layer_keeps_its_tables_float32() -> None:
    layer = mh.MultiHeadAttention(H * D, H, rope=MRoPE(D, sections=[2, 3, 3])).to(torch.bfloat16)
    assert layer.rope is not None and layer.rope.cos.dtype == torch.float32
    assert isinstance(layer.rope, MRoPE) and layer.rope.rows.dtype == torch.int64
    assert math.isclose(float(layer.rope.inv_freq[1]), 10000.0 ** (-2 / D), rel_tol=1e-6)
