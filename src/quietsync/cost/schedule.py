"""A strategy's step for the cost model: its transfers, its timeline and its memory (:class:`Schedule`).

Each strategy family writes a function ``f(workload, topology, config) -> Schedule`` beside the strategy (its
``cost.py``) and registers it with the strategy; the planner evaluates the timeline (a
:class:`~quietsync.cost.terms.Term`) and the tests hold the transfers' bytes to the transport's meter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..link import LINK_NAMES
from ..topology import Topology
from .costmodel import Comm
from .terms import Term


@dataclass(frozen=True)
class Schedule:
    """A strategy's step, for the cost model: transfers with sizes, the timeline, memory per worker."""

    strategy: str
    """Registered strategy name."""
    label: str
    """The knob setting, for tables (``diloco H=64 F=4``)."""
    comms: tuple[Comm, ...]
    """Every transfer of this worker over one period."""
    step: Term
    """The timeline of one step, averaged over the period."""
    memory: dict[str, int]
    """Bytes this worker holds per buffer (as the strategy's ``memory_report()`` names them) between steps."""
    period: int = 1
    """Steps after which the transfer pattern repeats."""
    notes: tuple[str, ...] = ()
    """What the model assumes beyond the timeline (for the report)."""
    config: Any = None
    """The strategy config the schedule was derived from."""

    def bytes_at(self, step: int, topo: Topology) -> dict[str, dict[str, int]]:
        """``{group: {"sent", "recv"}}`` of worker ``topo.rank`` at (1-based) step ``step``."""
        out: dict[str, dict[str, int]] = {}
        for c in self.comms:
            if not c.runs_at(step, self.period):
                continue
            s, r = c.bytes(topo)
            g = out.setdefault(c.group, {"sent": 0, "recv": 0})
            g["sent"] += s * c.count
            g["recv"] += r * c.count
        return out

    def bytes_per_step(self, topo: Topology) -> dict[str, dict[str, float]]:
        """Mean ``{group: {"sent", "recv"}}`` per step over the period."""
        out: dict[str, dict[str, float]] = {}
        for c in self.comms:
            s, r = c.bytes(topo)
            k = c.per_period(self.period) / self.period
            g = out.setdefault(c.group, {"sent": 0.0, "recv": 0.0})
            g["sent"] += s * k
            g["recv"] += r * k
        return out

    def bytes_per_link(self, topo: Topology) -> dict[str, float]:
        """Mean bytes this worker sends per step on each link kind."""
        out = {k: 0.0 for k in LINK_NAMES}
        for c in self.comms:
            s, _ = c.bytes(topo)
            out[c.link(topo)] += s * c.per_period(self.period) / self.period
        return out
