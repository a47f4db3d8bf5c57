"""``python -m quietsync COMMAND [flags]``: the ``quietsync`` command (:mod:`quietsync.commands.main`)."""

from .commands.main import run

if __name__ == "__main__":
    run()
