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
"""

from __future__ import annotations

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
    _tx_free_at: float = field(default=0.0, init=False, repr=False)
    _rx_free_at: float = field(default=0.0, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if self.latency < 0:
            raise ValueError(f"latency must be >= 0 s, got {self.latency}")

    def time(self, kind: str, nbytes: int, n: int) -> float:
        """Modeled seconds for one collective (0 for a group of one)."""
        messages, sent = traffic(kind, nbytes, n)
        return messages * self.latency + sent / self.bandwidth

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
        """Parse ``"100mbit,5ms"`` (bandwidth, optional latency)."""
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if not 1 <= len(parts) <= 2:
            raise ValueError(f"link must look like '100mbit,5ms', got {spec!r}")
        bw = _parse_quantity(parts[0], _RATE_UNITS, "bandwidth", "100mbit, 10gbit, 50MB")
        lat = _parse_quantity(parts[1], _TIME_UNITS, "latency", "5ms, 50us, 0.1s") if len(parts) == 2 else 0.0
        return cls(bw, lat)

    def __str__(self) -> str:
        return f"{self.bandwidth * 8 / 1e6:g}mbit,{self.latency * 1e3:g}ms"


def parse_links(specs: Iterable[str]) -> dict[str, LinkModel]:
    """Parse repeated ``--link NAME=BANDWIDTH[,LATENCY]`` values into ``{name: LinkModel}``."""
    links: dict[str, LinkModel] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        name = name.strip()
        if not sep or name not in LINK_NAMES:
            raise ValueError(
                f"--link must look like 'inter=100mbit,5ms' with a name in {LINK_NAMES}, got {spec!r}"
            )
        if name in links:
            raise ValueError(f"--link {name} given twice")
        links[name] = LinkModel.parse(rest)
    return links


def _parse_quantity(text: str, units: dict[str, float], what: str, examples: str) -> float:
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-zA-Z]+)", text.strip())
    unit = m.group(2) if m else ""
    if not m or (unit not in units and unit.lower() not in units):
        raise ValueError(f"{what} must be a number with a unit (e.g. {examples}), got {text!r}")
    scale = units[unit] if unit in units else units[unit.lower()]
    value = float(m.group(1)) * scale
    if what == "bandwidth" and value <= 0:
        raise ValueError(f"bandwidth must be > 0, got {text!r}")
    return value
