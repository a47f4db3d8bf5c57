"""What ``--adapt`` decides from, measured during the run and agreed over the workers (a piece every adapting
strategy holds: DiLoCo's H and bits, DeMo's top-k).

* **The link**: bytes/s of the exchanges completed on the strategy's group since the last decision -- bytes this
  worker sent there over the seconds those transfers took, from the transport's meter (on an emulated link the
  emulation's time, on a real one the wire's).
* **The step**: the median main-thread compute seconds of this worker's last ``window`` steps (one step slowed by
  a neighbour on a shared machine, or the first step's warm-up, moves it little; a worker slower throughout moves
  it all).

The workers agree on both on the transport's control group (the fastest link any worker saw -- a worker that
reached the exchange first also waited for the others, which the slowest-arriving one did not -- and the slowest
worker's step, which a synchronous exchange waits for), so every worker takes the same decision.
:func:`moved` is the hysteresis shared by the controllers: re-pick only when the measured ratio of exchange to
step time moved by more than a threshold since the last pick. :func:`exposed_ratio` prices a fixed setting's cost
schedule on what was measured, the number each controller compares across its candidates.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...cost.compute import ComputeProfile
from ...cost.costmodel import Ctx, Links
from ...cost.schedule import Schedule
from ...link import LinkModel
from ...topology import Topology
from ...validate import check_float, check_int

__all__ = ["Cadence", "check_cadence_knobs", "KnobDecision", "LinkProbe", "moved", "exposed_ratio"]


def exposed_ratio(schedule: Schedule, params: int, accumulation: int, step_s: float, topo: Topology, group: str,
                  link: LinkModel) -> float:
    """Exposed communication / compute per step that ``schedule`` (a fixed setting's, ``params`` parameters)
    predicts with steps of ``step_s`` compute seconds (``accumulation`` micro-batches) and the group's ``link``."""
    # the measured step already holds the optimizer, the codec and the copies: the profile gives them no extra time
    compute = ComputeProfile(forward_s=step_s / max(1, accumulation), backward_s=0.0, optimizer_s_per_element=0.0,
                             elements=params, source="measured during the run")
    kind = "inter" if topo.spans_nodes(group) else "intra"
    c = schedule.step.cost(Ctx(compute, Links(model={kind: link}), topo))
    return c.exposed_comm / c.compute if c.compute > 0 else math.inf  # no compute to hide the exchange behind


class LinkProbe:
    """The link and step measurements of one adapting strategy (module docstring).

    Args:
        transport: the transport (its meter, and its control group for the agreement).
        group: the group whose exchanges measure the link.
        window: steps whose median compute is the step time.
    """

    def __init__(self, transport: Any, group: str, window: int) -> None:
        self.transport, self.group = transport, group
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self._mark = self._meter()

    def _meter(self) -> tuple[float, float]:
        v = self.transport.meter.snapshot().get(self.group, {})
        return float(v.get("sent", 0.0)), float(v.get("seconds", 0.0))

    def step_done(self, compute_s: float) -> None:
        """Count one step of ``compute_s`` main-thread compute seconds."""
        self._recent.append(compute_s)

    def local(self) -> tuple[float, float]:
        """``(bandwidth bytes/s, step seconds)`` as this worker measured them, not agreed: the link over the
        exchanges since the last call (0 when none completed). For a strategy whose workers are not in lockstep
        (ACCO), which agrees on them inside a collective of its own."""
        sent, seconds = self._meter()
        d_sent, d_seconds = sent - self._mark[0], seconds - self._mark[1]
        self._mark = (sent, seconds)
        local_bw = d_sent / d_seconds if d_seconds > 0 and d_sent > 0 else 0.0
        return local_bw, statistics.median(self._recent) if self._recent else 0.0

    def measure(self) -> tuple[float, float]:
        """``(bandwidth bytes/s, step seconds)`` agreed over the workers (a collective on the control group: every
        worker calls it at the same steps), the link over the exchanges since the last call (0 when none
        completed)."""
        local_bw, local_step = self.local()
        return self.transport.agree(local_bw, "max"), self.transport.agree(local_step, "max")


def moved(ratio: float, last: float | None, threshold: float) -> bool:
    """Whether ``ratio`` moved by more than the factor ``1 + threshold`` from ``last`` (None: no pick yet, so
    yes)."""
    # a band symmetric on a log scale: halving the ratio counts as much as doubling it
    return last is None or not 1 / (1 + threshold) <= ratio / last <= 1 + threshold


def check_cadence_knobs(config: Any) -> None:
    """Check the knobs every adapting config has (``adapt_every``, ``adapt_overhead``, ``adapt_threshold``,
    ``adapt_window``); raises ValueError naming the knob and its range."""
    check_int("adapt_every", config.adapt_every, 1)
    check_float("adapt_overhead", config.adapt_overhead, 0, low_open=True)
    check_float("adapt_threshold", config.adapt_threshold, 0)
    check_int("adapt_window", config.adapt_window, 1)


class Cadence:
    """When a controller decides, kept across a resume: every ``every`` events (DiLoCo's syncs, DeMo's exchanges,
    ACCO's rounds), and only when the measured ratio of exchange to compute :func:`moved` by more than ``threshold``
    since the last pick (its reference, :attr:`ratio`). Both are checkpointed with the controller's knob, so a
    resumed run counts to its next decision and compares against the same reference as the unbroken one."""

    def __init__(self, every: int, threshold: float) -> None:
        self.every, self.threshold = int(every), float(threshold)
        self.count = 0
        """Events counted towards the next decision."""
        self.ratio: float | None = None
        """The measured ratio of the last pick (None: no pick yet, so the first decision picks)."""

    def due(self) -> bool:
        """Count one event; True (and the count starts again) when a decision is due."""
        self.count += 1
        if self.count < self.every:
            return False
        self.count = 0
        return True

    def moved(self, ratio: float) -> bool:
        """Whether ``ratio`` moved enough since the last pick to pick again."""
        return moved(ratio, self.ratio, self.threshold)

    def state(self) -> dict[str, Any]:
        return {"count": self.count, "ratio": self.ratio}

    def load(self, state: dict[str, Any]) -> None:
        """From :meth:`state` (a checkpoint written before the cadence was kept has neither: it starts afresh)."""
        self.count, self.ratio = int(state.get("count", 0)), state.get("ratio")

    def logical_state(self) -> dict[str, torch.Tensor]:
        # NaN stands for "no pick yet": a tensor cannot hold None
        return {"adapt.count": torch.tensor(self.count, dtype=torch.int64),
                "adapt.ratio": torch.tensor(math.nan if self.ratio is None else self.ratio, dtype=torch.float64)}

    @staticmethod
    def logical_targets(saved: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {k: torch.zeros((), dtype=dtype) for k, dtype in (("adapt.count", torch.int64),
                                                                  ("adapt.ratio", torch.float64)) if k in saved}

    def load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        if "adapt.count" in filled:
            ratio = float(filled["adapt.ratio"])
            self.count, self.ratio = int(filled["adapt.count"]), None if math.isnan(ratio) else ratio


@dataclass(frozen=True)
class KnobDecision:
    """One decision of a controller that re-picks one whole-number knob (DeMo's top-k, ACCO's cap): logged in the
    step's metrics as ``adapt`` with the keys of DiLoCo's, so the run's plot and reports read them all alike."""

    old: int
    new: int
    bandwidth: float
    """Measured link, bytes/s (agreed over the workers)."""
    step_s: float
    """The measured compute seconds the decision priced (the controller's: a step, or a micro-batch)."""
    share: float
    """Predicted exposed communication / compute at the new value."""
    why: str
    knob: ClassVar[str] = ""
    """The knob's name in the log (each controller's subclass names it)."""

    def record(self, step: int) -> dict[str, Any]:
        """The log entry at ``step``."""
        return {"step": step, "knob": self.knob, "old": self.old, "new": self.new,
                "bandwidth_mbit": round(self.bandwidth * 8 / 1e6, 3), "step_s": round(self.step_s, 6),
                "share": round(self.share, 4), "why": self.why}
