"""Imported by the local workers' forkserver only, first of its imports
(:data:`quietsync.cli.launch.FORKSERVER_PRELOAD`): the forkserver, which holds torch while its launcher runs, ends
without the interpreter's teardown (:mod:`quietsync.cli.exit`). Its workers are unaffected: multiprocessing ends a
forked worker with ``os._exit``.

Registered before torch's imports, the exit runs after their ``atexit`` handlers (last in, first out). Only the two
registered when the forkserver started are skipped: multiprocessing's (the forkserver has no children or
finalizers of its own: it forks workers and their launcher owns the socket's folder) and logging's flush (it logs
nothing)."""

from __future__ import annotations

import atexit

from .exit import end

atexit.register(end, 0)
