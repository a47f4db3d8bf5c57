"""The replicas' meeting after a collective timed out: a slower replica group is waited for in the quorum's store.

Local methods meet only at outer syncs, so a replica group k times slower reaches a sync (k − 1) rounds after the
others, and the unit's first collective times out at ``--timeout-s`` on the fast ones. Asking the Lighthouse for
the next quorum right then would leave a slower minority out: with three or more replica groups it forms a quorum
without a heartbeating one that has not asked once more than half of them ask and its join timeout passed. So a
replica whose attempt timed out first sets its key in the failed quorum's store and waits for the others' keys
(:func:`meet`), asking the Lighthouse every so often whether they still send heartbeats (a dead or frozen one is
found by its silence); a replica whose attempt failed on a closed connection (the others gave up on the group, or
a member died) sets its key and goes on. They then ask for the next quorum together. Waiting in a collective with a
long timeout of its own instead cannot be abandoned: when the member it waits for is frozen, the group's teardown
waits for that collective to end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

ARRIVED = "quietsync/arrived"
"""The store keys of the meeting: ``ARRIVED/<unit>/<replica group>``."""

POLL_S = 0.05
"""How often a waiting member looks for the others' keys at most (one small store request each time): the first
looks come sooner (from 2 ms, doubling), so a meeting the others have all but reached costs little."""

ALIVE_EVERY_S = 0.25
"""How often a waiting member asks the Lighthouse whether the others still send heartbeats (a dead one's key never
comes: it is found by its silence, within the Lighthouse's heartbeat timeout and this)."""


def meet(store: Any, unit: int, me: int, others: Sequence[int], deadline: float,
         alive: Callable[[], bool] | None = None, alive_every_s: float = ALIVE_EVERY_S,
         poll_s: float = POLL_S) -> str | None:
    """Set this replica group's key of ``unit`` in ``store`` and wait for those of ``others``, until ``deadline``
    (``time.monotonic()``), looking at least every ``poll_s`` and asking ``alive()`` after every ``alive_every_s``
    of waiting. Returns None once every other has arrived, else why the meeting ended without them: ``"silent"``
    (``alive()`` said one stopped sending heartbeats), ``"late"`` (the deadline passed) or the store's error (its
    host is gone)."""
    try:
        store.set(f"{ARRIVED}/{unit}/{me}", b"1")
        keys = [f"{ARRIVED}/{unit}/{k}" for k in others]
        asked = time.monotonic()
        pause = min(0.002, poll_s)
        # check() answers at once: a blocking wait() that runs out logs a warning of c10d's at every slice
        while not store.check(keys):
            now = time.monotonic()
            if now >= deadline:
                return "late"
            if now - asked >= alive_every_s:
                if alive is not None and not alive():
                    return "silent"
                asked = time.monotonic()
            time.sleep(min(pause, max(0.0, deadline - now)))
            pause = min(2 * pause, poll_s)
        return None
    except Exception as exc:  # noqa: BLE001 - the store's host died: the unit's collectives will say who
        return str(exc)


def missing(store: Any, unit: int, others: Sequence[int]) -> list[int]:
    """Which of ``others`` have not set their key of ``unit`` in ``store`` (all of them where the store does not
    answer)."""
    try:
        return [k for k in others if not store.check([f"{ARRIVED}/{unit}/{k}"])]
    except Exception:  # noqa: BLE001 - the store's host died: nobody is known to have arrived
        return list(others)


__all__ = ["ALIVE_EVERY_S", "ARRIVED", "POLL_S", "meet", "missing"]
