"""The replicas' meeting before a unit: a slower replica group is waited for in the quorum's store, not in a collective.

Local methods meet only at outer syncs, so a replica group k times slower reaches a sync (k − 1) rounds after the
others. Waiting for it inside a collective has two costs. A collective times out at ``--timeout-s``, after which the
waiting replicas ask the Lighthouse for a quorum, and with three or more replica groups the Lighthouse forms one
without a heartbeating minority once its join timeout passes. And a collective issued with a longer timeout of its
own cannot be abandoned: when the peer it waits for is frozen (its connections open, its heartbeats stopped), the
group's teardown waits for that collective to end. So before a unit's collectives every member sets a key of its own
in the quorum's store and waits for the others' keys (:func:`meet`), asking the Lighthouse every second whether the
others still send heartbeats (a dead or frozen one is found by its silence). The unit's collectives then start
together and keep ``--timeout-s``. Nothing is left pending when a member turns out to be gone: the unit's
collectives find it, as before, and the unit runs again among the survivors. Only a unit whose round-based patience
(9 of the replica's rounds) exceeds ``--timeout-s`` meets first: a shorter lag is the collectives' own wait.
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

ALIVE_EVERY_S = 1.0
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


__all__ = ["ALIVE_EVERY_S", "ARRIVED", "POLL_S", "meet"]
