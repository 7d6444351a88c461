"""The ``multihead`` command: a thin ``main(argv)`` over library calls.

    multihead explain            the seed's section-7 example (d=768, h=12, S=1024)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

# The seed's worked example (section 7).
SEED_EMBED_DIM = 768
SEED_NUM_HEADS = 12
SEED_SEQ_LEN = 1024


def _emit(args: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    print(json.dumps(payload, indent=2) if args.json else text)


def explain_seed(seq_len: int = SEED_SEQ_LEN, seed: int = 0) -> dict[str, Any]:
    """Run the seed's example layer, trace it, and check it against the float64 reference.

    Returns:
        a dict with the trace rows, the parameter count and the reference check.
    """
    import torch

    from . import reference
    from .module import MultiHeadAttention
    from .rope import RoPE
    from .trace import trace

    d, h = SEED_EMBED_DIM, SEED_NUM_HEADS
    gen = torch.Generator().manual_seed(seed)
    layer = MultiHeadAttention(d, h, causal=True, rope=RoPE(d // h))
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
        causal=True, rope_base=layer.rope.base,
    )
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


def cmd_explain(args: argparse.Namespace) -> int:
    info = explain_seed(args.seq)
    text = "\n".join([
        f"The seed's example: d={info['embed_dim']}, h={info['num_heads']}, "
        f"d_head={info['head_dim']}, S={info['seq_len']} (causal, RoPE, random weights)",
        "",
        info["table_text"],
        "",
        f"parameters: {info['parameters']:,} ({info['parameters_formula']})",
        f"float32 layer vs float64 reference: max |diff| = {info['max_abs_error_vs_float64_reference']:.2e} "
        f"(outputs up to {info['output_scale']:.2e})",
    ])
    payload = {k: v for k, v in info.items() if k != "table_text"}
    _emit(args, payload, text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multihead", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="the seed's section-7 table, observed while running a layer")
    p.add_argument("--seq", type=int, default=SEED_SEQ_LEN, help="tokens S (default %(default)s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_explain)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``multihead`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "seq", 1) is not None and getattr(args, "seq", 1) < 1:
        parser.error(f"--seq must be a positive integer, got {args.seq}")
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
