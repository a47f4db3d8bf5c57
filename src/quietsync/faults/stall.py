"""A replica group whose main thread has stalled while the others wait for it leaves, so that it restarts and heals.

A replica group can hang with its heartbeats still going: its main thread is stuck (a data loader, a file system,
a deadlock in user code) while its torchft Manager's thread still heartbeats. The Lighthouse then keeps it in every
quorum, and the others wait for it, either at a collective (they meet in the quorum's store:
:mod:`~quietsync.faults.meeting`) or at a round start (their quorum request waits for it). Left at that, with three or
more replica groups a majority would leave it behind once the unit's patience has passed
(:mod:`~quietsync.faults.quorum`), but its process would live on and the job would never end; with two, neither one
is a majority, and the waiting one would stop.

:class:`StallWatch` is a thread beside the main one. The training loop marks progress at each step, micro-batch and
commit (:meth:`~quietsync.faults.quorum.ReplicaQuorum.progress`), and the protocol's own waits count as progress. The
watch fires when all of these hold:

* the main thread has made no progress for :func:`stall_limit_s` (half the quorum timeout);
* the main thread is outside the protocol's own waits;
* another replica group is waiting for this one: its key for this replica's current unit is in the quorum's store,
  or the Lighthouse holds a quorum request.

It then prints the main thread's stack and one line, and the process exits with status 1. Its launcher restarts it
(the local one up to ``--replica-restarts`` times; on a cluster, the scheduler), and it heals from the others. Its
heartbeats stop when it exits, so the others' next quorum forms without it within the Lighthouse's heartbeat
timeout. That holds for a lone other replica group as well.

The limit is half the quorum timeout because the shortest wait the others make is a round start's quorum request,
which gives up after the quorum timeout. The other half is left for the Lighthouse to find this replica group silent
and form their quorum.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

POLL_S = 0.5
"""How often the watch looks at the main thread's progress (a time read; the store and the Lighthouse are asked only
once the main thread has made no progress for the limit)."""


def stall_limit_s(quorum_timeout_s: float) -> float:
    """How long the main thread may make no progress while another replica group waits for this one: half the quorum
    timeout (module docstring)."""
    return quorum_timeout_s / 2


class StallWatch:
    """The watch thread of one replica worker (module docstring).

    Args:
        limit_s: seconds without progress after which a wait of the others' counts (:func:`stall_limit_s`).
        waiting: who waits for this replica group, asked once the limit has passed: a few words naming them, or
            None when nobody does.
        describe: the one line said on leaving, given the seconds without progress and ``waiting``'s words.
        leave: what ends the process (default: flush and ``os._exit(1)``); a test passes its own.
        poll_s: how often the thread looks.
    """

    def __init__(self, limit_s: float, waiting: Callable[[], str | None], describe: Callable[[float, str], str],
                 leave: Callable[[], None] | None = None, poll_s: float = POLL_S, label: str = "") -> None:
        if not limit_s > 0:
            raise ValueError(f"limit_s must be a positive number of seconds, got {limit_s!r}")
        self.limit_s, self.poll_s = float(limit_s), float(poll_s)
        self.label = label
        """Who prints (e.g. ``replica group 1, worker 0``): each line of the stack starts with it, so that the stacks
        of a replica group's workers, written to one stderr at once, can be told apart."""
        self._waiting, self._describe, self._leave = waiting, describe, leave or _exit
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._inside = 0  # protocol waits in progress, on any thread (a communication thread's included)
        self._stop = threading.Event()
        self._main = threading.main_thread()
        self._thread = threading.Thread(target=self._run, name="quietsync-stall-watch", daemon=True)
        self._thread.start()

    def progress(self) -> None:
        """The main thread made progress now."""
        self._last = time.monotonic()

    def inside(self) -> _Inside:
        """A context in which the replica waits in the protocol (a quorum, a collective, a heal): not a stall."""
        return _Inside(self)

    def stalled_s(self) -> float | None:
        """Seconds the main thread has made no progress outside the protocol's waits, or None inside one."""
        with self._lock:
            return None if self._inside else time.monotonic() - self._last

    def check(self) -> bool:
        """Leave if the main thread has stalled past the limit while another replica group waits for it; whether it
        left (the watch thread calls this every ``poll_s``)."""
        stalled = self.stalled_s()
        if stalled is None or stalled < self.limit_s:
            return False
        who = self._waiting()
        if who is None or self.stalled_s() is None:  # nobody waits, or the main thread entered a wait meanwhile
            return False
        frame = sys._current_frames().get(self._main.ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(not found)\n"
        if self.label:
            stack = "".join(f"[{self.label}] {line}\n" for line in stack.splitlines())
        print(f"quietsync: the main thread's stack, stalled for {stalled:.0f}s:\n{stack}{self._describe(stalled, who)}",
              file=sys.stderr, flush=True)
        self._leave()
        return True

    def close(self) -> None:
        """Stop watching (the run is over, or the replica is shutting down)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if self.check():
                    return
            except Exception as e:  # noqa: BLE001 - a watch that fails must not take the replica with it
                print(f"quietsync: the stall watch stopped: {e!r}", file=sys.stderr, flush=True)
                return


class _Inside:
    """:meth:`StallWatch.inside`'s context (re-entrant, any thread)."""

    def __init__(self, watch: StallWatch) -> None:
        self._watch = watch

    def __enter__(self) -> None:
        with self._watch._lock:
            self._watch._inside += 1

    def __exit__(self, *exc: object) -> None:
        with self._watch._lock:
            self._watch._inside -= 1
            self._watch._last = time.monotonic()  # coming back from a wait is progress


def _exit() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # the main thread is stuck: no exception can reach it


__all__ = ["POLL_S", "StallWatch", "stall_limit_s"]
