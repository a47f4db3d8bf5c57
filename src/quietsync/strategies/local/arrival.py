"""Late is not dead: before an outer sync, a worker waits for slower ones as long as a round of theirs can take.

Local SGD and DiLoCo meet only at outer syncs, so a worker ``k`` times slower than the fastest reaches a sync
``(k - 1)`` rounds of the fastest's compute after it: 100 s at H = 500, 1-s steps and k = 1.2. A collective's
timeout (``--timeout-s``) is there to catch a worker that died or hangs; counted against that lag, it stopped a
run whose workers were merely uneven. So every worker first *meets* the others (:meth:`Transport.meet`, one
collective with its own timeout), with a patience of ``max(--timeout-s, SYNC_PATIENCE x`` its own seconds since
the workers last met``)`` -- a peer may take up to ``1 + SYNC_PATIENCE`` times this worker's round -- and then
runs the sync's collectives, which start together and keep ``--timeout-s``. The wait is idle time
(``sync_arrival``). A sync in flight behind ``overlap_delay`` inner steps (Streaming DiLoCo) meets on its
communication thread, so those steps still hide the wait. With ``inner_steps = adaptive`` (docs/local.md) the
slower workers take fewer inner steps and the lag all but goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from ...transport import Transport

SYNC_PATIENCE = 9.0
"""How many of its own rounds a worker waits at an outer sync for a slower peer (beyond ``--timeout-s``) before it
takes that peer for dead: a peer up to 10x slower is waited for (a shared machine's load moves a 4x slower worker
past 5x); a hung one is found after that many rounds, a dead one at once (its connections close)."""


def sync_patience(floor_s: float, round_s: float) -> float:
    """How long to wait at a sync for slower peers: ``floor_s`` (the collectives' or the quorum's timeout), or
    ``SYNC_PATIENCE`` rounds of ``round_s`` where that is longer."""
    return max(floor_s, SYNC_PATIENCE * round_s)


class Arrival:
    """The meeting before each outer sync of one local strategy's workers (module docstring)."""

    def __init__(self, transport: Transport, group: str | None = None) -> None:
        """``group``: the sync group, whose gloo twin a sync launched on a communication thread meets on."""
        self.transport = transport
        self.since = time.perf_counter()
        """When this worker left its last meeting (or was built): its round is timed from there."""
        # now, while every worker is here: created at a first sync it would wait for the others itself
        transport.ready_control(group)

    def patience_s(self) -> float:
        """How long this worker waits at the coming sync."""
        return sync_patience(self.transport.timeout_s, time.perf_counter() - self.since)

    def meet(self, idle: Callable[[str], AbstractContextManager[None]]) -> None:
        """Wait for every worker to reach this sync (at most :meth:`patience_s`), the wait booked by ``idle``."""
        patience = self.patience_s()
        with idle("sync_arrival"):
            self.transport.meet(patience)
        self.since = time.perf_counter()

    def joined(self) -> None:
        """A sync in flight (met on its communication thread) finished: every worker was there, so this worker's
        round restarts."""
        self.since = time.perf_counter()
