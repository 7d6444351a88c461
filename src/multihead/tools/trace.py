"""Watch a layer run: the seed's section-7 table (step, tensor, shape), observed.

Shapes are shown twice: in the seed's [features, tokens] convention for one sequence
(``h × [d_head, S]`` for split heads), and as the PyTorch tensor actually seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..block_mask import BlockMask, MaskMod
from ..module import MultiHeadAttention
from ..score_mods import ScoreMod

__all__ = ["trace", "Trace", "TraceRow"]

# observed name -> (seed step, tensor label)
_STEPS: dict[str, tuple[str, str]] = {
    "X": ("input (after norm)", "X"),
    "Q": ("Q/K/V projection", "Q"),
    "K": ("Q/K/V projection", "K"),
    "V": ("Q/K/V projection", "V"),
    "Q_k": ("split heads", "Q_k"),
    "K_k": ("split heads", "K_k"),
    "V_k": ("split heads", "V_k"),
    "Q_norm": ("QK-norm (per head)", "norm(Q_k)"),
    "K_norm": ("QK-norm (per head)", "norm(K_k)"),
    "Q_rot": ("RoPE", "RoPE(Q_k)"),
    "K_rot": ("RoPE", "RoPE(K_k)"),
    "Q_rot_norm": ("QK-norm after RoPE (per head)", "norm(RoPE(Q_k))"),
    "K_rot_norm": ("QK-norm after RoPE (per head)", "norm(RoPE(K_k))"),
    "K_cache": ("KV cache", "K (cached)"),
    "V_cache": ("KV cache", "V (cached)"),
    "head_k": ("single-head attention", "head_k"),
    "concat": ("concat", "Concat"),
    "O": ("W_o", "O"),
    "residual": ("residual", "X + O"),
}


@dataclass(frozen=True)
class TraceRow:
    """One observed step."""

    step: str
    tensor: str
    shape: str  # the seed's convention, one sequence: "[768, 1024]" or "12 × [64, 1024]"
    torch_shape: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    """The observed table and the layer's output."""

    rows: tuple[TraceRow, ...]
    output: torch.Tensor = field(repr=False)

    def format(self) -> str:
        """A plain-text table: step, tensor, seed shape, torch shape."""
        header = ("step", "tensor", "shape [features, tokens]", "torch shape")
        body = [(r.step, r.tensor, r.shape, str(list(r.torch_shape))) for r in self.rows]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(4)]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        rule = "  ".join("-" * w for w in widths)
        return "\n".join([line(header), rule, *(line(r) for r in body)])

    def to_dict(self) -> list[dict[str, Any]]:
        return [{"step": r.step, "tensor": r.tensor, "shape": r.shape, "torch_shape": list(r.torch_shape)}
                for r in self.rows]


def _seed_shape(t: torch.Tensor) -> str:
    if t.dim() == 4:  # (B, H, S, D) -> H × [D, S]
        return f"{t.shape[1]} × [{t.shape[3]}, {t.shape[2]}]"
    return f"[{t.shape[-1]}, {t.shape[-2]}]"  # (B, S, E) -> [E, S]


def trace(
    layer: MultiHeadAttention,
    x: torch.Tensor,
    context: torch.Tensor | None = None,
    *,
    mask: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    bias: torch.Tensor | None = None,
    score_mod: ScoreMod | None = None,
) -> Trace:
    """Run ``layer(x, context, ...)`` without gradients and record the seed's table.

    Args:
        layer: a :class:`MultiHeadAttention`.
        x: (B, S, E).
        context, mask, key_mask, positions, mask_mod, block_mask, bias, score_mod: as in
            :meth:`MultiHeadAttention.forward` (the attend step applies them; the table's rows are the same).

    Returns:
        a :class:`Trace`; ``trace.output`` is ``layer(x)`` (B, S, E), without residual.

    Raises:
        TypeError: ``layer`` is not a MultiHeadAttention; the layer's own errors otherwise.
    """
    if not isinstance(layer, MultiHeadAttention):
        raise TypeError(f"layer must be a multihead.MultiHeadAttention, got {type(layer).__name__}")
    if not layer.batch_first:  # the table's torch shapes are (B, S, E)
        raise ValueError("trace takes a batch-first layer; this one was built batch_first=False: trace "
                         "MultiHeadAttention(..., batch_first=True) with the same weights on x.transpose(0, 1)")
    seen: list[tuple[str, torch.Tensor]] = []
    with torch.no_grad(), layer.watched(lambda n, t: seen.append((n, t))):
        y = layer(x, context, mask=mask, key_mask=key_mask, positions=positions, mask_mod=mask_mod,
                  block_mask=block_mask, bias=bias, score_mod=score_mod)
        assert isinstance(y, torch.Tensor)  # no weights asked for
        if context is None and y.shape == x.shape:
            seen.append(("residual", x + y))
    rows = tuple(TraceRow(*_STEPS[name], _seed_shape(t), tuple(t.shape)) for name, t in seen)
    return Trace(rows=rows, output=y)
