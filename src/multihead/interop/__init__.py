"""Converters at the edges: torch and Hugging Face modules, configs and checkpoint files.

Notation: B batch, S tokens, E embed_dim, H query heads, Hkv key/value heads, D head_dim.

Inside multihead every layer is a :class:`~multihead.MultiHeadAttention` with four
``nn.Linear`` (``y = x · Wᵀ + b``, weights ``[out, in]``), batch-first tensors and masks
where True = may attend. Peers store the same numbers differently; this module maps them:

* ``torch.nn.MultiheadAttention``: ``in_proj_weight`` [3E, E] (or ``q/k/v_proj_weight``)
  and ``out_proj``; seq-first by default, masks True = ignore.
* BERT family (BertAttention): ``self.query/key/value``; W_o is ``output.dense``, followed
  by dropout, the residual and a LayerNorm.
* GPT-2 family (GPT2Attention): fused ``c_attn`` and ``c_proj`` Conv1D, stored ``[in, out]``,
  the transpose of nn.Linear.
* q_proj classes (Llama, Mistral, Qwen2, ViT, Cohere, ...): ``q_proj/k_proj/v_proj/o_proj``
  nn.Linear, our names and layout; RoPE as each class's registry entry says.

Only the attention part is converted: BertAttention's output adds dropout, the residual
and a LayerNorm, which belong to the surrounding block (:func:`multihead.hf.patch` keeps
them around the converted layer). Checkpoints are read with safetensors only; pickles
(``.bin``, ``.pt``, ...) are never unpickled (:func:`load_safetensors`).

transformers is never imported here at module level. Hugging Face modules are converted
only when their class is in :data:`multihead.interop.hf_registry.REGISTRY` (by qualified
class name, with a complete description of what it computes): exact or refused, never
guessed from weight names.
"""

from __future__ import annotations

from ..rope import half_to_interleaved, interleaved_to_half
from .checkpoint import PICKLE_SUFFIXES, load_safetensors, load_state
from .hf_weights import from_hf, hf_family, state_from_hf, state_to_hf, to_hf
from .torch_mha import from_torch


__all__ = [
    "from_torch", "from_hf", "to_hf", "hf_family", "state_from_hf", "state_to_hf",
    "load_safetensors", "load_state", "interleaved_to_half", "half_to_interleaved", "PICKLE_SUFFIXES",
]
