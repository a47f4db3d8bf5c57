"""Step accounting: what one committed step cost this worker in time and bytes (a part every strategy holds).

Time on the main thread is split into

* ``compute_s`` — between strategy calls and inside ``backward`` (forward, backward, data loading, a simulated
  slow worker's sleep) plus main-thread work inside ``step`` that a strategy reports (:meth:`add_compute`);
* ``idle_s`` — blocked on communication (a strategy wraps such waits in :meth:`idle`).

``comm_s`` (the seconds collectives took, on any thread) and the bytes come from the transport's meter,
diffed between two commits. :meth:`close_step` turns the running totals into a :class:`StepMetrics`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ...events import diff_snapshots
from ...transport import Transport


@dataclasses.dataclass
class StepMetrics:
    """What one committed step cost on this worker."""

    step: int
    """Committed steps so far, this one included."""
    micro_batches: int
    """Micro-batches this worker computed for this step."""
    compute_s: float
    """Main-thread seconds spent computing (forward, backward, data, optimizer on the main thread)."""
    comm_s: float
    """Seconds this worker's collectives took (on any thread, emulated link time included)."""
    idle_s: float
    """Main-thread seconds spent blocked on communication."""
    bytes_sent: int
    """Bytes this worker sent during the step (all groups)."""
    bytes_recv: int
    """Bytes this worker received during the step (all groups)."""
    bytes_by_group: dict[str, dict[str, int]]
    """``{group: {"sent": ..., "recv": ...}}``."""
    lr: float = 0.0
    """Learning rate of the first parameter group at this step."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Strategy-specific numbers (e.g. ACCO's micro-batches per worker)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class StepAccounting:
    """Running compute/idle time and micro-batch count of the current step, closed at each commit."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.reset()

    def reset(self, snapshot: dict[str, dict[str, float]] | None = None) -> None:
        """Start a new step (e.g. after set-up traffic that belongs to no step)."""
        self._meter_mark = snapshot if snapshot is not None else self.transport.meter.snapshot()
        self.compute_s = 0.0
        self.idle_s = 0.0
        self.micro_batches = 0
        self.mark = time.perf_counter()

    # ------------------------------------------------------------------ main-thread time
    def lap(self) -> float:
        """Count the main-thread time since the last mark as compute; return now (the new mark)."""
        now = time.perf_counter()
        self.compute_s += now - self.mark
        self.mark = now
        return now

    def micro_batch_done(self) -> None:
        """A micro-batch's backward returned: its time is compute, and it counts."""
        t0 = self.mark
        now = self.lap()
        self.transport.recorder.add("compute", "micro_batch", t0, now)
        self.micro_batches += 1

    def add_compute(self, seconds: float) -> None:
        """Count main-thread work done inside ``step`` (e.g. a local optimizer step) as compute."""
        self.compute_s += seconds

    def reclassify_as_idle(self, seconds: float) -> None:
        """Count ``seconds`` already booked as compute as idle instead (an inner strategy's blocking
        collectives, already on the timeline as its own idle spans)."""
        self.idle_s += seconds
        self.compute_s -= seconds

    def move_to_idle(self, seconds: float, end: float, name: str) -> None:
        """Re-book ``seconds`` already counted as compute, ending at ``end``, as idle (blocked on the
        network)."""
        self.idle_s += seconds
        self.compute_s -= seconds
        self.transport.recorder.add("idle", name, end - seconds, end)

    @contextmanager
    def idle(self, name: str = "wait") -> Iterator[None]:
        """Account the enclosed time as the main thread blocked on communication."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.idle_s += t1 - t0
            self.transport.recorder.add("idle", name, t0, t1)

    def timed(self, fn: Callable[[], Any], name: str) -> None:
        """Run ``fn`` on the main thread: the seconds its collectives took count as idle, the rest as
        compute."""
        before = self.transport.meter.snapshot()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        after = self.transport.meter.snapshot()
        comm = sum(v["seconds"] - before.get(g, {}).get("seconds", 0.0) for g, v in after.items())
        # clamp: the meter also counts other threads' collectives, which can exceed fn's own time
        comm = min(max(comm, 0.0), t1 - t0)
        self.idle_s += comm
        if comm > 0:
            self.transport.recorder.add("idle", name, t1 - comm, t1)
        self.add_compute((t1 - t0) - comm)

    # ------------------------------------------------------------------ commit
    def close_step(self, step: int, lr: float, extra: dict[str, Any] | None = None,
                   micro_batches: int | None = None) -> StepMetrics:
        """The metrics of the step that just committed; starts the next step's accounting."""
        snap = self.transport.meter.snapshot()
        delta = diff_snapshots(snap, self._meter_mark)
        by_group = {g: {"sent": int(v["sent"]), "recv": int(v["recv"])} for g, v in delta.items()}
        metrics = StepMetrics(
            step=step,
            micro_batches=self.micro_batches if micro_batches is None else micro_batches,
            compute_s=self.compute_s,
            comm_s=float(sum(v.get("seconds", 0.0) for v in delta.values())),
            idle_s=self.idle_s,
            bytes_sent=sum(v["sent"] for v in by_group.values()),
            bytes_recv=sum(v["recv"] for v in by_group.values()),
            bytes_by_group=by_group,
            lr=lr,
            extra=dict(extra or {}),
        )
        self.reset(snap)  # the same snapshot: no bytes fall between two steps
        return metrics
