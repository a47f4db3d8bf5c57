"""Deterministic failures for tests and benchmarks: a replica process kills itself (``SIGKILL``, as ``kill -9``
does: no clean-up, its connections closed by the kernel) at a named point of the torchft protocol.

``QUIETSYNC_FT_KILL=POINT:N`` in a replica process's environment kills it the N-th time it reaches ``POINT``:

* ``exchange`` -- inside a collective over the replicas, after it was issued on the peers' side (they are waiting
  in it: "mid-step" for ddp/zero1/demo, "mid-outer-sync" for localsgd/diloco);
* ``heal_send`` -- while sending its state to a replica that heals from it (after the length, before the bytes);
* ``step`` -- after the N-th step's micro-batches were computed, before its exchange.

Nothing happens without the variable (one dictionary lookup per point).
"""

from __future__ import annotations

import os
import signal

KILL_ENV = "QUIETSYNC_FT_KILL"
POINTS = ("exchange", "heal_send", "step")

_counts: dict[str, int] = {}


def _target() -> tuple[str, int] | None:
    spec = os.environ.get(KILL_ENV, "")
    if not spec:
        return None
    point, _, count = spec.partition(":")
    if point not in POINTS or not count.isdigit() or int(count) < 1:
        raise ValueError(f"{KILL_ENV} must be POINT:N with POINT in {', '.join(POINTS)} and N >= 1, got {spec!r}")
    return point, int(count)


def reached(point: str) -> None:
    """Count ``point``; if it is the configured one, the N-th time, die at once with SIGKILL."""
    target = _target()
    if target is None or target[0] != point:
        return
    _counts[point] = _counts.get(point, 0) + 1
    if _counts[point] == target[1]:
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["KILL_ENV", "POINTS", "reached"]
