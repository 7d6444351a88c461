"""The multi-head attention layer, reading top to bottom as the seed's pipeline.

Notation: B batch, S tokens (queries), Sk keys, E embed_dim, H query heads,
Hkv key/value heads, D head_dim.

    x (B, S, E)
      -> q_proj, k_proj, v_proj         project        (B, S, H·D), (B, Sk, Hkv·D) ×2
      -> QK-norm ("proj": OLMo 2)        over H·D, Hkv·D (optional)
      -> split_heads                     a view          (B, H, S, D), (B, Hkv, Sk, D) ×2
      -> QK-norm ("head": Qwen3, Gemma 3) over D (optional)
      -> RoPE on q and k                 per head
      -> attention                       per head        (B, H, S, D)
      -> merge_heads                     concat          (B, S, H·D)
      -> o_proj                          mix the heads   (B, S, E)

The residual ``x + o`` belongs to the surrounding block (as in torch and Hugging Face);
:func:`multihead.trace` shows it as the seed's last step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from typing import TYPE_CHECKING, Any, Literal, overload

from . import _call_checks, decode
from . import linear as _linear
from ._checks import check_finite as _check_finite
from ._checks import check_bool_mask, check_float, check_int, check_tensor
from .backends import get_backend, resolve_backend
from .backends.registry import Backend, get_spec, takes_segments
from .cache import Append, KVCache
from .decode import plain_linear as _plain
from .functional import default_backend
from .logits import alibi_slopes
from .masks import Structure, cu_seqlens_from_positions, segment_mask, segments_from_positions
from .qk_norm import QK_NORMS, RMSNorm
from .rope import RoPE, check_positions

if TYPE_CHECKING:
    from .config import AttentionConfig

__all__ = ["MultiHeadAttention", "split_heads", "merge_heads"]

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
            ``"proj"`` (over H·D and Hkv·D, OLMo 2); modules ``q_norm``, ``k_norm``.
        norm_eps: the QK-norm's epsilon.
        norm_offset: the QK-norm weight is stored as ``w - 1`` (Gemma).
        softcap: logit soft-capping ``cap · tanh(s / cap)`` (Gemma 2), or None.
        alibi: ALiBi biases with the standard slopes of H heads (BLOOM, MPT) instead of
            RoPE (buffer ``alibi_slopes``).
        sinks: one learned sink logit per head (gpt-oss; parameter ``sinks``, zeros).
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
        for name, flag in (("alibi", alibi), ("sinks", sinks), ("norm_offset", norm_offset)):
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
        o_bias = bias if o_bias is None else o_bias
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(kdim, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(vdim, num_kv_heads * head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=o_bias, **factory)
        self.rope = rope
        self.qk_norm: str | None = qk_norm
        if qk_norm is not None:
            q_width, k_width = (head_dim, head_dim) if qk_norm == "head" else (num_heads * head_dim,
                                                                              num_kv_heads * head_dim)
            self.q_norm = RMSNorm(q_width, eps=norm_eps, offset=norm_offset, device=device, dtype=dtype)
            self.k_norm = RMSNorm(k_width, eps=norm_eps, offset=norm_offset, device=device, dtype=dtype)
        self.softcap: float | None = softcap
        self.alibi_slopes: torch.Tensor | None
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads).to(device) if alibi else None,
                             persistent=False)  # (H,) float32
        self.sinks: nn.Parameter | None = (nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))
                                           if sinks else None)  # (H,)

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
        from .config import AttentionConfig
        from .interop.hf_weights import ROPE_TABLE_POSITIONS, _settings

        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be a multihead.AttentionConfig, got {type(config).__name__}")
        if config.latent:
            raise ValueError("config describes multi-head latent attention (kv_lora_rank is set); build it with "
                             "multihead.MultiHeadLatentAttention.from_config")
        lay = config.layer(layer)  # this layer's heads, head_dim, window and RoPE
        if lay.embed_dim not in (None, config.embed_dim):
            raise ValueError(f"layer {layer} has width {lay.embed_dim}, not embed_dim={config.embed_dim} (a stage "
                             "of another width, as in Swin): multihead builds no patch-merging model")
        rope = None
        if lay.rope_base is not None:
            positions = min(config.max_positions or ROPE_TABLE_POSITIONS, ROPE_TABLE_POSITIONS)
            rope = RoPE(lay.head_dim, lay.rope_base, interleaved=config.rope_interleaved,
                        rotary_dim=config.rotary_dim, max_positions=positions, scaling=lay.rope_scaling)
        settings = _settings({"causal": config.causal, "scale": config.scale, "window": lay.window,
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
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, causal={self.causal}, window={self.window}{extras}"
        )

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        return_weights: bool = False,
        check_finite: bool = False,
        packed: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x`` to itself (or to ``context``), optionally through a KV cache.

        Args:
            x: (B, S, E).
            context: (B, Sk, kdim) for cross-attention; None = self-attention.
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
                inside their own sequence. Needs ``positions``; not with a cache or context.
                A backend taking packed sequences as structure (``"native"``, ``"auto"`` on
                its native paths; forward) gets their bounds and no S×S mask is built.

        Returns:
            y (B, S, E), or ``(y, weights)``. A query with no allowed key gets zeros
            from attention (so ``y`` is o_proj's bias there).

        Raises:
            TypeError: wrong dtype (must match the weights) or non-bool masks.
            ValueError: wrong rank/width/device, bad mask shapes, causal or RoPE with
                ``context`` (cross-attention is neither causal nor rotary).
        """
        if check_finite:
            for name, t in (("x", x), ("context", context)):
                if isinstance(t, torch.Tensor):
                    _check_finite(name, t)
        tap = self.__dict__.get("_heads_tap")  # set only while multihead.heads.capture records this layer
        if (cache is not None and tap is None and type(self) is MultiHeadAttention and context is None
                and mask is None and key_mask is None and positions is None
                and not (return_weights or check_finite or packed)):
            y = decode.repeat_step(self, x, cache)  # None unless the last step's checks still hold
            if y is not None:
                return y
        if packed and tap is not None:
            mask = self._packed_mask(x, context, mask, positions, cache)
        if tap is not None:
            return tap(self, x, context, mask=mask, key_mask=key_mask, positions=positions, cache=cache,
                       return_weights=return_weights)
        # Packed: the sequences' bounds, as structure to a backend that takes them, else a mask (_attend).
        cu = self._packed_bounds(x, context, positions, cache) if packed else None
        return self._forward(x, context, mask=mask, key_mask=key_mask, positions=positions,
                             cache=cache, return_weights=return_weights, observe=None, cu_seqlens=cu)

    def _packed_bounds(self, x: torch.Tensor, context: torch.Tensor | None, positions: torch.Tensor | None,
                       cache: KVCache | None) -> torch.Tensor:
        """(B|1, S+1) cumulative lengths of the packed sequences in ``positions`` (no host read)."""
        if positions is None or context is not None or cache is not None:
            raise ValueError("packed=True needs positions (restarting where each sequence begins) and no "
                             "context or cache")
        check_tensor("x", x, ndim=3)
        return cu_seqlens_from_positions(check_positions(positions, x.shape[0], x.shape[1]))

    def _packed_mask(self, x: torch.Tensor, context: torch.Tensor | None, mask: torch.Tensor | None,
                     positions: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        """``mask`` and-ed with the block-diagonal mask of the packed sequences in ``positions``."""
        if positions is None or context is not None or cache is not None:
            raise ValueError("packed=True needs positions (restarting where each sequence begins) and no "
                             "context or cache")
        check_tensor("x", x, ndim=3)
        segments = segments_from_positions(check_positions(positions, x.shape[0], x.shape[1]))  # (B|1, 1, S, S)
        if mask is None:
            return segments
        check_bool_mask("mask", mask, (x.shape[0], self.num_heads, x.shape[1], x.shape[1]), "[B, H, S, Sk]")
        return mask & segments

    # The body lives here so that :func:`multihead.trace` can watch every step.
    @overload
    def _forward(self, x: torch.Tensor, context: torch.Tensor | None, *, mask: torch.Tensor | None,
                 key_mask: torch.Tensor | None, positions: torch.Tensor | None, return_weights: Literal[False],
                 observe: Observer | None, cache: KVCache | None = None,
                 cu_seqlens: torch.Tensor | None = None) -> torch.Tensor: ...
    @overload
    def _forward(self, x: torch.Tensor, context: torch.Tensor | None, *, mask: torch.Tensor | None,
                 key_mask: torch.Tensor | None, positions: torch.Tensor | None, return_weights: bool,
                 observe: Observer | None, cache: KVCache | None = None, cu_seqlens: torch.Tensor | None = None,
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
    def _forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None,
        *,
        mask: torch.Tensor | None,
        key_mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        return_weights: bool,
        observe: Observer | None,
        cache: KVCache | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        real, attn_mask = self._validate(x, context, mask, key_mask, positions, cache)
        if cache is not None and decode.why_not_fused(self, x, cache, key_mask=key_mask, positions=positions,
                                                      context=context, return_weights=return_weights,
                                                      observe=observe) is None:
            return decode.fused_step(self, x, cache, checked=True)
        own_positions = cache is not None and positions is None
        if cache is not None and positions is None:
            positions = cache.positions(x.shape[1])  # (B, S): each row continues from its length
        seen = observe or _no_tap
        seen("X", x)

        q, k, v = self._project(x, context)  # (B, S, H·D), (B, Sk, Hkv·D) ×2
        seen("Q", q), seen("K", k), seen("V", v)
        if self.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)  # over H·D and Hkv·D (OLMo 2)

        h, hkv = self._local_heads(q.shape[-1], k.shape[-1])  # fewer under tensor parallelism
        q = split_heads(q, h)  # (B, H, S, D)
        k = split_heads(k, hkv)  # (B, Hkv, Sk, D)
        v = split_heads(v, hkv)  # (B, Hkv, Sk, D)
        seen("Q_k", q), seen("K_k", k), seen("V_k", v)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)  # over D, per head (Qwen3, Gemma 3)

        if self.rope is not None:
            # With a cache the positions' range is known on the host: no device read.
            bound = max(cache.host_lengths()) + x.shape[1] if cache is not None and own_positions else None
            q, k = self.rope.rotate((q, k), positions, bound=bound)
            seen("Q_rot", q), seen("K_rot", k)

        name = default_backend(self.backend, return_weights)
        fn = resolve_backend(name, q, k, v, dropout_p=self.dropout if self.training else 0.0,
                             return_weights=return_weights, **self._features())  # before anything is written
        if cu_seqlens is not None and not takes_segments(get_spec(name), q, k, v, **self._features()):
            segments = segment_mask(cu_seqlens, q.shape[2], q.device)  # (B, 1, S, S): the dense form
            attn_mask, cu_seqlens = (segments if attn_mask is None else attn_mask & segments), None
        structure = Structure(self.causal, self.window)
        step = None if cache is None else cache.append(k, v, real, structure=structure)  # staged
        try:  # the cache is committed only if the whole call succeeds; any failure rolls it back
            heads, weights = self._attend(fn, q, k, v, attn_mask, structure, step, return_weights, seen,
                                          cu_seqlens)  # (B, H, S, D)
            seen("head_k", heads)

            concat = merge_heads(heads)  # (B, S, H·D)
            seen("concat", concat)
            y = _apply_linear(self.o_proj, concat)  # (B, S, E)
            seen("O", y)
        except BaseException:
            if cache is not None and step is not None:
                cache.rollback(step)
            raise
        if cache is not None and step is not None:
            cache.commit(step)
        if return_weights:
            assert weights is not None  # the backend was resolved to return them
            return y, weights
        return y

    def _local_heads(self, q_width: int, k_width: int) -> tuple[int, int]:
        """(H, Hkv) in this call's projections: this rank's share when ``parallelize_module`` shards them
        (``mh.parallel.tensor_parallel_plan``); anything but whole heads and whole query groups is refused."""
        w = self.q_proj.weight
        mesh, placements = getattr(w, "device_mesh", None), getattr(w, "placements", ())  # a DTensor's
        p = math.prod(mesh.size(i) for i, pl in enumerate(placements) if pl.is_shard()) if mesh is not None else 1
        h, hkv, d = q_width // self.head_dim, k_width // self.head_dim, self.head_dim
        if (h * p, hkv * p, h * d, hkv * d) != (self.num_heads, self.num_kv_heads, q_width, k_width):
            raise ValueError(f"num_heads={self.num_heads} and num_kv_heads={self.num_kv_heads} must split into "
                             f"whole heads over {p} rank(s), got q/k widths {q_width}/{k_width} per rank (head_dim "
                             f"{d}); for num_kv_heads < ranks use multihead.parallel.shard_heads")
        return h, hkv

    def _features(self) -> dict[str, Any]:
        """The layer's logit features a backend must support (soft-capping, ALiBi, sinks)."""
        return {name: value for name, value in (("softcap", self.softcap), ("alibi_slopes", self.alibi_slopes),
                                                ("sinks", self.sinks)) if value is not None}

    def _attend(self, fn: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: torch.Tensor | None, structure: Structure, step: Append | None,
                return_weights: bool, seen: Observer, cu_seqlens: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of the heads by the resolved backend ``fn``, over the cache's staged
        keys and values when ``step`` (from :meth:`KVCache.append`) is given; packed sequences
        as ``cu_seqlens`` (B, N+1) to a backend that takes them."""
        packing = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        if step is not None:
            k, v, attn_mask = step.keys, step.values, step.mask
            seen("K_cache", k)
            seen("V_cache", v)
            if attn_mask is not None:  # the mask carries causality and the window
                structure = Structure()
        out, weights, _ = fn(q, k, v, mask=attn_mask, causal=structure.causal, window=structure.window,
                             scale=self.scale, dropout_p=self.dropout if self.training else 0.0,
                             return_weights=return_weights, return_lse=False, **self._features(), **packing)
        return out, weights

    def _project(self, x: torch.Tensor, context: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, S, H·D) from x; k and v (B, Sk, Hkv·D) from the context (default x)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if context is None and all(map(_plain, projs)):  # one call: decoding streams all three at once
            q, k, v = _linear.linears(x, [(p.weight, p.bias) for p in projs])
            return q, k, v
        src = x if context is None else context
        return _apply_linear(self.q_proj, x), _apply_linear(self.k_proj, src), _apply_linear(self.v_proj, src)

    def _validate(self, x: torch.Tensor, context: torch.Tensor | None, mask: torch.Tensor | None,
                  key_mask: torch.Tensor | None, positions: torch.Tensor | None, cache: KVCache | None,
                  ) -> tuple[list[int] | None, torch.Tensor | None]:
        """Every check of a call, once, before any work (:func:`multihead._call_checks.validate_call`)."""
        return _call_checks.validate_call(self, x, context, mask, key_mask, positions, cache)


def _no_tap(name: str, t: torch.Tensor) -> None:
    """The observer when nobody watches."""


def _apply_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)``, through oneDNN's GEMM (:func:`multihead.linear.linear`) when plain."""
    if _plain(linear):
        assert isinstance(linear, nn.Linear)  # _plain: exactly an nn.Linear
        return _linear.linear(x, linear.weight, linear.bias)
    out: torch.Tensor = linear(x)
    return out
