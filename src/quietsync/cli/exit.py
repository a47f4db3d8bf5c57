"""Ending a command's process without the interpreter's teardown.

Once torch is loaded, Python's teardown (every module's objects collected, then libtorch's static destructors) costs
about a CPU-second (0.7-2.5 measured), and as much wall time after a command has printed its last line. Nothing a
command leaves depends on it: :func:`exit_now` does what a normal exit does first -- non-daemon threads joined,
``atexit`` handlers run, stdout and stderr flushed -- and ends the process there. The local workers' forkserver,
which holds torch for as long as the launcher runs, ends the same way (:mod:`quietsync.cli.forkserver_exit`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int | str | None) -> NoReturn:
    """End this process with ``code`` (``sys.exit``'s meaning: None is 0, a string is printed and gives 1) after
    the first steps of a normal exit, skipping the rest (module docstring)."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    # what Py_FinalizeEx does before the teardown: wait for non-daemon threads (running the callbacks that stop
    # executors' threads first), then the atexit handlers
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    end(0 if code is None else int(code))


def end(code: int) -> NoReturn:
    """Flush stdout and stderr and end the process with ``code`` at once (no handlers, no teardown)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or replaced by something without a flush
            pass
    os._exit(code)
