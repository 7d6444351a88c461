"""multihead: multi-head attention exactly as it is taught, run fast and safely.

    import multihead as mh
    layer = mh.MultiHeadAttention(768, 12, causal=True, rope=mh.RoPE(64))
    y = layer(x)                               # x (B, S, 768) -> (B, S, 768)
    out = mh.attention(q, k, v, causal=True)   # q (B, H, Sq, D), k/v (B, Hkv, Sk, D)

Masks everywhere: bool, **True = may attend** (see :mod:`multihead.masks`).
"""

from typing import Any

from . import backends, masks, reference
from .backends import native
from .cache import KVCache
from .config import AttentionConfig
from .functional import attention
from .masks import Structure
from .module import MultiHeadAttention, merge_heads, split_heads
from .latent import LatentCache, MultiHeadLatentAttention
from .rope import RoPE, half_to_interleaved, interleaved_to_half
from .rope_scaling import RopeScaling
from . import logits
from . import decode, interop  # noqa: E402  (they build on the module)
from .tools.cost import Cost, cost
from .tools.trace import Trace, trace

__version__ = "0.1.0"

__all__ = [
    "attention",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "LatentCache",
    "RoPE",
    "RopeScaling",
    "KVCache",
    "trace",
    "Trace",
    "split_heads",
    "merge_heads",
    "interleaved_to_half",
    "half_to_interleaved",
    "masks",
    "logits",
    "Structure",
    "backends",
    "decode",
    "native",
    "reference",
    "AttentionConfig",
    "cost",
    "Cost",
    "interop",
    "hf",
    "models",
    "heads",
    "parallel",
]

# Hugging Face glue, the tools, the heads toolkit and torch.distributed (parallel), imported on
# first use (they import transformers only inside functions; lazy keeps ``import multihead`` to the core).
_LAZY = {"hf": ".hf", "models": ".tools.models", "bench": ".tools.bench", "cli": ".tools.cli", "heads": ".heads",
         "parallel": ".parallel"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return importlib.import_module(_LAZY[name], __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
