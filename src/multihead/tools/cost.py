"""What one forward pass of a model's attention layers costs: parameters, FLOPs, KV cache.

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads, D head_dim,
L layers, W sliding window, K = min(S, W) keys per query (K = S without a window).

Counting rules, per layer, summed over the L layers (each layer's own H, Hkv, D and window,
from ``config.layer(i)``: Gemma's sliding and full layers, OpenELM's per-layer heads):

    params        q: E·H·D (+H·D bias)   k, v: E·Hkv·D (+Hkv·D bias) each   o: H·D·E (+E bias)
    FLOPs proj    2·B·S·(E·H·D + 2·E·Hkv·D + H·D·E)        a multiply-add is 2 FLOPs
    FLOPs attn    2 matmuls (Q·Kᵀ and A·V), each 2·B·H·D per (query, key) pair:
                    4·B·H·D·P,  P = S·K            bidirectional
                                P = S·K − K²/2     causal
    KV cache      2·Hkv·D·itemsize bytes per token per layer (K and V), per sequence,
                  for K tokens: a sliding-window layer's cache is a ring of min(S, W) slots

P counts the (query, key) pairs scored. Causal without a window gives P = S²/2: half of
the S² term (the exact triangle S(S+1)/2 differs by S/2, the usual convention ignores
it). With a window every query sees K keys, except the first K queries of a causal mask,
whose triangle is again counted as half. Biases, softmax, scaling, masking and RoPE are
lower-order terms and not counted. GQA does not change the attention FLOPs (every query
head still scores every key), only the K/V projections and the cache. The cache of a
layer without a window holds all S tokens; a layer with a window W holds K = min(S, W),
which is what ``MultiHeadAttention.new_cache`` allocates (a ring buffer by default once
S > W): ``kv_cache_bytes`` is the sum of those buffers, not per-token bytes times S.

Multi-head latent attention (DeepSeek, ``config.latent``; Dq = qk_nope + qk_rope head dims,
Dv = v_head_dim, r = kv_lora_rank, rq = q_lora_rank, Dr = qk_rope_head_dim):

    params        q: E·rq + rq·H·Dq (or E·H·Dq)   kv_a: E·(r + Dr)   kv_b: r·H·(Dq - Dr + Dv)   o: H·Dv·E
                  (+ rq + r + Dr + E biases with ``bias``: q_a_proj, kv_a_proj_with_mqa, o_proj)
    FLOPs attn    2·B·H·(Dq + Dv)·P
    KV cache      (r + Dr)·itemsize bytes per token per layer (the latent and the rotary key);
                  "MHA" is the decompressed cache H·(Dq + Dv)·itemsize

Layers whose width changes by stage (Swin) have stage-dependent token counts, so their
FLOPs are not a function of one ``seq_len``: :func:`cost` refuses them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
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
    ``kv_cache_bytes_per_token`` is per sequence, what one token adds while no window is
    full. ``kv_cache_bytes`` is what the caches hold after ``seq_len`` tokens: a layer with
    a window W keeps min(seq_len, W) (``LayerCost.cache_tokens``). ``params_per_layer`` is a
    layer with ``config.num_heads`` heads (latent attention's projections for a latent
    config); ``params_total`` honours ``config.layer_num_heads``. ``mha_*`` are the same
    cache sizes if every layer had Hkv = H (for latent attention: the decompressed K and
    V), and ``gqa_saving = mha_kv_cache_bytes / kv_cache_bytes`` (4.0 for Llama-3-8B).
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
    layers: tuple[LayerCost, ...] = ()

    @property
    def flops_total(self) -> int:
        """Projections plus attention FLOPs."""
        return self.flops_projections + self.flops_attention

    @property
    def kv_cache_bytes(self) -> int:
        """K and V of all layers for ``batch`` sequences of ``seq_len`` tokens (windows as rings)."""
        if not self.layers:
            return self.kv_cache_bytes_per_token * self.batch * self.seq_len
        return self.batch * sum(lc.kv_cache_bytes_per_token * lc.cache_tokens for lc in self.layers)

    @property
    def mha_kv_cache_bytes(self) -> int:
        """The cache the same model would need with Hkv = H (the same windows)."""
        if not self.layers:
            return self.mha_kv_cache_bytes_per_token * self.batch * self.seq_len
        return self.batch * sum(lc.mha_kv_cache_bytes_per_token * lc.cache_tokens for lc in self.layers)

    @property
    def gqa_saving(self) -> float:
        """How many times smaller the cache is than with full MHA (1.0 for MHA)."""
        return self.mha_kv_cache_bytes / self.kv_cache_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: every count, the derived totals and the config's fields."""
        names = ("seq_len", "batch", "dtype", "bytes_per_element", "params_per_layer", "params_total",
                 "flops_projections", "flops_attention", "flops_total", "kv_cache_bytes_per_token",
                 "kv_cache_bytes", "mha_kv_cache_bytes_per_token", "mha_kv_cache_bytes", "gqa_saving")
        return {"config": self.config.to_dict(), **{n: getattr(self, n) for n in names},
                "layers": [asdict(lc) for lc in self.layers]}

    def format(self, per_layer: bool = False) -> str:
        """A human-readable table (returned, never printed); ``per_layer`` adds one row per layer."""
        c = self.config
        rows = [
            ("parameters per layer", f"{self.params_per_layer:,}", ""),
            ("parameters, all layers", f"{self.params_total:,}", ""),
            ("FLOPs, projections", f"{self.flops_projections:,}", _si(self.flops_projections, "FLOP")),
            ("FLOPs, attention (S² term)", f"{self.flops_attention:,}", _si(self.flops_attention, "FLOP")),
            ("FLOPs, total", f"{self.flops_total:,}", _si(self.flops_total, "FLOP")),
            ("KV cache per token", f"{self.kv_cache_bytes_per_token:,} B", _binary(self.kv_cache_bytes_per_token)),
            ("KV cache, batch × seq_len", f"{self.kv_cache_bytes:,} B", _binary(self.kv_cache_bytes)),
            (("KV cache if decompressed (MHA)" if c.latent else "KV cache if MHA (Hkv = H)"),
             f"{self.mha_kv_cache_bytes:,} B", _binary(self.mha_kv_cache_bytes)),
            ("latent cache saving" if c.latent else "GQA saving", f"{self.gqa_saving:.2f}×", ""),
        ]
        width = max(len(r[0]) for r in rows)
        value_width = max(len(r[1]) for r in rows)
        head = [self._format_header(),
                f"seq_len={self.seq_len}, batch={self.batch}, dtype={self.dtype} ({self.bytes_per_element} B)"]
        windows = sorted({lc.window for lc in self.layers if lc.window is not None and lc.window < self.seq_len})
        if windows:
            head.append(f"sliding-window layers cache min(seq_len, window) tokens: a ring of {windows} slots, "
                        "as new_cache allocates")
        head.append("")
        body = [f"{name:<{width}}  {value:>{value_width}}  {note}".rstrip() for name, value, note in rows]
        if per_layer:
            body += ["", f"{'layer':>5}  {'kind':<28} {'H':>4} {'Hkv':>4} {'D':>4} {'window':>7} {'params':>14} "
                     f"{'FLOPs attention':>18} {'KV B/token':>11}"]
            body += [f"{lc.index:>5}  {lc.kind:<28} {lc.num_heads:>4} {lc.num_kv_heads:>4} {lc.head_dim:>4} "
                     f"{lc.window if lc.window is not None else '-':>7} {lc.params:>14,} {lc.flops_attention:>18,} "
                     f"{lc.kv_cache_bytes_per_token:>11,}" for lc in self.layers]
        return "\n".join(head + body)

    def _format_header(self) -> str:
        """The config's line: kind (MLA for latent attention), sizes, mask, windows, logit scale and cap."""
        c = self.config
        heads = f"H={c.num_heads}" if c.layer_num_heads is None else f"H={list(c.layer_num_heads)}"
        if c.latent:  # no K/V heads: one latent of r numbers and a shared rotary key of Dr per token
            kind = f"MLA (latent r={c.kv_lora_rank} + rotary key Dr={c.qk_rope_head_dim} per token)"
            sizes = f"{heads}, Dq={c.head_dim}, Dv={c.v_head_dim}"
        else:
            kind, sizes = c.kind, f"{heads}, Hkv={c.num_kv_heads}, D={c.head_dim}"
        mask = "causal" if c.causal else "bidirectional"
        windowed = [lc.window for lc in self.layers if lc.window is not None]
        if windowed:
            sizes_w = sorted(set(windowed))
            shown = sizes_w[0] if len(sizes_w) == 1 else sizes_w
            mask += f", window {shown} on {len(windowed)} of {c.num_layers} layers"
        logits = f"scale {_logit_scale(c):.6g}" + ("" if c.softcap is None else f", softcap {c.softcap:g}")
        return f"{c.model_type or 'attention'}: {kind}, E={c.embed_dim}, {sizes}, L={c.num_layers}, {mask}, {logits}"


@dataclass(frozen=True)
class LayerCost:
    """One layer's share of a :class:`Cost`; ``cache_tokens`` = min(seq_len, window) or seq_len."""

    index: int
    kind: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    params: int
    flops_projections: int
    flops_attention: int
    kv_cache_bytes_per_token: int
    mha_kv_cache_bytes_per_token: int
    cache_tokens: int = 0


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

    widths = {w for i in range(config.num_layers)
              if (w := config.layer(i).embed_dim) is not None and w != config.embed_dim}
    if widths:
        raise ValueError(f"config has layers of other widths {sorted(widths)} than embed_dim={config.embed_dim} "
                         "(stages, as in Swin): their token counts differ by stage, so a cost for one seq_len "
                         "would be wrong; read config.layers instead")
    layers = tuple(_layer_cost(config, i, seq_len, batch, itemsize) for i in range(config.num_layers))
    return Cost(
        config=config, seq_len=seq_len, batch=batch, dtype=dtype_name, bytes_per_element=itemsize,
        params_per_layer=(_latent_params(config, config.num_heads) if config.latent
                          else _layer_params(config, config.num_heads, config.num_kv_heads, config.head_dim)),
        params_total=sum(lc.params for lc in layers), flops_projections=sum(lc.flops_projections for lc in layers),
        flops_attention=sum(lc.flops_attention for lc in layers),
        kv_cache_bytes_per_token=sum(lc.kv_cache_bytes_per_token for lc in layers),
        mha_kv_cache_bytes_per_token=sum(lc.mha_kv_cache_bytes_per_token for lc in layers), layers=layers,
    )


def _layer_cost(config: AttentionConfig, index: int, s: int, b: int, itemsize: int) -> LayerCost:
    lay = config.layer(index)
    h, hkv, d = lay.num_heads, lay.num_kv_heads, lay.head_dim
    k = s if lay.window is None else min(s, lay.window)
    pairs2 = 2 * s * k - (k * k if config.causal else 0)  # 2·P with P = S·K (− K²/2 when causal): an integer
    if config.latent:
        dv, dr, r = _latent_dims(config)
        params = _latent_params(config, h)
        flops_attn = b * h * (d + dv) * pairs2  # 2·B·H·(Dq + Dv)·P
        kv, mha = (r + dr) * itemsize, h * (d + dv) * itemsize
    else:
        params = _layer_params(config, h, hkv, d)
        flops_attn = 2 * b * h * d * pairs2  # 4·B·H·D·P
        kv, mha = 2 * hkv * d * itemsize, 2 * h * d * itemsize
    e = config.embed_dim
    weights = _latent_params(config, h, biases=False) if config.latent else e * h * d + 2 * e * hkv * d + h * d * e
    return LayerCost(index, lay.kind, h, hkv, d, lay.window, params, 2 * b * s * weights, flops_attn, kv, mha, k)


def _logit_scale(config: AttentionConfig) -> float:
    """The softmax scale the layer uses: latent attention multiplies Dq^-1/2 by yarn's mscale²."""
    if not config.latent or config.scale is not None:
        return config.effective_scale
    from ..latent import MultiHeadLatentAttention

    return float(MultiHeadLatentAttention.from_config(config, device="meta").scale)  # meta: no memory


def _layer_params(config: AttentionConfig, h: int, hkv: int, d: int) -> int:
    """Weights and biases of q_proj, k_proj, v_proj and o_proj for H = h, Hkv = hkv, D = d."""
    e = config.embed_dim
    weights = e * h * d + 2 * e * hkv * d + h * d * e
    biases = ((h + 2 * hkv) * d if config.bias else 0) + (e if config.effective_o_bias else 0)
    return weights + biases


def _latent_params(config: AttentionConfig, h: int, *, biases: bool = True) -> int:
    """Weights (and biases) of latent attention's projections (see the module docstring)."""
    (dv, dr, r), e, dq, rq = _latent_dims(config), config.embed_dim, config.head_dim, config.q_lora_rank
    q = e * h * dq if rq is None else e * rq + rq * h * dq
    weights = q + e * (r + dr) + r * h * (dq - dr + dv) + h * dv * e
    # attention_bias puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj (never on q_proj or kv_b_proj)
    extra = ((0 if rq is None else rq) + r + dr + e) if config.bias else 0
    return weights + (extra if biases else 0)


def _latent_dims(config: AttentionConfig) -> tuple[int, int, int]:
    """(Dv, Dr, r): ``v_head_dim``, ``qk_rope_head_dim``, ``kv_lora_rank`` of a latent config."""
    dv, dr, r = config.v_head_dim, config.qk_rope_head_dim, config.kv_lora_rank
    if dv is None or dr is None or r is None:  # AttentionConfig refuses kv_lora_rank without the others
        raise ValueError(f"config must describe latent attention, got v_head_dim={dv}, "
                         f"qk_rope_head_dim={dr}, kv_lora_rank={r}")
    return dv, dr, r


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
