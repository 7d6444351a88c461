"""``multihead.hf``: run Hugging Face models on multihead (patching, the kernel, the cache).

The code lives in :mod:`multihead.interop.hf_patch` (its wrappers in
:mod:`multihead.interop.hf_wrappers`), :mod:`multihead.interop.hf_kernel`,
:mod:`multihead.interop.hf_cache` and :mod:`multihead.interop.hf_packing`; this module keeps the
short public name ``mh.hf``.
``KVCacheAdapter`` (a transformers ``Cache`` subclass) is built on first access.
"""

from typing import Any

from .interop.hf_kernel import NAME, attention_forward, bool_mask, register
from .interop.hf_packing import PackedPadding, pack_padding, packable
from .interop.hf_patch import PatchedAttention, Route, is_patched, patch, routes, unpatch

__all__ = ["patch", "unpatch", "is_patched", "routes", "Route", "register", "attention_forward", "bool_mask",
           "PatchedAttention", "pack_padding", "packable", "PackedPadding", "NAME",
           "KVCacheAdapter"]  # noqa: F822 - KVCacheAdapter: module __getattr__ (imports transformers)


def __getattr__(name: str) -> Any:
    if name == "KVCacheAdapter":  # a transformers Cache subclass: transformers is imported now
        from .interop import hf_cache
        return hf_cache.KVCacheAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
