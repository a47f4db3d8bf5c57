"""Alpha-beta model of a network link, and how collectives map onto it.

A **link** has a bandwidth β (bytes/s) and a per-message latency α (s). A collective over ``n`` workers
takes, with the ring algorithms NCCL and gloo use for large buffers:

=================  =====================  ======================================
collective         messages on the path   bytes each worker sends (and receives)
=================  =====================  ======================================
all-reduce         2(n−1)                 2(n−1)/n · B   (B = the whole buffer)
reduce-scatter     n−1                    (n−1)/n · B    (B = the unscattered input)
all-gather         n−1                    (n−1)/n · B    (B = the gathered output)
broadcast (chain)  n−1                    B (every worker but the last forwards it)
send / recv        1                      B (sent, or received)
=================  =====================  ======================================

so the modeled time is ``messages·α + bytes/β``. The transport stretches each real operation to at least
this time.

**A link is one worker's network interface, full duplex.** A :class:`LinkModel` has a transmit queue and a
receive queue, each FIFO (serial): transfers booked on the same queue wait for each other like on a real wire,
transfers on different queues overlap. A ``send`` books the transmit queue, a ``recv`` the receive queue, and
a point-to-point *exchange* (send B to one peer while receiving B from another) books both at once, so it
takes B/β, not 2B/β. A collective moves the same ring traffic in both directions at every step, so it books
both queues for its whole modeled time: back-to-back collectives queue behind each other and also behind
(or in front of) any send or receive.

Each process holds one link object per kind (``inter``: to workers of other nodes, ``intra``: to workers of
its own node); the transport picks the kind per operation: a collective uses ``inter`` iff its group spans
nodes, a point-to-point operation uses the kind of the peer (its node against this worker's). Modeling both
kinds as separate interfaces means an intra-node copy never queues behind inter-node traffic.

Spelled on the command line as ``inter=100mbit,5ms`` or ``intra=10gbit,0.05ms``.

**A link may change during the run** (a schedule): ``inter=100mbit@0s,10mbit@60s,100mbit@120s`` -- each entry is a
link spelled as above followed by ``@TIME``, the first at ``@0s``, times strictly increasing; an entry without a
latency keeps the previous one's. At ``t`` seconds since the run's clock started (:meth:`LinkModel.start_clock`;
the transport starts it on every worker at the same moment: ``Transport.start_link_clocks``), the link
has the rate and latency of the last entry at or before ``t``. A transfer pays the latency in force when it starts
being served, then its bytes drain at whatever rate is in force second by second: a transfer that straddles a
change is served partly at the old rate and partly at the new one, as on a real wire whose shaper is changed.

**One collective, one moment.** A collective on a scheduled link starts being served when the *last* of its
workers is ready (has issued it and has its link's queues free): the transport takes the largest of the
workers' ready times on the run's clock (``Transport.latest_in``, one tiny gloo all-reduce per collective, on
scheduled links only, so issuing a collective there, even an asynchronous one, waits until the group's other
workers issue it), and every worker books the collective from that moment. So all ends charge the same
rates over the same stretch and end at the same moment, whichever side of a change each worker reached it
on (unless another thread of one worker books the same link in between: that worker then starts it later).
A steady link needs no such agreement (its rate does not depend on the moment); a point-to-point
transfer is still timed by each end from its own ready time.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

LINK_NAMES = ("inter", "intra")
"""``inter``: collectives whose group spans several nodes and point-to-point traffic with a worker of another
node; ``intra``: collectives inside one node and point-to-point traffic with a worker of the same node."""

_RATE_UNITS = {
    "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
    "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9,
    "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_AT_UNITS = {**_TIME_UNITS, "min": 60.0, "h": 3600.0}
_SCHEDULE_FORM = "BW[,LAT]@TIME entries, the first @0s, times increasing (e.g. 'inter=100mbit,5ms@0s,10mbit@60s')"


@dataclass(frozen=True)
class LinkRate:
    """One entry of a link schedule: from ``at_s`` seconds on (the run's clock), this bandwidth and latency."""

    at_s: float
    """Seconds since the run's clock started (:meth:`LinkModel.start_clock`)."""
    bandwidth: float
    """Bytes per second (> 0)."""
    latency: float
    """Seconds per message."""


def traffic(kind: str, nbytes: int, n: int) -> tuple[int, int]:
    """``(messages on the critical path, bytes sent by each worker)`` for a collective.

    Args:
        kind: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``, ``send`` or ``recv``.
        nbytes: ``B`` in the table of the module docstring.
        n: number of workers in the group.
    """
    if n <= 1:
        return 0, 0
    if kind == "all_reduce":
        return 2 * (n - 1), (2 * (n - 1) * nbytes) // n
    if kind in ("reduce_scatter", "all_gather"):
        return n - 1, ((n - 1) * nbytes) // n
    if kind == "broadcast":
        return n - 1, nbytes
    if kind in ("send", "recv"):
        return 1, nbytes
    raise ValueError(f"unknown collective kind {kind!r}")


@dataclass
class LinkModel:
    """A full-duplex link with bandwidth and latency: a FIFO transmit queue and a FIFO receive queue.

    Thread-safe. The bandwidth holds in each direction (a 100 Mbit/s link sends 100 Mbit/s while it
    receives 100 Mbit/s).
    """

    bandwidth: float
    """Bytes per second."""
    latency: float = 0.0
    """Seconds per message (α)."""
    changes: tuple[LinkRate, ...] = ()
    """Later entries of a schedule (``at_s`` > 0, increasing); ``bandwidth`` and ``latency`` are the rate from 0 s.
    Empty: a steady link."""
    _epoch: float | None = field(default=None, init=False, repr=False, compare=False)
    _tx_free_at: float = field(default=0.0, init=False, repr=False)
    _rx_free_at: float = field(default=0.0, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:  # spelled 'not > 0' so that NaN is refused too
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.latency < 0:
            raise ValueError(f"latency must be >= 0 s, got {self.latency}")
        prev = 0.0
        for c in self.changes:
            if not c.at_s > prev:
                raise ValueError(f"schedule times must increase from 0 s, got {c.at_s:g} s after {prev:g} s")
            if not c.bandwidth > 0 or c.latency < 0:
                raise ValueError(f"schedule entry at {c.at_s:g} s needs bandwidth > 0 and latency >= 0, got {c}")
            prev = c.at_s

    # ------------------------------------------------------------------ the schedule's clock
    @property
    def scheduled(self) -> bool:
        """Whether the rate changes during the run."""
        return bool(self.changes)

    def start_clock(self, epoch: float) -> None:
        """Set the run's ``t = 0`` to ``epoch`` (``perf_counter`` seconds of this process)."""
        self._epoch = float(epoch)

    @property
    def epoch(self) -> float | None:
        """``perf_counter`` seconds of the run's ``t = 0`` in this process; None before :meth:`start_clock`."""
        return self._epoch

    def rates(self) -> tuple[LinkRate, ...]:
        """The whole schedule, the ``0 s`` entry first (one entry for a steady link)."""
        return (LinkRate(0.0, self.bandwidth, self.latency), *self.changes)

    def rate_at(self, t: float) -> LinkRate:
        """The entry in force at ``t`` seconds on the run's clock (the first one before 0)."""
        current = LinkRate(0.0, self.bandwidth, self.latency)
        for c in self.changes:
            if c.at_s > t:
                break
            current = c
        return current

    def _since_start(self, now: float) -> float:
        if not self.changes:  # a steady link's rate does not depend on the clock, so it need not be started
            return 0.0
        if self._epoch is None:
            raise RuntimeError("a link with a schedule needs its clock started (LinkModel.start_clock) before a "
                               "transfer is booked on it")
        return now - self._epoch

    def _drain(self, t: float, nbytes: float) -> float:
        """Seconds (on the run's clock, from ``t``) until ``nbytes`` have gone through at the scheduled rates."""
        rates = self.rates()
        i = max(k for k, r in enumerate(rates) if r.at_s <= max(t, 0.0))  # before 0 s the first entry applies
        clock, left = t, float(nbytes)
        while True:
            bw = rates[i].bandwidth
            seg_end = rates[i + 1].at_s if i + 1 < len(rates) else math.inf
            can = (seg_end - clock) * bw
            if left <= can:
                return clock + left / bw - t
            left -= can
            clock, i = seg_end, i + 1

    def time(self, kind: str, nbytes: int, n: int, at: float | None = None) -> float:
        """Modeled seconds for one collective (0 for a group of one) on an idle link: at the ``0 s`` rate, or for a
        scheduled link started at ``at`` seconds on the run's clock (following the schedule's changes)."""
        messages, sent = traffic(kind, nbytes, n)
        if at is None or not self.changes:
            return messages * self.latency + sent / self.bandwidth
        # the latency in force at the start; the bytes drain only after it, at the rates in force from then on
        alpha = messages * self.rate_at(at).latency
        return alpha + self._drain(at + alpha, sent)

    def ready_at(self, start: float, tx: bool = True, rx: bool = True) -> float:
        """``perf_counter`` seconds at which a transfer issued at ``start`` could start being served here: once
        the queues it uses are free (books nothing)."""
        with self._lock:
            return max(start, self._tx_free_at if tx else start, self._rx_free_at if rx else start)

    def book_transfer(self, kind: str, nbytes: int, n: int, start: float | None = None, tx: bool = True,
                      rx: bool = True) -> tuple[float, float]:
        """Book one collective (or a send/recv: ``kind``, ``nbytes``, ``n`` as :func:`traffic`) on the queues it
        uses; return ``(begin, end)`` in ``perf_counter`` seconds, as :meth:`book`. Its duration is taken at the
        moment it starts being served, so on a scheduled link it follows the rate of that moment and of every
        change until it ends."""
        if not self.changes:
            return self.book(self.time(kind, nbytes, n), start, tx, rx)
        if not (tx or rx):
            raise ValueError("reserve must book at least one of tx and rx")
        now = time.perf_counter() if start is None else start
        with self._lock:
            begin = max(now, self._tx_free_at if tx else now, self._rx_free_at if rx else now)
            # timed from begin, not now: on a schedule the rate depends on when the queues free up
            end = begin + self.time(kind, nbytes, n, at=self._since_start(begin))
            if tx:
                self._tx_free_at = end
            if rx:
                self._rx_free_at = end
            return begin, end

    def reserve(self, seconds: float, start: float | None = None, tx: bool = True, rx: bool = True) -> float:
        """Book ``seconds`` of wire time starting no earlier than ``start``; return the finish time
        (:meth:`book` without the start)."""
        return self.book(seconds, start, tx, rx)[1]

    def book(self, seconds: float, start: float | None = None, tx: bool = True, rx: bool = True
             ) -> tuple[float, float]:
        """Book ``seconds`` of wire time starting no earlier than ``start``; return ``(begin, end)``: when the
        transfer starts being served (after what was queued before it) and when it finishes.

        Args:
            seconds: how long the transfer occupies the queues it books.
            start: earliest start (``perf_counter`` seconds); now by default.
            tx: book the transmit queue (a send; collectives book both).
            rx: book the receive queue (a receive; collectives book both).

        Each queue is FIFO: a transfer booked while another holds one of its queues starts when that one
        ends. A transfer booking both queues starts when both are free and holds both until it ends.
        """
        if not (tx or rx):
            raise ValueError("reserve must book at least one of tx and rx")
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        now = time.perf_counter() if start is None else start
        with self._lock:
            begin = max(now, self._tx_free_at if tx else now, self._rx_free_at if rx else now)
            end = begin + seconds
            if tx:
                self._tx_free_at = end
            if rx:
                self._rx_free_at = end
            return begin, end

    def reset(self) -> None:
        """Forget queued transfers (for tests and benchmarks that reuse a link)."""
        with self._lock:
            self._tx_free_at = self._rx_free_at = 0.0

    @classmethod
    def parse(cls, spec: str) -> LinkModel:
        """Parse ``"100mbit,5ms"`` (bandwidth, optional latency), or a schedule
        ``"100mbit,5ms@0s,10mbit@60s"`` (see the module docstring)."""
        if "@" in spec:
            return cls._parse_schedule(spec)
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if not 1 <= len(parts) <= 2:
            raise ValueError(f"link must look like '100mbit,5ms', got {spec!r}")
        bw = _parse_quantity(parts[0], _RATE_UNITS, "bandwidth", "100mbit, 10gbit, 50MB")
        lat = _parse_quantity(parts[1], _TIME_UNITS, "latency", "5ms, 50us, 0.1s") if len(parts) == 2 else 0.0
        return cls(bw, lat)

    @classmethod
    def _parse_schedule(cls, spec: str) -> LinkModel:
        tokens = [p.strip() for p in spec.split(",")]
        entries: list[list[str]] = [[]]
        for tok in tokens:  # "100mbit", "5ms@0s", "10mbit@60s" -> [["100mbit", "5ms@0s"], ["10mbit@60s"]]
            entries[-1].append(tok)
            if "@" in tok:
                entries.append([])
        if entries[-1] or any(not t for t in tokens):
            raise ValueError(f"schedule must be {_SCHEDULE_FORM}, got {spec!r}")
        rates: list[LinkRate] = []
        latency = 0.0  # carried over: an entry without a latency keeps the previous one's
        for entry in entries[:-1]:
            *rest, last = entry
            value, _, at_text = last.partition("@")
            parts = [*rest, value]
            if not 1 <= len(parts) <= 2 or "@" in at_text:
                raise ValueError(f"schedule entry {','.join(entry)!r} must be BW[,LAT]@TIME; "
                                 f"schedule: {_SCHEDULE_FORM}")
            bw = _parse_quantity(parts[0], _RATE_UNITS, "bandwidth", "100mbit, 10gbit, 50MB")
            if len(parts) == 2:
                latency = _parse_quantity(parts[1], _TIME_UNITS, "latency", "5ms, 50us, 0.1s")
            at = _parse_quantity(at_text, _AT_UNITS, "schedule time", "0s, 60s, 500ms, 2min")
            if not rates and at != 0:
                raise ValueError(f"schedule must start at @0s, got {','.join(entry)!r}; schedule: {_SCHEDULE_FORM}")
            if rates and not at > rates[-1].at_s:
                raise ValueError(f"schedule goes back in time: {','.join(entry)!r} is not after {rates[-1].at_s:g}s; "
                                 f"schedule: {_SCHEDULE_FORM}")
            rates.append(LinkRate(at, bw, latency))
        return cls(rates[0].bandwidth, rates[0].latency, tuple(rates[1:]))

    def __str__(self) -> str:
        def one(r: LinkRate) -> str:
            # four significant digits in the unit a person writes (a measured floor is 4.702gbit,369.1us, not
            # 4702.34mbit,0.369138ms); the text parses back to the same link within that rounding
            mbit, ms = r.bandwidth * 8 / 1e6, r.latency * 1e3
            rate = f"{mbit / 1e3:.4g}gbit" if mbit >= 1e3 else f"{mbit:.4g}mbit"
            delay = f"{ms * 1e3:.4g}us" if 0 < ms < 1 else f"{ms:.4g}ms"
            return f"{rate},{delay}"

        if not self.changes:
            return one(self.rates()[0])
        return ",".join(f"{one(r)}@{r.at_s:g}s" for r in self.rates())


def idle_links(names: Iterable[str], nodes: int, workers_per_node: int) -> list[str]:
    """One line for each link in ``names`` that no traffic of this world crosses: ``inter`` where every worker is on
    one node (e.g. ``torchrun --nnodes 1``), ``intra`` where every node holds one worker; empty where each is used."""
    out = []
    for name in names:
        if name == "inter" and nodes == 1:
            out.append("--link inter emulates the link between nodes, and all workers are on one node here: nothing "
                       "crosses it (give --nodes N to emulate N nodes on this machine)")
        elif name == "intra" and workers_per_node == 1:
            out.append("--link intra emulates the link inside a node, and every node holds one worker here: nothing "
                       "crosses it")
    return out


def parse_links(specs: Iterable[str]) -> dict[str, LinkModel]:
    """Parse repeated ``--link NAME=BANDWIDTH[,LATENCY]`` values into ``{name: LinkModel}``."""
    links: dict[str, LinkModel] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        name = name.strip()
        if not sep or name not in LINK_NAMES:
            raise ValueError(
                f"--link must look like 'inter=100mbit,5ms' (or a schedule 'inter=100mbit@0s,10mbit@60s') with a "
                f"name in {LINK_NAMES}, got {spec!r}"
            )
        if name in links:
            raise ValueError(f"--link {name} given twice")
        try:
            links[name] = LinkModel.parse(rest)
        except ValueError as e:
            if "@" in rest:  # name the argument: a schedule's error is read out of context otherwise
                raise ValueError(f"--link {name}: {e}") from None
            raise
    return links


def _parse_quantity(text: str, units: dict[str, float], what: str, examples: str) -> float:
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-zA-Z]+)", text.strip())
    unit = m.group(2) if m else ""
    if not m or (unit not in units and unit.lower() not in units):
        raise ValueError(f"{what} must be a number with a unit (e.g. {examples}), got {text!r}")
    if what == "bandwidth" and unit.lower() in ("b", "kb", "mb", "gb") and not unit.endswith("B"):
        # a small b means bits to some and bytes to others: 8x either way, so the unit must say which
        prefix = unit[:-1].lower()
        raise ValueError(f"bandwidth {text!r} is ambiguous: write {m.group(1)}{prefix}bit (bits per second) or "
                         f"{m.group(1)}{prefix.upper()}B (bytes per second)")
    scale = units[unit] if unit in units else units[unit.lower()]
    value = float(m.group(1)) * scale
    if what == "bandwidth" and value <= 0:  # the pattern admits 0, and time() divides by the bandwidth
        raise ValueError(f"bandwidth must be > 0, got {text!r}")
    if not math.isfinite(value):  # the pattern admits exponents such as 1e999, which overflow to inf
        raise ValueError(f"{what} must be finite, got {text!r}")
    return value
