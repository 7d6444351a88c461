"""The multi-head attention layer, reading top to bottom as the seed's pipeline.

Notation: B batch, S tokens (queries), Sk keys, E embed_dim, H query heads,
Hkv key/value heads, D head_dim.

    x (B, S, E)
      -> q_proj, k_proj, v_proj         project        (B, S, H·D), (B, Sk, Hkv·D) ×2
      -> QK-norm ("proj": OLMo 2)        over H·D, Hkv·D (optional)
      -> split_heads                     a view          (B, H, S, D), (B, Hkv, Sk, D) ×2
      -> QK-norm ("head": Qwen3, Gemma 3) over D (optional)
      -> RoPE on q and k                 per head
      -> QK-norm ("head_after_rope": HunYuan) over D, after RoPE (optional)
      -> attention                       per head        (B, H, S, D)
      -> merge_heads                     concat          (B, S, H·D)
      -> o_proj                          mix the heads   (B, S, E)

The residual ``x + o`` belongs to the surrounding block (as in torch and Hugging Face);
:func:`multihead.trace` shows it as the seed's last step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import _call_checks, decode
from ._call_checks import LAYER_HABITS, Inputs, refuse_positional, refuse_unexpected
from . import linear as _linear
from ._checks import check_float, check_int, check_tensor
from .config import AttentionConfig, check_overrides
from .backends import get_backend, resolve_backend
from .backends.registry import Backend, get_spec, place_segments
from .block_mask import BlockMask, MaskMod
from .cache import KVCache
from .decode import plain_linear as _plain
from .functional import attention, default_backend
from .logits import NO_FEATURES, Features, alibi_slopes
from .masks import Structure
from .qk_norm import QK_NORMS, RMSNorm
from .rope import RoPE
from .score_mods import ScoreMod

__all__ = ["MultiHeadAttention", "split_heads", "merge_heads", "Watch"]

Observer = Callable[[str, torch.Tensor], None]


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, S, H·D) -> (B, H, S, D), a view: no new weights, no copy."""
    b, s, hd = x.shape
    return x.view(b, s, num_heads, hd // num_heads).transpose(1, 2)  # (B, H, S, D)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> (B, S, H·D): the seed's concat, head k in rows k·D .. (k+1)·D-1."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)  # (B, S, H·D)


class MultiHeadAttention(nn.Module):
    """Multi-head (and grouped-query / multi-query) attention.

    Args:
        embed_dim: E, the model width (``hidden_size``).
        num_heads: H, query heads (``num_attention_heads``).
        num_kv_heads: Hkv, key/value heads; must divide H. Default H (MHA); 1 is MQA;
            in between is GQA, where query head i reads K/V head ``i // (H // Hkv)``.
        head_dim: D; default E // H, which then must divide exactly (the seed's
            constraint). Set it for models where H·D != E (Gemma).
        bias: bias on q_proj, k_proj, v_proj (and o_proj unless ``o_bias`` says).
        o_bias: bias on o_proj; default same as ``bias`` (Qwen2: bias=True, o_bias=False).
        causal: mask future tokens (decoders); False = bidirectional (encoders, ViT).
        rope: a :class:`RoPE` for q and k (its head_dim must equal D), or None.
        dropout: dropout on the attention probabilities, in training mode only.
        scale: logit scale; default 1/√D (per head, not 1/√E).
        window: sliding-window size (Mistral's convention), or None.
        kdim, vdim: width of the ``context`` for cross-attention; default E. One
            context feeds both k_proj and v_proj, so vdim must equal kdim.
        backend: attention backend name; None = the functional default.
        qk_norm: RMSNorm on q and k before RoPE: ``"head"`` (over D, Qwen3/Gemma 3) or
            ``"proj"`` (over H·D and Hkv·D, OLMo 2); or after RoPE, ``"head_after_rope"``
            (over D, HunYuan dense); modules ``q_norm``, ``k_norm``.
        norm_eps: the QK-norm's epsilon.
        norm_offset: the QK-norm weight is stored as ``w - 1`` (Gemma).
        softcap: logit soft-capping ``cap · tanh(s / cap)`` (Gemma 2), or None.
        alibi: ALiBi biases with the standard slopes of H heads (BLOOM, MPT) instead of
            RoPE (buffer ``alibi_slopes``).
        sinks: one learned sink logit per head (gpt-oss; parameter ``sinks``, zeros).
        batch_first: False = :meth:`forward` takes ``x``/``context`` and returns ``y`` as
            (S, B, E), torch's ``nn.MultiheadAttention`` default (what :meth:`from_torch` carries
            over); masks, ``key_mask``, ``positions``, weights and every step stay batch-first.
        device, dtype: for the parameters.

    Raises:
        ValueError, TypeError: bad sizes or types, named in the message.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        o_bias: bool | None = None,
        causal: bool = False,
        rope: RoPE | None = None,
        dropout: float = 0.0,
        scale: float | None = None,
        window: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        backend: str | None = None,
        qk_norm: str | None = None,
        norm_eps: float = 1e-6,
        norm_offset: bool = False,
        softcap: float | None = None,
        alibi: bool = False,
        sinks: bool = False,
        batch_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_int("embed_dim", embed_dim)
        if qk_norm is not None and qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {list(QK_NORMS)} or None, got {qk_norm!r}")
        if softcap is not None:
            softcap = check_float("softcap", softcap, low=0.0, high=math.inf, low_inclusive=False,
                                  high_inclusive=False)
        for name, flag in (("alibi", alibi), ("sinks", sinks), ("norm_offset", norm_offset),
                           ("batch_first", batch_first)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
        if alibi and rope is not None:
            raise ValueError("alibi=True with a rope: ALiBi replaces position embeddings; pass rope=None")
        check_int("num_heads", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), "
                    "or pass head_dim explicitly"
                )
            head_dim = embed_dim // num_heads
        check_int("head_dim", head_dim)
        if rope is not None:
            if not isinstance(rope, RoPE):
                raise TypeError(f"rope must be a multihead.RoPE or None, got {type(rope).__name__}")
            if rope.head_dim != head_dim:
                raise ValueError(f"rope.head_dim must equal head_dim={head_dim}, got {rope.head_dim}")
        self.dropout: float = check_float("dropout", dropout, low=0.0, high=1.0, high_inclusive=False)
        if scale is not None:
            scale = check_float("scale", scale, low=0.0, high=math.inf, low_inclusive=False, high_inclusive=False)
        if window is not None:
            check_int("window", window)
        kdim = embed_dim if kdim is None else check_int("kdim", kdim)
        vdim = kdim if vdim is None else check_int("vdim", vdim)
        if vdim != kdim:
            raise ValueError(f"vdim ({vdim}) must equal kdim ({kdim}): one context feeds both k_proj and v_proj")
        if backend is not None:
            get_backend(backend)  # fail now, not at the first forward

        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.causal = bool(causal)
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        self.window: int | None = window
        self.kdim, self.vdim = kdim, vdim
        self.backend: str | None = backend
        self.batch_first = batch_first
        o_bias = bias if o_bias is None else o_bias
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(kdim, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(vdim, num_kv_heads * head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=o_bias, **factory)
        self.rope = rope
        self.qk_norm: str | None = qk_norm
        if qk_norm is not None:
            q_width, k_width = (head_dim, head_dim) if qk_norm != "proj" else (num_heads * head_dim,
                                                                              num_kv_heads * head_dim)
            self.q_norm = RMSNorm(q_width, eps=norm_eps, offset=norm_offset, device=device, dtype=dtype)
            self.k_norm = RMSNorm(k_width, eps=norm_eps, offset=norm_offset, device=device, dtype=dtype)
        self.softcap: float | None = softcap
        self.alibi_slopes: torch.Tensor | None
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads).to(device) if alibi else None,
                             persistent=False)  # (H,) float32
        self.sinks: nn.Parameter | None = (nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
                                           if sinks else None)  # (H,)
        self.watch: Watch | None = None  # set while a trace or a capture watches the steps (watched)

    @classmethod
    def from_config(
        cls,
        config: AttentionConfig,
        *,
        layer: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **overrides: Any,
    ) -> "MultiHeadAttention":
        """Build an (untrained) layer of the shape ``config`` describes.

        Args:
            config: an :class:`~multihead.AttentionConfig` (e.g. from
                ``AttentionConfig.from_hf("config.json")``).
            layer: which layer (0-based): its heads, head_dim, window and RoPE (``config.layer``).
            device: e.g. ``"meta"`` to build without allocating (shapes only).
            dtype: of the parameters.
            **overrides: ``causal``, ``scale``, ``window``, ``backend``, ``rope``, ``dropout``.

        Returns:
            a layer with freshly initialised weights (and RoPE on ``device``).

        Raises:
            TypeError: ``config`` is not an AttentionConfig.
            ValueError: ``layer`` out of range, or a bad override.
        """
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be a multihead.AttentionConfig, got {type(config).__name__}")
        if config.latent:
            raise ValueError("config describes multi-head latent attention (kv_lora_rank is set); build it with "
                             "multihead.MultiHeadLatentAttention.from_config")
        lay = config.layer(layer)  # this layer's heads, head_dim, window and RoPE
        if lay.embed_dim not in (None, config.embed_dim):
            raise ValueError(f"layer {layer} has width {lay.embed_dim}, not embed_dim={config.embed_dim} (a stage "
                             "of another width, as in Swin): multihead builds no patch-merging model")
        rope = None if lay.rope_base is None else RoPE.from_facts(
            lay.head_dim, lay.rope_base, interleaved=config.rope_interleaved, rotary_dim=config.rotary_dim,
            max_positions=config.max_positions, scaling=lay.rope_scaling)
        settings = check_overrides({"causal": config.causal, "scale": config.scale, "window": lay.window,
                                    "rope": rope}, overrides)
        built = cls(config.embed_dim, lay.num_heads, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim,
                    bias=config.bias, o_bias=config.effective_o_bias, qk_norm=config.qk_norm, softcap=config.softcap,
                    alibi=config.alibi, sinks=config.sinks, device=device, dtype=dtype, **settings)
        if built.rope is not None and device is not None:
            built.rope.to(device)
        return built

    @classmethod
    def from_torch(cls, module: nn.Module, **overrides: object) -> "MultiHeadAttention":
        """Convert a ``torch.nn.MultiheadAttention`` (weights copied); see :mod:`multihead.interop`."""
        from .interop import from_torch

        return from_torch(module, **overrides)

    @classmethod
    def from_hf(cls, module: nn.Module, config: object | None = None, **overrides: object) -> "MultiHeadAttention":
        """Convert a Hugging Face attention module (BERT, GPT-2, Llama families); see :mod:`multihead.interop`."""
        from .interop import from_hf

        return from_hf(module, config, **overrides)

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        ring: bool | None = None,
    ) -> KVCache:
        """A preallocated :class:`KVCache` for this layer (its K/V heads only).

        Args:
            batch_size: B.
            max_len: the most tokens any row will hold (prompt + generated).
            dtype, device: the layer's weights' (the default); anything else is refused,
                since the cache stores exactly the K/V the layer computes.
            ring: keep only the last ``window`` tokens per row in a ring buffer; default
                True when the layer has a sliding window shorter than ``max_len``.

        Returns:
            a cache with buffers (B, Hkv, C, D), C = max_len (or the window for a ring),
            belonging to this layer: passing it to another layer raises ``ValueError``.
        """
        weight = self.q_proj.weight
        # The cache holds what the layer computes: another dtype or device could never be used.
        if dtype is not None and dtype != weight.dtype:
            raise TypeError(f"dtype must be the layer's dtype {weight.dtype} (the cache stores its K/V), got {dtype}")
        if device is not None and torch.device(device) != weight.device:
            raise ValueError(f"device must be the layer's device {weight.device}, got {device}")
        if ring is None:
            ring = self.window is not None and self.window < max_len
        cache = KVCache(
            batch_size, max_len, self.num_kv_heads, self.head_dim,
            dtype=weight.dtype if dtype is None else dtype,
            device=weight.device if device is None else device,
            window=self.window, ring=ring,
        )
        cache.claim(self)  # it holds this layer's K/V: any other layer is refused
        return cache

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # ALiBi's slopes are computed from H, in no state dict: on the meta device (a layer built
        # under torch.device("meta")) they have no values, so given memory (to_empty) they are
        # computed again (pruning refuses ALiBi layers: a layer's slopes are always H's standard ones).
        slopes = self.alibi_slopes
        super()._apply(fn, recurse)
        now = self.alibi_slopes
        if slopes is not None and slopes.is_meta and now is not None and not now.is_meta:
            with torch.device("cpu"):
                fresh = alibi_slopes(self.num_heads)  # (H,) float32
            self.alibi_slopes = fresh.to(device=now.device, dtype=now.dtype)
        return self

    @property
    def per_head_extras(self) -> list[str]:
        """Names of per-head state beyond the projections (ALiBi slopes, sinks, a whole-projection
        QK-norm): code that removes or splits heads must carry them, or refuse."""
        return [name for name, present in (("alibi_slopes", self.alibi_slopes is not None),
                                           ("sinks", self.sinks is not None),
                                           ("qk_norm='proj'", self.qk_norm == "proj")) if present]

    def extra_repr(self) -> str:
        extras = "".join(f", {name}={value!r}" for name, value in (
            ("qk_norm", self.qk_norm), ("softcap", self.softcap)) if value is not None)
        extras += ", alibi=True" if self.alibi_slopes is not None else ""
        extras += ", sinks=True" if self.sinks is not None else ""
        extras += ", batch_first=False" if not self.batch_first else ""
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, causal={self.causal}, window={self.window}{extras}"
        )

    # ---- the pipeline: forward composes the public steps -------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *extra: object,
        mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        return_weights: bool = False,
        check_finite: bool = False,
        packed: bool = False,
        mask_mod: MaskMod | None = None,
        block_mask: BlockMask | None = None,
        bias: torch.Tensor | None = None,
        score_mod: ScoreMod | None = None,
        **unexpected: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` to itself (or to ``context``), optionally through a KV cache.

        The seed's pipeline, one public step each: :meth:`project`, :meth:`split`,
        :meth:`rotate`, the cache's :meth:`KVCache.staged` write, :meth:`attend`, :meth:`output`.

        Args:
            x: (B, S, E); (S, B, E) when the layer was built ``batch_first=False``.
            context: (B, Sk, kdim) for cross-attention ((Sk, B, kdim) when not batch-first);
                None = self-attention.
            mask: bool, broadcastable to (B, H, S, Sk), **True = may attend**.
            key_mask: (B, Sk) bool, True = real token, False = padding.
            positions: (S,) or (B, S) integer RoPE positions; default 0 .. S-1, or with a
                cache each row's next positions (its length onwards).
            cache: a :class:`KVCache` from :meth:`new_cache`: the new tokens' K/V are
                appended in place and the queries attend to everything cached
                (causally, bottom-right aligned). With a cache, ``key_mask`` (B, S)
                marks the real tokens of right-padded prompts; ``mask`` is refused.
            return_weights: also return per-head weights (B, H, S, Sk), never averaged.
            check_finite: raise ``ValueError`` if ``x`` or ``context`` hold NaN/Inf,
                naming the tensor and the first bad index, before anything else.
            packed: each row holds several sequences one after another, each starting
                where ``positions`` does not continue the previous token's (Hugging Face's
                packing without padding, positions restarting at 0): tokens attend only
                inside their own sequence. Needs ``positions`` (a layer without RoPE reads
                them only for the sequences' bounds); not with a cache or context.
                A backend taking packed sequences as structure (``"native"``, ``"auto"`` on
                its native paths; forward) gets their bounds and no S×S mask is built.
            mask_mod, block_mask, bias, score_mod: programmable attention, as
                :func:`multihead.attention` takes them (FlexAttention's ``mask_mod(b, h, q_idx,
                kv_idx)`` and ``score_mod(score, b, h, q_idx, kv_idx)``, a :class:`~multihead.BlockMask`
                for (B|1, H|1, S, Sk), a float ``bias`` broadcastable to (B, H, S, Sk), differentiable),
                and-ed with / added after the layer's own mask, causal/window rule and logit features.
                Sk is the call's key count: S, the context's length, or with a cache its length
                after this call's write; ``q_idx = i + Sk - S`` (bottom-right) is then the query's
                cache position, so decoding evaluates the rows of the full pass. With a cache they
                need every row at one length, no padding and a linear (or unwrapped ring) cache; they
                never take the fused decoding step (:data:`multihead.decode.PROGRAMMABLE`).
            *extra, **unexpected: refused (``TypeError``), torch's habits named with their
                equivalents: ``layer(query, key, value)``, ``attn_mask=``, ``key_padding_mask=``
                (True = ignore there, ``key_mask`` is True = real token), ``need_weights=``, ``is_causal=``.

        Returns:
            y (B, S, E) ((S, B, E) when not batch-first), or ``(y, weights)``. A query with no
            allowed key gets zeros from attention (so ``y`` is o_proj's bias there).

        Raises:
            TypeError: wrong dtype (must match the weights), non-bool masks, a third positional
                argument or a keyword the layer does not take.
            ValueError: wrong rank/width/device, bad mask shapes, causal or RoPE with
                ``context`` (cross-attention is neither causal nor rotary); a ``block_mask`` or
                ``bias`` not of the call's (S, Sk), or one of the programmable keywords with a cache
                whose keys are not positions 0 .. Sk-1 (named; the cache is left as it was).
        """
        if extra or unexpected:  # torch's habits; a right call pays two truth tests
            raise (refuse_positional(x, context, extra) if extra
                   else refuse_unexpected("MultiHeadAttention.forward()", unexpected, LAYER_HABITS))
        seq_first = not self.batch_first
        if seq_first:  # (S, B, E) -> (B, S, E) at the edge, as the torch module it came from took it
            x = check_tensor("x", x, ndim=3).transpose(0, 1).contiguous()
            if context is not None:
                context = check_tensor("context", context, ndim=3).transpose(0, 1).contiguous()
        programmable: dict[str, Any] = {}  # forwarded to the attend step (the fused step takes none)
        if not (mask_mod is None and block_mask is None and bias is None and score_mod is None):
            programmable = {name: value for name, value in (("mask_mod", mask_mod), ("block_mask", block_mask),
                                                            ("bias", bias), ("score_mod", score_mod))
                            if value is not None}
        plain = not (context is not None or mask is not None or key_mask is not None or positions is not None
                     or return_weights or check_finite or packed or programmable)
        if cache is not None and plain and (y := decode.repeat_step(self, x, cache)) is not None:
            # the fused step whose checks, asked at the last step, still hold
            return y.transpose(0, 1) if seq_first else y
        call = self.check(x, context, mask=mask, key_mask=key_mask, positions=positions, cache=cache,
                          packed=packed, check_finite=check_finite, programmable=tuple(programmable))
        if cache is not None and not isinstance(step := decode.fused_for(
                self, x, cache, key_mask=key_mask, positions=positions, context=context,
                return_weights=return_weights, **programmable), str):
            y = step(x)  # the whole cached call in one native call
            return y.transpose(0, 1) if seq_first else y
        q, k, v = self.split(*self.project(x, context))  # (B, H, S, D), (B, Hkv, Sk, D) ×2
        at, bound = call.rope_positions(cache, x.shape[1])
        q, k = self.rotate(q, k, at, bound=bound)
        fn = self.resolve(q, k, v, return_weights=return_weights)  # refused before anything is written
        if cache is None:
            heads, weights = self.attend(q, k, v, mask=call.mask, return_weights=return_weights,
                                         cu_seqlens=call.cu_seqlens, backend=fn, **programmable)  # (B, H, S, D)
            y = self.output(heads)
        else:
            with cache.staged(k, v, call.real, structure=self.structure) as held:  # committed if all succeeds
                heads, weights = self.attend(q, held.keys, held.values, mask=held.mask, structure=held.structure,
                                             return_weights=return_weights, cached=True, backend=fn, **programmable)
                y = self.output(heads)
        if seq_first:
            y = y.transpose(0, 1)  # (B, S, E) -> (S, B, E)
        if return_weights:
            assert weights is not None  # the backend was resolved to return them
            return y, weights
        return y

    def check(self, x: torch.Tensor, context: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
              key_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              cache: KVCache | None = None, packed: bool = False, check_finite: bool = False,
              programmable: tuple[str, ...] = ()) -> Inputs:
        """Every check of a :meth:`forward` call, once, before any work (arguments as there).

        ``programmable``: the names of the programmable keywords given (``"mask_mod"``...), whose
        values :meth:`attend` hands to the core that checks them.

        Returns:
            the validated :class:`~multihead._call_checks.Inputs` the steps take: the combined
            mask, the positions (with a cache, each row's next ones), their host bound, the
            packed sequences' bounds, the real tokens per row.

        Raises:
            TypeError, ValueError: as :meth:`forward`; nothing has been computed or written.
        """
        return _call_checks.validate_call(self, x, context, mask, key_mask, positions, cache, packed=packed,
                                          check_finite=check_finite, programmable=programmable)

    @property
    def structure(self) -> Structure:
        """The layer's causal/window rule (:class:`~multihead.masks.Structure`)."""
        return Structure(self.causal, self.window)

    def project(self, x: torch.Tensor, context: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step 1, the seed's projections: q (B, S, H·D) from x; k and v (B, Sk, Hkv·D) from
        the context (default x); then QK-norm over H·D and Hkv·D when ``qk_norm="proj"`` (OLMo 2).

        Plain ``nn.Linear`` projections run through :func:`multihead.linear.linears` (one call
        for the three when they read x); any other module (LoRA, hooks) is called as itself.
        """
        self._see("X", x)
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if context is None and all(map(_plain, projs)):  # one call: decoding streams all three at once
            q, k, v = _linear.linears(x, [(p.weight, p.bias) for p in projs])
        else:
            src = x if context is None else context
            q, k, v = _apply_linear(self.q_proj, x), _apply_linear(self.k_proj, src), _apply_linear(self.v_proj, src)
        for name, t in (("Q", q), ("K", k), ("V", v)):
            self._see(name, t)
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)  # over H·D and Hkv·D (OLMo 2)
        return q, k, v

    def split(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step 2, split into heads (views, no copy): (B, S, H·D) -> (B, H, S, D), k and v
        (B, Sk, Hkv·D) -> (B, Hkv, Sk, D); then QK-norm over D when ``qk_norm="head"``
        (Qwen3, Gemma 3). Under tensor parallelism the projections hold this rank's heads."""
        h, hkv = self._local_heads(q.shape[-1], k.shape[-1])
        q = split_heads(q, h)  # (B, H, S, D)
        k = split_heads(k, hkv)  # (B, Hkv, Sk, D)
        v = split_heads(v, hkv)  # (B, Hkv, Sk, D)
        for name, t in (("Q_k", q), ("K_k", k), ("V_k", v)):
            self._see(name, t)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)  # over D, per head (Qwen3, Gemma 3)
            self._see("Q_norm", q)  # what attention reads when no RoPE follows (EXAONE 4's global layers)
            self._see("K_norm", k)
        return q, k, v

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None, *,
               bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 3, RoPE per head: q (B, H, S, D) and k (B, Hkv, S, D) rotated at ``positions``
        ((S,) or (B, S); default 0 .. S-1); as given without a RoPE. ``bound``: a known
        exclusive upper bound of the positions (no device read). Then QK-norm over D when
        ``qk_norm="head_after_rope"`` (HunYuan dense), with or without a RoPE."""
        if self.rope is not None:
            q, k = self.rope.rotate((q, k), positions, bound=bound)
            self._see("Q_rot", q)
            self._see("K_rot", k)
        if self.qk_norm == "head_after_rope":
            q, k = self.q_norm(q), self.k_norm(k)  # over D, per head, of the rotated q and k (HunYuan dense)
            self._see("Q_rot_norm", q)
            self._see("K_rot_norm", k)
        return q, k

    def resolve(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_weights: bool = False
                ) -> Backend:
        """The attention function :meth:`attend` runs for these heads: the layer's backend, one
        that returns weights when they are asked for or a watcher needs them (:meth:`watched`).

        Raises:
            ValueError: the named backend cannot run this call (the missing capability named).
        """
        weights = return_weights or self._wants_weights()
        name = default_backend(self.backend, weights)
        return resolve_backend(name, q, k, v, dropout_p=self.dropout if self.training else 0.0,
                               return_weights=weights, features=self.features)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None = None,
               structure: Structure | None = None, return_weights: bool = False, cached: bool = False,
               cu_seqlens: torch.Tensor | None = None, backend: Backend | None = None,
               mask_mod: MaskMod | None = None, block_mask: BlockMask | None = None,
               bias: torch.Tensor | None = None, score_mod: ScoreMod | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step 4, scaled dot-product attention per head (scale ``self.scale``, 1/√D by default),
        with the layer's logit features (soft-capping, ALiBi, sinks) and dropout in training.

        Args:
            q: (B, H, S, D); k, v: (B, Hkv, Sk, D), the keys after RoPE (a cache's: all held).
            mask: bool broadcastable to (B, H, S, Sk), True = may attend.
            structure: the causal/window rule; default the layer's (:attr:`structure`).
            return_weights: also return the weights (B, H, S, Sk).
            cached: k and v are a cache's keys and values (reported to a watcher as such).
            cu_seqlens: (B|1, N+1) packed sequences' bounds: structure to a backend that
                takes them, else and-ed into ``mask``.
            backend: the function :meth:`resolve` returned for this call (default: resolved here).
            mask_mod, block_mask, bias, score_mod: programmable attention (:meth:`forward`): given
                any, the call runs through :func:`multihead.attention` with the layer's backend name,
                which checks them against (S, Sk), lowers the score_mod's building blocks, places the
                block mask and packed sequences and resolves the backend with all of them (``backend``
                is then not called: it was resolved without them).

        Returns:
            heads (B, H, S, D) and the weights (B, H, S, Sk), or None when not asked for.

        Raises:
            ValueError, TypeError: as :func:`multihead.attention` for the programmable keywords.
        """
        structure = self.structure if structure is None else structure
        weights_wanted = return_weights or self._wants_weights()
        if cached:
            self._see("K_cache", k)
            self._see("V_cache", v)
        if not (mask_mod is None and block_mask is None and bias is None and score_mod is None):
            # the core's one path for them: checks, lowering, placement, the backend
            out = attention(q, k, v, mask=mask, causal=structure.causal, window=structure.window, scale=self.scale,
                            dropout_p=self.dropout if self.training else 0.0, return_weights=weights_wanted,
                            backend=default_backend(self.backend, weights_wanted), cu_seqlens=cu_seqlens,
                            softcap=self.softcap, alibi_slopes=self.alibi_slopes, sinks=self.sinks,
                            mask_mod=mask_mod, block_mask=block_mask, bias=bias, score_mod=score_mod)
            heads, weights = out if isinstance(out, tuple) else (out, None)  # (heads, weights) when asked for
        else:
            fn = self.resolve(q, k, v, return_weights=return_weights) if backend is None else backend
            features = self.features
            if cu_seqlens is not None:  # as structure to a backend that takes them, else as a mask
                spec = get_spec(default_backend(self.backend, weights_wanted))
                features, mask = place_segments(spec, q, k, v, features._replace(cu_seqlens=cu_seqlens), mask)
            heads, weights, _ = fn(q, k, v, mask=mask, causal=structure.causal, window=structure.window,
                                   scale=self.scale, dropout_p=self.dropout if self.training else 0.0,
                                   return_weights=weights_wanted, return_lse=False, features=features)
        self._see("head_k", heads)
        if weights is not None:
            self._see("weights", weights)
        return heads, (weights if return_weights else None)

    def output(self, heads: torch.Tensor) -> torch.Tensor:
        """Step 5, concat and W_o: heads (B, H, S, D) -> merge_heads (B, S, H·D) -> o_proj (B, S, E)."""
        concat = merge_heads(heads)  # (B, S, H·D)
        self._see("concat", concat)
        y = _apply_linear(self.o_proj, concat)  # (B, S, E)
        self._see("O", y)
        return y

    # ---- watching the steps (multihead.trace, multihead.heads.capture) ----------------------
    @contextmanager
    def watched(self, observe: Observer, *, weights: bool = False) -> Iterator[None]:
        """Within the block, every step reports what it computed: ``observe(name, tensor)`` with
        the names of :mod:`multihead.tools.trace` (``"Q"``, ``"Q_k"``, ``"Q_rot"``, ``"K_cache"``,
        ``"head_k"``, ``"O"``...) and ``"weights"`` (B, H, S, Sk) when ``weights``: then attention
        runs on a backend that returns them. A watched layer never takes the fused decoding step.
        Every path that composes the steps (the module, the Hugging Face wrappers) reports.

        Raises:
            ValueError: the layer is already watched (one watcher at a time).
        """
        if self.watch is not None:
            raise ValueError("the layer is already being watched (multihead.trace or multihead.heads.capture); "
                             "one watcher at a time")
        self.watch = Watch(observe, weights)
        try:
            yield
        finally:
            self.watch = None

    def _see(self, name: str, t: torch.Tensor) -> None:
        watch = self.watch
        if watch is not None:
            watch.observe(name, t)

    def _wants_weights(self) -> bool:
        return self.watch is not None and self.watch.weights

    def _local_heads(self, q_width: int, k_width: int) -> tuple[int, int]:
        """(H, Hkv) in this call's projections: this rank's share when ``parallelize_module`` shards them
        (``mh.parallel.tensor_parallel_plan``); anything but whole heads and whole query groups is refused."""
        w = self.q_proj.weight
        p = 1
        if type(w) is not nn.Parameter and type(w) is not torch.Tensor:  # a DTensor's mesh and placements
            mesh, placements = getattr(w, "device_mesh", None), getattr(w, "placements", ())
            p = math.prod(mesh.size(i) for i, pl in enumerate(placements) if pl.is_shard()) if mesh is not None else 1
        h, hkv, d = q_width // self.head_dim, k_width // self.head_dim, self.head_dim
        if (h * p, hkv * p, h * d, hkv * d) != (self.num_heads, self.num_kv_heads, q_width, k_width):
            raise ValueError(f"num_heads={self.num_heads} and num_kv_heads={self.num_kv_heads} must split into "
                             f"whole heads over {p} rank(s), got q/k widths {q_width}/{k_width} per rank (head_dim "
                             f"{d}); for num_kv_heads < ranks use multihead.parallel.shard_heads")
        return h, hkv

    @property
    def features(self) -> Features:
        """The layer's logit features (soft-capping, ALiBi, sinks), one value for its backend
        (:data:`~multihead.logits.NO_FEATURES` itself when it has none: the backends' common case)."""
        softcap, slopes, sinks = self.softcap, self.alibi_slopes, self.sinks
        if softcap is None and slopes is None and sinks is None:
            return NO_FEATURES
        return Features(softcap, slopes, sinks)


@dataclass(frozen=True)
class Watch:
    """Who watches a layer's steps (:meth:`MultiHeadAttention.watched`)."""

    observe: Observer
    weights: bool  # attention must return its weights, for the watcher


def _apply_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)``, through oneDNN's GEMM (:func:`multihead.linear.linear`) when plain."""
    if _plain(linear):
        assert isinstance(linear, nn.Linear)  # _plain: exactly an nn.Linear
        return _linear.linear(x, linear.weight, linear.bias)
    out: torch.Tensor = linear(x)
    return out
