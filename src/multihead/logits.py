"""What happens to the logits between ``q kᵀ · scale`` and the softmax: soft-capping, ALiBi, an
additive bias, a score_mod, sinks.

Notation: B batch, H query heads, Sq queries, Sk keys.

In order, for row i (query) and column j (key) of head h::

    s = scale · q_i · k_j
    s = cap · tanh(s / cap)                      soft-capping (Gemma 2, flash-attn ``softcap``)
    s = s - slope_h · |i + Sk - Sq - j|          ALiBi (BLOOM, MPT; flash-attn ``alibi_slopes``)
    s = s + bias[b, h, i, j]                     an additive bias (``bias=``; T5's position_bias)
    s = score_mod(s, b, h, i + Sk - Sq, j)       a score_mod (:mod:`multihead.score_mods`)
    s = -inf where the mask forbids j            masking (causal, window, mask, packed sequences,
                                                 a block mask or mask_mod: :mod:`multihead.block_mask`)
    p = softmax over the row's keys and, with sinks, one more logit ``sink_h``
        whose probability is dropped (gpt-oss: the sink takes mass from the keys)

ALiBi's distance uses flash-attn's alignment (query i sits at ``i + Sk - Sq``, as for
causal masks); under a causal mask ``|·|`` is ``i + Sk - Sq - j``, and BLOOM's bias
``slope · j`` differs from it by a per-row constant, which the softmax ignores. A row
with no visible key gives zeros, sinks or not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ._checks import check_int
from .block_mask import BlockMask

__all__ = ["Features", "NO_FEATURES", "relative_dense", "alibi_slopes", "alibi_bias", "soft_cap", "sink_column"]


class Features(NamedTuple):
    """What a call adds to masked ``softmax(scale · QKᵀ)V``, as one value: the logit features
    above and packed sequences. It travels whole from the layer (``layer.features``) and
    :func:`multihead.attention` through the registry's capability check to a backend, as the
    C++ kernels' ``Problem`` holds them; None = off.

    Attributes:
        softcap: ``cap`` of soft-capping, > 0.
        alibi_slopes: (H,) float ALiBi slopes.
        sinks: (H,) float sink logits.
        cu_seqlens: (N+1,) or (B, N+1) cumulative lengths of packed sequences (Sq == Sk).
        block_mask: a :class:`multihead.block_mask.BlockMask` for (B|1, H|1, Sq, Sk), given only
            to a backend declaring ``block_mask`` (the others receive it as a dense ``mask``).
        bias: float broadcastable to (B, H, Sq, Sk) (a 4-D view), added to the logits.
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score`` (:mod:`multihead.score_mods`).
        relative: float (B|1, H|1, Sq + Sk - 1), a bias that depends on the distance alone, added
            to the logits with ``bias``: ``relative[b, h, j - i + Sq - 1]`` for query row i and key
            j (:func:`relative_dense`; T5's position bias, one value per head and distance).
        head_scale: (H,) float multipliers of each head's logits before anything else (a lowered
            :func:`multihead.score_mods.head_scale`): :func:`multihead.attention` multiplies each
            head's queries by its own, so that no backend sees it.
    """

    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    block_mask: BlockMask | None = None
    bias: torch.Tensor | None = None
    score_mod: Callable[..., torch.Tensor] | None = None
    relative: torch.Tensor | None = None
    head_scale: torch.Tensor | None = None

    def logits(self) -> dict[str, object]:
        """The logit features asked for, by keyword (``softcap``, ``alibi_slopes``, ``sinks``, ``bias``
        (with ``relative``), ``score_mod``)."""
        bias = self.bias if self.bias is not None else self.relative
        return {name: value for name, value in (("softcap", self.softcap), ("alibi_slopes", self.alibi_slopes),
                                                ("sinks", self.sinks), ("bias", bias),
                                                ("score_mod", self.score_mod)) if value is not None}

    def learned(self) -> list[torch.Tensor]:
        """The features that are tensors a gradient may flow into (ALiBi slopes, sinks, the biases; a
        score_mod's captured tensors are not seen: it runs on a differentiable backend only)."""
        return [t for t in (self.alibi_slopes, self.sinks, self.bias, self.relative, self.head_scale) if t is not None]

    def has_bias(self) -> bool:
        """Whether an additive bias is asked for (``bias`` or ``relative``)."""
        return self.bias is not None or self.relative is not None

    def dense_bias(self, sq: int, sk: int) -> torch.Tensor | None:
        """``bias`` and ``relative`` as one bias broadcastable to (B, H, Sq, Sk) (None without either):
        what a backend that adds a dense bias adds."""
        if self.relative is None:
            return self.bias
        dense = relative_dense(self.relative, sq, sk)
        return dense if self.bias is None else self.bias + dense

    def any(self) -> bool:
        """Whether anything is asked beyond masked softmax attention."""
        return any(value is not None for value in self)


#: No logit feature, no packing.
NO_FEATURES = Features()


def relative_dense(relative: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """The bias (B|1, H|1, Sq, Sk) that ``relative`` (B|1, H|1, Sq + Sk - 1) stands for:
    ``[b, h, i, j] = relative[b, h, j - i + Sq - 1]`` (a Toeplitz matrix per head), differentiable."""
    r = relative.contiguous()
    shifted = r.as_strided((r.shape[0], r.shape[1], sq, sk), (r.stride(0), r.stride(1), 1, 1))  # [i', j] = r[i' + j]
    return shifted.flip(2)  # [i, j] = r[Sq - 1 - i + j]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """(H,) float32: the standard ALiBi slopes (Press et al.; BLOOM's ``build_alibi_tensor``).

    For H a power of two, ``2^(-8(h+1)/H)``; otherwise the slopes of the closest smaller
    power of two P, then every other slope of 2P for the remaining H - P heads.
    """
    check_int("num_heads", num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        extra = min(closest, num_heads - closest)
        powers = torch.arange(1, 1 + 2 * extra, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, powers)], dim=0)
    return slopes


def alibi_bias(slopes: torch.Tensor, sq: int, sk: int, dtype: torch.dtype) -> torch.Tensor:
    """(H, Sq, Sk) ``-slope_h · |i + Sk - Sq - j|`` in ``dtype``, on the slopes' device."""
    rows = torch.arange(sq, device=slopes.device, dtype=dtype)[:, None] + (sk - sq)  # (Sq, 1)
    distance = (rows - torch.arange(sk, device=slopes.device, dtype=dtype)[None, :]).abs()  # (Sq, Sk)
    return -slopes.to(dtype)[:, None, None] * distance  # (H, Sq, Sk)


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap · tanh(scores / cap)``: logits bounded in (-cap, cap), nearly unchanged when small."""
    return torch.tanh(scores / cap) * cap


def sink_column(sinks: torch.Tensor, batch: int, sq: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, Sq, 1): the sink logit of each head, one column to join every row's softmax."""
    return sinks.to(dtype)[None, :, None, None].expand(batch, -1, sq, 1)
