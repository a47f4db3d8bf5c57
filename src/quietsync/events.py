"""What happened, when, and how many bytes it moved: timed spans for timelines and a byte meter.

Every collective the transport runs is recorded as a :class:`Span` on the ``comm`` lane, and strategies
record ``compute`` and ``idle`` spans of the main thread, so a timeline (and a test) can see whether
computation really ran while the network was busy. The :class:`ByteMeter` counts bytes per group and per
direction from the collective's algorithm (see :mod:`quietsync.link`), not from sniffing sockets, and, for
point-to-point operations (send, recv, exchange), also per peer.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

LANES = ("compute", "comm", "idle")


@dataclass(frozen=True)
class Span:
    """One timed interval on a lane (``perf_counter`` seconds)."""

    lane: str
    name: str
    t0: float
    t1: float
    meta: dict[str, Any] = field(default_factory=dict)
    t_wire: float | None = None
    """For a ``comm`` span under link emulation: when the transfer started being served on the emulated link
    (``perf_counter`` seconds); ``t0 → t_wire`` is time queued behind earlier transfers, ``t_wire → t1`` time
    on the wire. None when unknown (no link emulation, other lanes)."""
    device_s: float | None = None
    """For a ``comm`` span on CUDA: seconds between CUDA events recorded on the issuing stream at issue and at
    completion (device time); None on CPU."""

    @property
    def queued(self) -> float:
        """Seconds queued before the transfer started on the (emulated) wire; 0 when unknown."""
        return 0.0 if self.t_wire is None else max(0.0, min(self.t_wire, self.t1) - self.t0)

    @property
    def duration(self) -> float:
        return self.t1 - self.t0

    def overlaps(self, other: Span) -> float:
        """Seconds during which both spans were open."""
        return max(0.0, min(self.t1, other.t1) - max(self.t0, other.t0))


class EventRecorder:
    """A bounded, thread-safe log of spans.

    Args:
        capacity: spans kept (oldest dropped first).
        enabled: record at all; when off, :meth:`span` costs one branch.
    """

    def __init__(self, capacity: int = 100_000, enabled: bool = True) -> None:
        self.enabled = enabled
        self._spans: deque[Span] = deque(maxlen=capacity)
        self._pending: list[tuple[Span, tuple[Any, Any]]] = []
        self._lock = threading.Lock()

    def add(self, lane: str, name: str, t0: float, t1: float, *, t_wire: float | None = None,
            device_s: float | None = None, device_events: tuple[Any, Any] | None = None, **meta: Any) -> None:
        """Record a span (``t_wire`` and ``device_s``: see :class:`Span`; the rest of the keywords: its meta).

        ``device_events``: a pair of recorded ``torch.cuda.Event`` (timing enabled) whose elapsed time becomes
        the span's ``device_s`` once :meth:`resolve_device_times` runs (reading it earlier would block).
        """
        if self.enabled:
            span = Span(lane, name, t0, t1, meta, t_wire, device_s)
            with self._lock:
                self._spans.append(span)
                if device_events is not None:
                    self._pending.append((span, device_events))

    def resolve_device_times(self) -> int:
        """Fill in ``device_s`` of the spans recorded with CUDA events (synchronising with each end event);
        returns how many were resolved. Call it when the device may block, e.g. at the end of a run."""
        with self._lock:
            pending, self._pending = self._pending, []
            if not pending:
                return 0
            resolved = {}
            for span, (start, end) in pending:
                end.synchronize()  # elapsed_time needs both events completed
                # a copy: Span is frozen; elapsed_time is in milliseconds
                resolved[id(span)] = replace(span, device_s=start.elapsed_time(end) / 1e3)
            # matched by identity, so each copy takes its original's place in the order
            self._spans = deque((resolved.get(id(s), s) for s in self._spans), maxlen=self._spans.maxlen)
            return len(resolved)

    @contextmanager
    def span(self, lane: str, name: str, **meta: Any) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(lane, name, t0, time.perf_counter(), **meta)

    def spans(self, lane: str | None = None, since: float = float("-inf")) -> list[Span]:
        with self._lock:
            return [s for s in self._spans if (lane is None or s.lane == lane) and s.t1 >= since]

    def busy(self, lane: str, since: float = float("-inf"), until: float = float("inf")) -> float:
        """Seconds the lane was busy in ``[since, until]``, overlapping spans merged."""
        total, end = 0.0, float("-inf")
        for s in sorted(self.spans(lane, since), key=lambda s: s.t0):
            t0, t1 = max(s.t0, since, end), min(s.t1, until)  # from the furthest end so far: overlaps count once
            if t1 > t0:
                total += t1 - t0
            end = max(end, min(s.t1, until))
        return total

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._pending.clear()


def label(name: str) -> AbstractContextManager[Any]:
    """``torch.profiler.record_function(name)`` while a torch profiler runs, else a no-op context.

    quietsync labels its phases (``quietsync/forward``, ``quietsync/backward``, ``quietsync/step``,
    ``quietsync/optimizer_step``, ``quietsync/comm/<kind>``, ``quietsync/comm/wait``) so ``torch.profiler``
    shows them. ``record_function`` itself costs about 10 µs per use even with no profiler running; the check
    here costs about 1 µs.
    """
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return nullcontext()


class ByteMeter:
    """Thread-safe counters of bytes sent and received, per group and per collective kind, and per peer for
    point-to-point traffic."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: dict[str, int] = defaultdict(int)
        self._recv: dict[str, int] = defaultdict(int)
        self._by_kind: dict[tuple[str, str], int] = defaultdict(int)
        self._seconds: dict[str, float] = defaultdict(float)
        self._peer_sent: dict[int, int] = defaultdict(int)
        self._peer_recv: dict[int, int] = defaultdict(int)

    def add(self, group: str, kind: str, sent: int, recv: int, seconds: float = 0.0) -> None:
        with self._lock:
            self._sent[group] += sent
            self._recv[group] += recv
            self._by_kind[(group, kind)] += sent
            self._seconds[group] += seconds

    def add_seconds(self, group: str, seconds: float) -> None:
        """Count ``seconds`` of waiting on ``group`` that no completed collective measured (a failed attempt that
        is run again), with no bytes."""
        with self._lock:
            self._seconds[group] += seconds

    def add_peer(self, peer: int, sent: int = 0, recv: int = 0) -> None:
        """Count point-to-point bytes sent to / received from global rank ``peer`` (on top of :meth:`add`)."""
        with self._lock:
            self._peer_sent[peer] += sent
            self._peer_recv[peer] += recv

    def peer_snapshot(self) -> dict[int, dict[str, int]]:
        """``{peer global rank: {"sent": bytes, "recv": bytes}}`` of point-to-point traffic (send, recv,
        exchange); collectives are not attributed to peers."""
        with self._lock:
            peers = set(self._peer_sent) | set(self._peer_recv)
            return {p: {"sent": self._peer_sent[p], "recv": self._peer_recv[p]} for p in sorted(peers)}

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{group: {"sent": bytes, "recv": bytes, "seconds": comm seconds}}``."""
        with self._lock:
            groups = set(self._sent) | set(self._recv)
            return {
                g: {"sent": self._sent[g], "recv": self._recv[g], "seconds": self._seconds[g]} for g in groups
            }

    def by_kind(self) -> dict[str, int]:
        """Bytes sent per ``"group/kind"``."""
        with self._lock:
            return {f"{g}/{k}": v for (g, k), v in self._by_kind.items()}

    @property
    def sent(self) -> int:
        with self._lock:
            return sum(self._sent.values())

    @property
    def recv(self) -> int:
        with self._lock:
            return sum(self._recv.values())

    def reset(self) -> None:
        with self._lock:
            self._sent.clear()
            self._recv.clear()
            self._by_kind.clear()
            self._seconds.clear()
            self._peer_sent.clear()
            self._peer_recv.clear()


def diff_snapshots(new: dict[str, dict[str, float]], old: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per-group difference of two :meth:`ByteMeter.snapshot` results."""
    out = {}
    for g, v in new.items():
        o = old.get(g, {})
        out[g] = {k: v[k] - o.get(k, 0) for k in v}  # 0 for a group that first sent after the old snapshot
    return out
