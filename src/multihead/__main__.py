"""``python -m multihead`` is the ``multihead`` command."""

import sys

from .cli import main

sys.exit(main())
