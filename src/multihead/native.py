"""``multihead.native``: the compiled CPU kernels; the code lives in :mod:`multihead.backends.native`.

This name is the same module object as :mod:`multihead.backends.native`.
"""

import sys

from .backends import native as _native

sys.modules[__name__] = _native
