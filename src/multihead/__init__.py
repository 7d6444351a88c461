"""multihead: multi-head attention exactly as it is taught, run fast and safely.

    import multihead as mh
    layer = mh.MultiHeadAttention(768, 12, causal=True, rope=mh.RoPE(64))
    y = layer(x)                               # x (B, S, 768) -> (B, S, 768)
    out = mh.attention(q, k, v, causal=True)   # q (B, H, Sq, D), k/v (B, Hkv, Sk, D)

Masks everywhere: bool, **True = may attend** (see :mod:`multihead.masks`). FlexAttention's
interface: ``mh.attention(q, k, v, mask_mod=..., score_mod=..., bias=...)``, block masks built
once with ``mh.BlockMask.from_mask_mod`` (:mod:`multihead.block_mask`, :mod:`multihead.mask_mods`,
:mod:`multihead.score_mods`).

``import multihead`` imports nothing else: each name below is imported on first use (torch and
the layer with ``mh.attention`` or ``mh.MultiHeadAttention``; Hugging Face glue with ``mh.hf``),
so that the ``multihead`` command starts at once and a program pays for what it uses. The
``torch.ops.multihead.*`` operators are registered with the kernels (``mh.attention``,
``mh.native`` or ``import multihead.backends.native``): import one of them before loading a
``torch.export`` program that calls them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Each public class and function, and the module it lives in.
_NAMES = {
    "attention": ".functional",
    "MultiHeadAttention": ".module", "split_heads": ".module", "merge_heads": ".module",
    "MultiHeadLatentAttention": ".latent", "LatentCache": ".latent",
    "RoPE": ".rope", "interleaved_to_half": ".rope", "half_to_interleaved": ".rope", "MRoPE": ".mrope",
    "RopeScaling": ".rope_scaling",
    "KVCache": ".cache",
    "Structure": ".masks",
    "BlockMask": ".block_mask", "create_block_mask": ".block_mask",
    "AttentionConfig": ".config",
    "trace": ".tools.trace", "Trace": ".tools.trace",
    "cost": ".tools.cost", "Cost": ".tools.cost",
    "auto_threads": ".threads", "AutoThreads": ".threads",
}
#: Each public module, by the name it has here.
_MODULES = {
    "backends": ".backends", "native": ".backends.native", "masks": ".masks", "rope": ".rope",
    "block_mask": ".block_mask", "mask_mods": ".mask_mods", "score_mods": ".score_mods",
    "reference": ".reference",
    "logits": ".logits", "decode": ".decode", "interop": ".interop", "hf": ".hf", "models": ".tools.models",
    "bench": ".tools.bench", "cli": ".tools.cli", "heads": ".heads", "parallel": ".parallel", "embed": ".tools.embed",
    "threads": ".threads",
}

__all__ = [
    "attention", "MultiHeadAttention", "MultiHeadLatentAttention", "LatentCache", "RoPE", "MRoPE", "RopeScaling",
    "KVCache",
    "trace", "Trace", "split_heads", "merge_heads", "interleaved_to_half", "half_to_interleaved", "masks",
    "logits", "Structure", "backends", "decode", "native", "reference", "AttentionConfig", "cost", "Cost",
    "interop", "hf", "models", "heads", "parallel", "embed", "BlockMask", "create_block_mask", "block_mask",
    "mask_mods", "score_mods", "auto_threads", "AutoThreads", "threads",
]


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported on first use (then kept here)."""
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name], __name__)
    elif name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name], __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and editors see: the core's names, eagerly (not the tools')
    from . import backends, block_mask, decode, interop, logits, mask_mods, masks, reference, score_mods  # noqa: F401
    from .backends import native  # noqa: F401
    from .block_mask import BlockMask, create_block_mask  # noqa: F401
    from .cache import KVCache  # noqa: F401
    from .config import AttentionConfig  # noqa: F401
    from .functional import attention  # noqa: F401
    from .latent import LatentCache, MultiHeadLatentAttention  # noqa: F401
    from .masks import Structure  # noqa: F401
    from .module import MultiHeadAttention, merge_heads, split_heads  # noqa: F401
    from .mrope import MRoPE  # noqa: F401
    from .rope import RoPE, half_to_interleaved, interleaved_to_half  # noqa: F401
    from .rope_scaling import RopeScaling  # noqa: F401
    from .threads import AutoThreads, auto_threads  # noqa: F401
    from .tools.cost import Cost, cost  # noqa: F401
    from .tools.trace import Trace, trace  # noqa: F401
