"""Former home of the ``"auto"`` router and the projections' GEMM (kept for its public names).

``auto_path``/``AUTO_PATHS``/``AUTO_RULES`` live in :mod:`multihead.backends.auto`;
``linear``/``linears`` in :mod:`multihead.linear`.
"""

from .backends.auto import AUTO_PATHS, AUTO_RULES, auto_path
from .backends.blocked import blocked_attention, decode_attention
from .backends.gemm import onednn_available
from .linear import linear, linears

__all__ = ["linear", "linears", "auto_path", "AUTO_PATHS", "AUTO_RULES", "blocked_attention", "decode_attention",
           "onednn_available"]
