"""What one forward pass of a model's attention layers costs: parameters, FLOPs, KV cache.

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads, D head_dim,
L layers, W sliding window, K = min(S, W) keys per query (K = S without a window).

Counting rules, per layer, summed over the L layers (per-layer H honoured):

    params        q: E·H·D (+H·D bias)   k, v: E·Hkv·D (+Hkv·D bias) each   o: H·D·E (+E bias)
    FLOPs proj    2·B·S·(E·H·D + 2·E·Hkv·D + H·D·E)        a multiply-add is 2 FLOPs
    FLOPs attn    2 matmuls (Q·Kᵀ and A·V), each 2·B·H·D per (query, key) pair:
                    4·B·H·D·P,  P = S·K            bidirectional
                                P = S·K − K²/2     causal
    KV cache      2·Hkv·D·itemsize bytes per token per layer (K and V), per sequence

P counts the (query, key) pairs scored. Causal without a window gives P = S²/2: half of
the S² term (the exact triangle S(S+1)/2 differs by S/2, the usual convention ignores
it). With a window every query sees K keys, except the first K queries of a causal mask,
whose triangle is again counted as half. Biases, softmax, scaling, masking and RoPE are
lower-order terms and not counted. GQA does not change the attention FLOPs (every query
head still scores every key), only the K/V projections and the cache. The cache is
counted for all S tokens; a rolling buffer for a sliding window would hold K of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._checks import check_int
from ..config import AttentionConfig

__all__ = ["Cost", "cost", "DTYPE_BYTES"]

DTYPE_BYTES: Mapping[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8": 1,
}
MAX_TOKENS = 1 << 40


@dataclass(frozen=True)
class Cost:
    """The cost of one forward pass over ``seq_len`` tokens (prefill, no cache reuse).

    FLOPs and KV-cache bytes cover all ``config.num_layers`` layers and the whole batch;
    ``kv_cache_bytes_per_token`` is per sequence. ``params_per_layer`` is a layer with
    ``config.num_heads`` heads; ``params_total`` honours ``config.layer_num_heads``.
    ``mha_*`` are the same cache sizes if every layer had Hkv = H, and
    ``gqa_saving = mha_kv_cache_bytes / kv_cache_bytes`` (4.0 for Llama-3-8B).
    """

    config: AttentionConfig
    seq_len: int
    batch: int
    dtype: str
    bytes_per_element: int
    params_per_layer: int
    params_total: int
    flops_projections: int
    flops_attention: int
    kv_cache_bytes_per_token: int
    mha_kv_cache_bytes_per_token: int

    @property
    def flops_total(self) -> int:
        """Projections plus attention FLOPs."""
        return self.flops_projections + self.flops_attention

    @property
    def kv_cache_bytes(self) -> int:
        """K and V of all layers for ``batch`` sequences of ``seq_len`` tokens."""
        return self.kv_cache_bytes_per_token * self.batch * self.seq_len

    @property
    def mha_kv_cache_bytes(self) -> int:
        """The cache the same model would need with Hkv = H."""
        return self.mha_kv_cache_bytes_per_token * self.batch * self.seq_len

    @property
    def gqa_saving(self) -> float:
        """How many times smaller the cache is than with full MHA (1.0 for MHA)."""
        return self.mha_kv_cache_bytes_per_token / self.kv_cache_bytes_per_token

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: every count, the derived totals and the config's fields."""
        names = ("seq_len", "batch", "dtype", "bytes_per_element", "params_per_layer", "params_total",
                 "flops_projections", "flops_attention", "flops_total", "kv_cache_bytes_per_token",
                 "kv_cache_bytes", "mha_kv_cache_bytes_per_token", "mha_kv_cache_bytes", "gqa_saving")
        return {"config": self.config.to_dict(), **{n: getattr(self, n) for n in names}}

    def format(self) -> str:
        """A human-readable table (returned, never printed)."""
        c = self.config
        heads = f"H={c.num_heads}" if c.layer_num_heads is None else f"H={list(c.layer_num_heads)}"
        mask = "causal" if c.causal else "bidirectional"
        if c.window is not None:
            mask += f", window {c.window}"
        rows = [
            ("parameters per layer", f"{self.params_per_layer:,}", ""),
            ("parameters, all layers", f"{self.params_total:,}", ""),
            ("FLOPs, projections", f"{self.flops_projections:,}", _si(self.flops_projections, "FLOP")),
            ("FLOPs, attention (S² term)", f"{self.flops_attention:,}", _si(self.flops_attention, "FLOP")),
            ("FLOPs, total", f"{self.flops_total:,}", _si(self.flops_total, "FLOP")),
            ("KV cache per token", f"{self.kv_cache_bytes_per_token:,} B", _binary(self.kv_cache_bytes_per_token)),
            ("KV cache, batch × seq_len", f"{self.kv_cache_bytes:,} B", _binary(self.kv_cache_bytes)),
            ("KV cache if MHA (Hkv = H)", f"{self.mha_kv_cache_bytes:,} B", _binary(self.mha_kv_cache_bytes)),
            ("GQA saving", f"{self.gqa_saving:.2f}×", ""),
        ]
        width = max(len(r[0]) for r in rows)
        value_width = max(len(r[1]) for r in rows)
        head = [
            f"{c.model_type or 'attention'}: {c.kind}, E={c.embed_dim}, {heads}, Hkv={c.num_kv_heads}, "
            f"D={c.head_dim}, L={c.num_layers}, {mask}",
            f"seq_len={self.seq_len}, batch={self.batch}, dtype={self.dtype} ({self.bytes_per_element} B)",
            "",
        ]
        body = [f"{name:<{width}}  {value:>{value_width}}  {note}".rstrip() for name, value, note in rows]
        return "\n".join(head + body)


def cost(
    config: AttentionConfig | Mapping[str, Any] | str | os.PathLike[str],
    seq_len: int,
    *,
    batch: int = 1,
    dtype: str | torch.dtype = "float32",
) -> Cost:
    """Count parameters, FLOPs and KV-cache bytes of ``config``'s attention layers.

    Args:
        config: an :class:`AttentionConfig`, or anything :meth:`AttentionConfig.from_hf`
            reads (a HF config dict, a config.json path, a model folder).
        seq_len: S, tokens per sequence.
        batch: B, sequences.
        dtype: element type of the cached K/V: ``"float32"``, ``"float16"``,
            ``"bfloat16"``, ``"float64"``, ``"int8"``, ``"fp8"`` or a ``torch.dtype``.

    Returns:
        A :class:`Cost`; the counting rules are in this module's docstring.

    Raises:
        ValueError: ``seq_len`` or ``batch`` not positive, an unknown ``dtype`` name, or an
            unreadable config.
        TypeError: arguments of the wrong type.
    """
    if not isinstance(config, AttentionConfig):
        if not isinstance(config, (Mapping, str, os.PathLike)):
            raise TypeError(f"config must be an AttentionConfig, a HF config dict or a path, "
                            f"got {type(config).__name__}")
        config = AttentionConfig.from_hf(config)
    check_int("seq_len", seq_len, maximum=MAX_TOKENS)
    check_int("batch", batch, maximum=MAX_TOKENS)
    dtype_name, itemsize = _dtype_bytes(dtype)

    e, d, s, b = config.embed_dim, config.head_dim, seq_len, batch
    k = s if config.window is None else min(s, config.window)
    params_total = flops_proj = flops_attn = kv_token = mha_token = 0
    for layer in range(config.num_layers):
        h, hkv = config.heads_in_layer(layer)
        params_total += _layer_params(config, h, hkv)
        flops_proj += 2 * b * s * (e * h * d + 2 * e * hkv * d + h * d * e)
        # 4·B·H·D·P with P = S·K (− K²/2 when causal); 2·B·H·D·K² keeps it an integer.
        flops_attn += 4 * b * h * d * s * k - (2 * b * h * d * k * k if config.causal else 0)
        kv_token += 2 * hkv * d * itemsize
        mha_token += 2 * h * d * itemsize
    return Cost(
        config=config, seq_len=seq_len, batch=batch, dtype=dtype_name, bytes_per_element=itemsize,
        params_per_layer=_layer_params(config, config.num_heads, config.num_kv_heads),
        params_total=params_total, flops_projections=flops_proj, flops_attention=flops_attn,
        kv_cache_bytes_per_token=kv_token, mha_kv_cache_bytes_per_token=mha_token,
    )


def _layer_params(config: AttentionConfig, h: int, hkv: int) -> int:
    """Weights and biases of q_proj, k_proj, v_proj and o_proj for H = h, Hkv = hkv."""
    e, d = config.embed_dim, config.head_dim
    weights = e * h * d + 2 * e * hkv * d + h * d * e
    biases = ((h + 2 * hkv) * d if config.bias else 0) + (e if config.effective_o_bias else 0)
    return weights + biases


def _dtype_bytes(dtype: object) -> tuple[str, int]:
    """(name, bytes per element) of a dtype name or a floating / 8-bit torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if not (dtype.is_floating_point or dtype in (torch.int8, torch.uint8)):
            raise ValueError(f"dtype must be a floating-point or 8-bit integer torch.dtype, got {dtype}")
        return str(dtype).removeprefix("torch."), dtype.itemsize
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str or a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)} or a torch.dtype, got {dtype!r}")
    return dtype, DTYPE_BYTES[dtype]


def _binary(n: int) -> str:
    """Bytes in binary units: 524288 -> '512.0 KiB'."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"


def _si(n: int, what: str) -> str:
    """Decimal units: 1.6e9 -> '1.61 G' + what."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= factor:
            return f"{n / factor:.2f} {prefix}{what}"
    return f"{n} {what}"
