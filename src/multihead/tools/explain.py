"""``multihead explain``: the seed's section-7 table, for the seed's example or a config.

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads, D head_dim.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..module import MultiHeadAttention
from .seed import MAX_SEQ_LEN, SEED_EMBED_DIM, SEED_MAX_SEQ_LEN, SEED_NUM_HEADS, SEED_SEQ_LEN, max_seq_len
from .trace import trace

__all__ = ["explain_seed", "explain_config", "max_seq_len", "SEED_EMBED_DIM", "SEED_NUM_HEADS", "SEED_SEQ_LEN",
           "SEED_MAX_SEQ_LEN", "MAX_SEQ_LEN"]


def explain_seed(seq_len: int = SEED_SEQ_LEN, seed: int = 0) -> dict[str, Any]:
    """Run the seed's example layer, trace it, and check it against the float64 reference.

    Args:
        seq_len: S, 1 to :data:`SEED_MAX_SEQ_LEN`.
        seed: of the random weights and input.

    Returns:
        a dict with the trace rows, the parameter count and the reference check.

    Raises:
        TypeError, ValueError: ``seq_len`` not an int in range (before any work).
    """
    from .. import reference
    from .._checks import check_int

    check_int("seq_len", seq_len, maximum=max_seq_len(None))
    from ..rope import RoPE

    d, h = SEED_EMBED_DIM, SEED_NUM_HEADS
    gen = torch.Generator().manual_seed(seed)
    rope = RoPE(d // h)
    layer = MultiHeadAttention(d, h, causal=True, rope=rope)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    x = torch.randn(1, seq_len, d, generator=gen)
    tr = trace(layer, x)
    w = {n: getattr(layer, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    b = {n: getattr(layer, n).bias for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    ref = reference.multi_head_attention(
        x[0].T, w["q_proj"], w["k_proj"], w["v_proj"], w["o_proj"], h,
        b_q=b["q_proj"], b_k=b["k_proj"], b_v=b["v_proj"], b_o=b["o_proj"],
        causal=True, rope_base=rope.base,
    )
    assert isinstance(ref, np.ndarray)  # O alone: return_steps is False
    err = float(abs(tr.output[0].T.double().numpy() - ref).max())
    params = sum(p.numel() for p in layer.parameters())
    return {
        "embed_dim": d, "num_heads": h, "head_dim": d // h, "seq_len": seq_len,
        "causal": True, "rope": True,
        "table": tr.to_dict(),
        "table_text": tr.format(),
        "parameters": params,
        "parameters_formula": f"4·d² + 4·d = {4 * d * d + 4 * d}",
        "max_abs_error_vs_float64_reference": err,
        "output_scale": float(abs(ref).max()),
    }


def explain_config(config: Any, seq_len: int = 1024, *, batch: int = 1) -> dict[str, Any]:
    """The section-7 table of a config's layer 0, traced on meta tensors (no weights, no memory).

    Args:
        config: an :class:`~multihead.AttentionConfig` or what ``AttentionConfig.from_hf``
            reads (a config.json path, a checkpoint folder, a dict).
        seq_len: S, 1 to :data:`MAX_SEQ_LEN`.
        batch: B.

    Returns:
        a JSON-ready dict: ``config`` (its fields), ``kind`` (MHA/GQA/MQA), ``embed_dim``,
        ``num_heads``, ``num_kv_heads``, ``head_dim``, ``seq_len``, ``parameters_per_layer``,
        ``table`` and ``table_text``.

    Raises:
        ValueError, TypeError: an unreadable config or bad sizes, named.
    """
    from .._checks import check_int
    from ..config import AttentionConfig

    check_int("seq_len", seq_len, maximum=max_seq_len(config))  # before the config is read
    check_int("batch", batch)
    if not isinstance(config, AttentionConfig):
        config = AttentionConfig.from_hf(config)
    # Meta tensors have shapes and no data: nothing is allocated or computed.
    dtype = torch.float32
    layer = MultiHeadAttention.from_config(config, device="meta", dtype=dtype)
    x = torch.empty(batch, seq_len, config.embed_dim, device="meta", dtype=dtype)  # (B, S, E)
    tr = trace(layer, x)
    return {
        "config": config.to_dict(), "kind": config.kind,
        "embed_dim": config.embed_dim, "num_heads": layer.num_heads, "num_kv_heads": layer.num_kv_heads,
        "head_dim": config.head_dim, "seq_len": seq_len, "batch": batch,
        "parameters_per_layer": sum(p.numel() for p in layer.parameters()),
        "table": tr.to_dict(), "table_text": tr.format(),
        "layer_kinds": layer_kinds(config),
    }


def layer_kinds(config: Any) -> list[dict[str, Any]]:
    """Each distinct kind of attention layer in ``config`` and the layers that have it (JSON-ready)."""
    out = []
    for lay, indices in config.layer_kinds().items():
        scaling = lay.rope_scaling
        out.append({"kind": lay.kind, "layers": indices, "num_heads": lay.num_heads, "num_kv_heads": lay.num_kv_heads,
                    "head_dim": lay.head_dim, "embed_dim": lay.embed_dim or config.embed_dim, "window": lay.window,
                    "rope_base": lay.rope_base, "rope_type": None if scaling is None else scaling.rope_type,
                    "scale": config.effective_scale, "softcap": config.softcap})
    return out


def format_layer_kinds(kinds: list[dict[str, Any]]) -> str:
    """One line per distinct layer kind: which layers, heads, head_dim, window, RoPE, logit scale and softcap."""
    lines = []
    for k in kinds:
        idx = k["layers"]
        where = f"layers {idx[0]}..{idx[-1]}" if idx == list(range(idx[0], idx[-1] + 1)) else f"layers {idx}"
        rope = "no RoPE" if k["rope_base"] is None else f"RoPE θ={k['rope_base']:g}" + (
            f" ({k['rope_type']})" if k["rope_type"] else "")
        window = "full" if k["window"] is None else f"window {k['window']}"
        # Gemma 2's query_pre_attn_scalar and attn_logit_softcapping change every logit: show them.
        logits = f"scale {k['scale']:.6g}" + ("" if k["softcap"] is None else f", softcap {k['softcap']:g}")
        lines.append(f"{len(idx):>3} × {k['kind']}: E={k['embed_dim']}, h={k['num_heads']}, h_kv={k['num_kv_heads']}, "
                     f"d_head={k['head_dim']}, {window}, {rope}, {logits} — {where}")
    return "\n".join(lines)
