"""``multihead.hf``: run Hugging Face models on multihead (patching, and the kernel).

The code lives in :mod:`multihead.interop.hf_patch` and :mod:`multihead.interop.hf_kernel`;
this module keeps the short public name ``mh.hf``.
"""

from .interop.hf_kernel import NAME, attention_forward, bool_mask, register
from .interop.hf_patch import PatchedAttention, is_patched, patch, unpatch

__all__ = ["patch", "unpatch", "is_patched", "register", "attention_forward", "bool_mask", "PatchedAttention",
           "NAME"]
