"""``torch.nn.MultiheadAttention`` to :class:`~multihead.MultiHeadAttention`.

Notation: B batch, S tokens, E embed_dim, H heads, D head_dim.

``nn.MultiheadAttention`` stores ``in_proj_weight`` [3E, E] (or ``q/k/v_proj_weight``)
and ``out_proj``; it is seq-first (S, B, E) by default and its masks mean True = ignore.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import check_overrides
from ..module import MultiHeadAttention
from .checkpoint import load_state

__all__ = ["from_torch"]


def from_torch(module: nn.Module, **overrides: Any) -> MultiHeadAttention:
    """Convert a ``torch.nn.MultiheadAttention``, copying its weights.

    The layout is carried: the layer takes and returns what the module does, (S, B, E) for
    torch's default ``batch_first=False`` (the layer is built ``batch_first=False``; its
    ``key_mask`` (B, Sk), masks, positions and weights stay batch-first, as torch's
    ``key_padding_mask`` and weights are), (B, S, E) for ``batch_first=True``. Torch masks use
    True = ignore; convert them with :func:`multihead.masks.from_torch_mha` (``key_mask`` is
    ``~key_padding_mask``). ``kdim``/``vdim`` are carried (cross-attention through ``context``,
    which feeds both k_proj and v_proj, so ``key is value``).

    Args:
        module: a ``torch.nn.MultiheadAttention``.
        **overrides: settings the torch module does not have: ``causal``, ``scale``,
            ``window``, ``backend``, ``rope``, ``dropout``.

    Returns:
        a :class:`MultiHeadAttention` on the module's device and dtype, same mode and layout
        (``layer.batch_first == module.batch_first``).

    Raises:
        TypeError: ``module`` is not a ``torch.nn.MultiheadAttention``.
        ValueError: ``add_bias_kv`` or ``add_zero_attn`` (no equivalent), or an
            override that is not a setting.
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
    if module.bias_k is not None or module.add_zero_attn:
        raise ValueError("module has add_bias_kv=True or add_zero_attn=True: extra learned or zero key/value "
                         "slots have no equivalent in multihead")
    e, h = module.embed_dim, module.num_heads
    if module._qkv_same_embed_dim:
        w_q, w_k, w_v = module.in_proj_weight.detach().chunk(3)  # [E, E] each
    else:
        w_q, w_k, w_v = (module.q_proj_weight.detach(), module.k_proj_weight.detach(),
                         module.v_proj_weight.detach())
    state = {"q_proj.weight": w_q, "k_proj.weight": w_k, "v_proj.weight": w_v,
             "o_proj.weight": module.out_proj.weight.detach()}
    bias = module.in_proj_bias is not None
    if bias:
        b_q, b_k, b_v = module.in_proj_bias.detach().chunk(3)
        state.update({"q_proj.bias": b_q, "k_proj.bias": b_k, "v_proj.bias": b_v})
    o_bias = module.out_proj.bias is not None
    if o_bias:
        state["o_proj.bias"] = module.out_proj.bias.detach()
    settings = check_overrides({"dropout": float(module.dropout)}, overrides)
    layer = MultiHeadAttention(e, h, bias=bias, o_bias=o_bias, kdim=module.kdim, vdim=module.vdim,
                               batch_first=bool(module.batch_first), device=w_q.device, dtype=w_q.dtype,
                               **settings)
    load_state(layer, state)
    return layer.train(module.training)


