"""``python -m multihead`` is the ``multihead`` command."""

import sys

from .tools.cli import main

sys.exit(main())
