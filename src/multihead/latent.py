"""Multi-head latent attention (MLA, DeepSeek-V2/V3): a cache of one latent vector per token.

Notation: B batch, S new tokens, C cached tokens, E embed_dim, H heads, r kv_lora_rank,
rq q_lora_rank, dn qk_nope_head_dim, dr qk_rope_head_dim, dv v_head_dim, Dq = dn + dr.

The step after GQA: instead of Hkv heads of K and V, each token is compressed to a latent
``c`` of r numbers (plus one rotary key of dr shared by all heads); the heads' keys and
values are up-projections of it::

    x (B, S, E) --q_proj (or q_a_proj, RMSNorm, q_b_proj)--> q (B, H, S, Dq) = [q_nope dn | q_rot dr]
    x --kv_a_proj_with_mqa--> [c r | k_rot dr];  c = RMSNorm(c)        (B, S, r), (B, 1, S, dr)
    RoPE on q_rot and k_rot only (the "decoupled" rotary key)
    kv_b_proj: c -> per head [k_nope dn | v dv]    W_uk (H, dn, r), W_uv (H, dv, r)
    score_h(i, j) = scale · (q_nope_h,i · W_uk_h c_j + q_rot_h,i · k_rot_j)
    out_h,i = Σ_j p_h(i, j) · W_uv_h c_j ;  o_proj over the H·dv outputs

Without a cache the keys and values are decompressed (as transformers computes them). With
a :class:`LatentCache` the cache holds only ``[c | k_rot]`` (r + dr numbers per token and
layer: 576 for DeepSeek-V3, against 2·128·128 for its 128 heads of 128 as plain MHA), and
the up-projections are *absorbed*: ``q_lat = q_nope · W_uk`` makes each head's score
``scale · [q_lat | q_rot] · [c | k_rot]``, an MQA attention (one K/V head) over the cache
with values ``c``, whose output is mapped by ``W_uv`` afterwards. Nothing in the cache is
ever decompressed.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ._checks import check_int, check_tensor
from .functional import attention
from .masks import key_padding_mask
from .qk_norm import RMSNorm
from .rope import RoPE
from .rope_scaling import RopeScaling

__all__ = ["MultiHeadLatentAttention", "LatentCache"]


class LatentCache:
    """Preallocated cache of ``[latent | rotary key]`` per token: (B, C, r + dr), one length for all rows.

    Args:
        batch_size: B.
        max_len: C, the most tokens it will hold.
        kv_lora_rank: r; rope_dim: dr.
        dtype, device: of the buffer.
    """

    def __init__(self, batch_size: int, max_len: int, kv_lora_rank: int, rope_dim: int, *,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        check_int("batch_size", batch_size)
        check_int("max_len", max_len, maximum=1 << 24)
        self.kv_lora_rank = check_int("kv_lora_rank", kv_lora_rank)
        self.rope_dim = check_int("rope_dim", rope_dim)
        self.data = torch.zeros(batch_size, max_len, kv_lora_rank + rope_dim, dtype=dtype, device=device)
        self.length = 0  # tokens held (the only writer is commit)

    @property
    def numbers_per_token(self) -> int:
        """r + dr: what one token costs in this layer's cache."""
        return self.data.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def reset(self) -> None:
        self.length = 0

    def __repr__(self) -> str:
        b, c, n = self.data.shape
        return f"LatentCache(batch_size={b}, max_len={c}, numbers_per_token={n}, length={self.length})"

    def stage(self, entries: torch.Tensor) -> torch.Tensor:
        """Write ``entries`` (B, S, r + dr) after the held tokens; return all (B, length + S, r + dr).

        The written slots stay invisible until :meth:`commit`: a failed call leaves the cache as it was.
        """
        b, s, n = entries.shape
        if (b, n) != (self.data.shape[0], self.data.shape[2]) or entries.dtype != self.data.dtype:
            raise ValueError(f"entries must have shape [B, S, r+dr] = [{self.data.shape[0]}, S, {self.data.shape[2]}] "
                             f"and dtype {self.data.dtype}, got {list(entries.shape)} {entries.dtype}")
        if self.length + s > self.data.shape[1]:
            raise ValueError(f"the cache holds {self.length} of {self.data.shape[1]} tokens: {s} more do not fit")
        self.data[:, self.length:self.length + s] = entries
        return self.data[:, : self.length + s]

    def commit(self, new_tokens: int) -> None:
        self.length += new_tokens


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention, with its config's argument names.

    Args:
        embed_dim: E (``hidden_size``).
        num_heads: H.
        kv_lora_rank: r, the latent's width (what the cache stores, with the rotary key).
        qk_nope_head_dim: dn, the non-rotary part of each head's query and key.
        qk_rope_head_dim: dr, the rotary part (one rotary key shared by all heads).
        v_head_dim: dv.
        q_lora_rank: rq, compress the query through rq numbers too; None = a plain q_proj.
        bias: biases on q_a_proj / kv_a_proj_with_mqa / o_proj (``attention_bias``).
        rope_base: θ; rope_scaling: a RopeScaling (DeepSeek-V3: yarn).
        rope_interleaved: the rotary dims pair as (2p, 2p+1) (DeepSeek's ``rope_interleave``).
        scale: logit scale; default ``Dq^-0.5``, times yarn's ``mscale(factor, mscale_all_dim)²``
            as transformers' DeepSeek does.
        norm_eps: the RMSNorms' epsilon.
        max_positions: RoPE table size.
        dropout: attention-probability dropout in training (transformers' ``attention_dropout``).
        backend: attention backend for :func:`multihead.attention`.
        device, dtype: of the parameters.

    Raises:
        ValueError, TypeError: bad sizes, named.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None, bias: bool = False,
                 rope_base: float = 10000.0, rope_scaling: RopeScaling | None = None, rope_interleaved: bool = True,
                 scale: float | None = None, norm_eps: float = 1e-6, max_positions: int = 4096,
                 dropout: float = 0.0, backend: str | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                            ("qk_nope_head_dim", qk_nope_head_dim), ("qk_rope_head_dim", qk_rope_head_dim),
                            ("v_head_dim", v_head_dim)):
            check_int(name, value)
        if q_lora_rank is not None:
            check_int("q_lora_rank", q_lora_rank)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
        self.embed_dim, self.num_heads, self.kv_lora_rank = embed_dim, num_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.q_lora_rank, self.backend, self.dropout = q_lora_rank, backend, float(dropout)
        self.causal = True  # DeepSeek's latent attention is always causal
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        f = {"device": device, "dtype": dtype}
        q_out = num_heads * self.qk_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(embed_dim, q_out, bias=False, **f)
        else:
            self.q_a_proj = nn.Linear(embed_dim, q_lora_rank, bias=bias, **f)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=norm_eps, device=device, dtype=dtype)
            self.q_b_proj = nn.Linear(q_lora_rank, q_out, bias=False, **f)
        self.kv_a_proj_with_mqa = nn.Linear(embed_dim, kv_lora_rank + qk_rope_head_dim, bias=bias, **f)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=norm_eps, device=device, dtype=dtype)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False, **f)
        self.o_proj = nn.Linear(num_heads * v_head_dim, embed_dim, bias=bias, **f)
        self.rope = RoPE(qk_rope_head_dim, rope_base, interleaved=rope_interleaved, max_positions=max_positions,
                         scaling=rope_scaling)
        self.scale = self.qk_head_dim ** -0.5 * _yarn_mscale_squared(rope_scaling) if scale is None else scale

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> MultiHeadLatentAttention:
        """A layer of the shape an :class:`~multihead.AttentionConfig` with ``kv_lora_rank`` describes."""
        if not getattr(config, "latent", False):
            raise ValueError("config must describe latent attention (kv_lora_rank set)")
        return cls(config.embed_dim, config.num_heads, kv_lora_rank=config.kv_lora_rank,
                   qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                   v_head_dim=config.v_head_dim, q_lora_rank=config.q_lora_rank, bias=config.bias,
                   rope_base=config.rope_base, rope_scaling=config.rope_scaling,
                   rope_interleaved=config.rope_interleaved, **kwargs)

    @classmethod
    def from_hf(cls, module: nn.Module, **kwargs: Any) -> MultiHeadLatentAttention:
        """Convert transformers' ``DeepseekV3Attention`` / ``DeepseekV2Attention`` (weights copied).

        Exact or refused: the class must be described in
        :data:`multihead.interop.hf_registry.REGISTRY` and the description must cover the
        module (submodules, attributes, config). Sizes, bias, RoPE (base, scaling, pairing:
        V2 always interleaved, V3 as ``config.rope_interleave``) come from the config
        through :meth:`AttentionConfig.from_hf`; the logit scale is the module's
        ``scaling`` (yarn's ``mscale(factor, mscale_all_dim)²`` included), the dropout its
        ``attention_dropout``, the norms' epsilon their ``variance_epsilon``.

        Args:
            module: the HF attention module.
            **kwargs: ``backend``.

        Raises:
            ValueError: a class or configuration the registry refuses, norms of different
                epsilons, or weights that do not load, naming the reason.
        """
        from .config import AttentionConfig
        from .interop import hf_registry

        spec = hf_registry.require_spec(module)
        if spec.layout != "latent":
            raise ValueError(f"{spec.name} is not latent attention: convert it with "
                             "multihead.MultiHeadAttention.from_hf")
        hf: Any = module  # transformers' module: its attributes are not typed here
        config = AttentionConfig.from_hf(hf.config.to_dict())
        eps = {float(hf.kv_a_layernorm.variance_epsilon)}
        if hf.q_lora_rank is not None:
            eps.add(float(hf.q_a_layernorm.variance_epsilon))
        if len(eps) != 1:
            raise ValueError(f"{spec.name}: q_a_layernorm and kv_a_layernorm have different epsilons {sorted(eps)}")
        layer = cls.from_config(config, norm_eps=eps.pop(), scale=float(hf.scaling),
                                dropout=float(hf.attention_dropout or 0.0), device=hf.o_proj.weight.device,
                                dtype=hf.o_proj.weight.dtype, **kwargs)
        missing, unexpected = layer.load_state_dict(module.state_dict(), strict=False)
        if unexpected or missing:
            raise ValueError(f"{spec.name}: weights do not match (missing {missing}, unexpected {unexpected})")
        return layer.train(module.training)

    def new_cache(self, batch_size: int, max_len: int) -> LatentCache:
        """A :class:`LatentCache` of ``r + dr`` numbers per token, in the layer's dtype and device."""
        w = self.o_proj.weight
        return LatentCache(batch_size, max_len, self.kv_lora_rank, self.qk_rope_head_dim, dtype=w.dtype,
                           device=w.device)

    def forward(self, x: torch.Tensor, *, key_mask: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, cache: LatentCache | None = None) -> torch.Tensor:
        """Causal latent attention of ``x`` (B, S, E) -> (B, S, E).

        Args:
            key_mask: (B, S) bool, True = real token (no cache).
            mask: (B|1, 1|H, S, S) bool, True = may attend (no cache); combined with
                causality and ``key_mask`` by logical and. A fully masked row gives zeros.
            positions: (S,) or (B, S) RoPE positions; default 0..S-1, or the cache's length onwards.
            cache: a :class:`LatentCache`: the new tokens' latents are appended and the heads
                attend through the absorbed up-projections (no decompression).

        Raises:
            ValueError: ``x`` of the wrong width or dtype, a mask with a cache, or a cache
                too small (left unchanged).
        """
        check_tensor("x", x, ndim=3)
        if x.shape[-1] != self.embed_dim or x.dtype != self.o_proj.weight.dtype:
            raise ValueError(f"x must be [B, S, {self.embed_dim}] of dtype {self.o_proj.weight.dtype}, "
                             f"got {list(x.shape)} {x.dtype}")
        if cache is not None and (key_mask is not None or mask is not None):
            raise ValueError("key_mask or mask with a LatentCache is not supported: every row holds the same tokens")
        s = x.shape[1]
        start = 0 if cache is None else cache.length
        if positions is None:
            positions = torch.arange(start, start + s, device=x.device)
        q_nope, q_rot, entries = self.project(x, positions)
        if cache is None:
            if key_mask is not None:
                padding = key_padding_mask(key_mask)  # (B, 1, 1, S)
                mask = padding if mask is None else mask & padding
            return self.output(self.attend_decompressed(q_nope, q_rot, entries, mask))
        out = self.attend_absorbed(q_nope, q_rot, cache.stage(entries), None)
        cache.commit(s)
        return self.output(out)

    # ---- the steps, public for wrappers that keep the cache elsewhere (transformers' Cache) ----
    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_nope (B, H, S, dn), rotated q_rot (B, H, S, dr), cache entries ``[c | k_rot]`` (B, S, r + dr).

        ``c`` is the normalised latent, ``k_rot`` the rotated shared rotary key, in this
        layer's RoPE pairing (what a cache of this layer holds).
        """
        b, s, _ = x.shape
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, s, self.num_heads, self.qk_head_dim).transpose(1, 2)  # (B, H, S, Dq)
        q_nope, q_rot = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # (B, S, r)
        q_rot, k_rot = self.rope.rotate((q_rot.contiguous(), k_rot[:, None].contiguous()), positions)
        return q_nope, q_rot, torch.cat((latent, k_rot[:, 0]), dim=-1)  # ..., (B, S, r + dr)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' outputs (B, H, S, dv) concatenated and through o_proj: (B, S, E)."""
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.v_head_dim))  # (B, S, E)

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk (H, dn, r) and W_uv (H, dv, r): kv_b_proj's rows by head."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def attend_decompressed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, held: torch.Tensor,
                            mask: torch.Tensor | None) -> torch.Tensor:
        """Every head's keys and values computed from the entries (transformers' way): (B, H, S, dv).

        Args:
            q_nope, q_rot: from :meth:`project`.
            held: (B, Sk, r + dr) entries of every key (the S new ones last).
            mask: (B|1, 1|H, S, Sk) bool or None; causality (bottom-right) is always applied.
        """
        b, sk, _ = held.shape
        latent, k_rot = held[:, None].split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)  # (B, 1, Sk, .)
        kv = self.kv_b_proj(latent[:, 0]).view(b, sk, self.num_heads, -1).transpose(1, 2)  # (B, H, Sk, dn + dv)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)  # (B, H, Sk, Dq)
        q = torch.cat((q_nope, q_rot), dim=-1)  # (B, H, S, Dq)
        return attention(q, k, v, causal=True, mask=mask, scale=self.scale, backend=self.backend,
                         dropout_p=self.dropout if self.training else 0.0)

    def attend_absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, held: torch.Tensor,
                        mask: torch.Tensor | None) -> torch.Tensor:
        """MQA over the entries ``[c | k_rot]`` with ``q_lat = q_nope·W_uk``; W_uv after the weighted sum.

        Args and result as :meth:`attend_decompressed`; no key or value is decompressed.
        """
        w_uk, w_uv = self._up()
        q_lat = torch.einsum("bhsd,hdr->bhsr", q_nope, w_uk)  # (B, H, S, r)
        q = torch.cat((q_lat, q_rot), dim=-1)  # (B, H, S, r + dr)
        kv = held[:, None]  # (B, 1, Sk, r + dr): one shared K/V head
        out_lat = attention(q, kv, kv[..., : self.kv_lora_rank], causal=True, mask=mask, scale=self.scale,
                            backend=self.backend, dropout_p=self.dropout if self.training else 0.0)  # (B, H, S, r)
        return torch.einsum("bhsr,hvr->bhsv", out_lat, w_uv)  # (B, H, S, dv)


def _yarn_mscale_squared(scaling: RopeScaling | None) -> float:
    """transformers' DeepSeek multiplies the softmax scale by mscale(factor, mscale_all_dim)²."""
    if scaling is None or scaling.rope_type == "default" or not scaling.mscale_all_dim:
        return 1.0
    factor = scaling.factor
    if factor is None:  # transformers reads rope_scaling["factor"] here: refused, as there
        raise ValueError(f"rope_scaling with mscale_all_dim needs factor, got None ({scaling.rope_type!r})")
    m = 1.0 if factor <= 1 else 0.1 * scaling.mscale_all_dim * math.log(factor) + 1.0
    return m * m
