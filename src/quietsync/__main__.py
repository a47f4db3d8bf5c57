"""``python -m quietsync COMMAND [flags]``: the ``quietsync`` command (:mod:`quietsync.commands.main`)."""

import sys

from .commands.main import main

if __name__ == "__main__":
    sys.exit(main())
