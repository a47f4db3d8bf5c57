"""``python -m quietsync.gpu_check``: see :mod:`quietsync.gpu_check.cli`."""

import sys

from .cli import main

sys.exit(main())
