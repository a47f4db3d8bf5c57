"""The cyclic timeline of paper 002, pure and identical on every worker: who computes which stage of which
micro-batch at each time step, which parameter version it uses (rules dp, CDP-v1, CDP-v2), and which
point-to-point messages move the gradients (the reduce chain and the distribution chain).

:class:`Schedule` is what the executor in ``cdp.py`` follows and what the tests check against the paper's
rules; it communicates nothing.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property

AFTER_REDUCE = 5
"""Phase of a message sent at the end of its time step, after the sender's reduce (partial sums, the root's
first distribution hop)."""
RELAY = 2
"""Phase of a message relayed at the start of its time step (later hops of a distribution chain)."""


@dataclass(frozen=True)
class Message:
    """One point-to-point transfer of the plan (``kind``: ``partial`` of the reduce chain or ``dist``)."""

    time: int
    """Time step at which it is sent (received at the start of the next one)."""
    phase: int
    """When in its time step it is sent: :data:`RELAY` (start) before :data:`AFTER_REDUCE` (end)."""
    cycle: int
    stage: int
    slot: int
    """The sending slot of a partial sum (0 for a distribution hop)."""
    src: int
    dst: int
    kind: str

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        """Senders send and receivers post receives in this order."""
        return (self.time, self.phase, self.cycle, self.stage, self.slot)


@dataclass(frozen=True)
class Schedule:
    """The cyclic timeline: who computes what when, which parameter version it uses, and which messages move.

    Pure and identical on every worker. 0-based slots ``i`` and stages ``j`` throughout.
    """

    n: int
    world: int
    rule: str

    def __post_init__(self) -> None:
        if self.n < 1 or self.world < 1 or self.n % self.world:
            raise ValueError(f"stages ({self.n}) must be a multiple of the number of workers ({self.world})")
        object.__setattr__(self, "stagger", 0 if self.rule == "dp" else 2)
        period = 2 * self.n
        while not self._valid(period):  # only dp with several workers needs a longer cycle (a barrier)
            period += 1
            if period > 8 * self.n + 8:
                raise RuntimeError(f"no valid cycle for rule {self.rule} (internal error)")
        object.__setattr__(self, "period", period)

    # --- compute
    def worker(self, i: int) -> int:
        return i % self.world

    def slots(self, w: int) -> list[int]:
        return list(range(w, self.n, self.world))

    def start(self, c: int, i: int, period: int | None = None) -> int:
        return c * (self.period if period is None else period) + self.stagger * i

    def fwd(self, c: int, i: int, j: int, period: int | None = None) -> int:
        return self.start(c, i, period) + j

    def bwd(self, c: int, i: int, j: int, period: int | None = None) -> int:
        return self.start(c, i, period) + 2 * self.n - 1 - j

    def version(self, c: int, i: int, j: int) -> int:
        """Parameter version (committed-step count) of stage ``j`` that micro-batch ``i`` of cycle ``c``
        uses."""
        if self.rule == "dp":
            v = c
        elif self.rule == "v1":
            v = c - 1
        else:  # paper: θ_t^j iff j ≥ N − i + 1 (1-based)  <=>  j ≥ N − 1 − i (0-based)
            v = c if j >= self.n - 1 - i else c - 1
        return max(v, 0)  # θ_{-1} := θ_0

    # --- communication
    @functools.cache  # noqa: B019 - a schedule is immutable and lives as long as its strategy
    def reduce_times(self, c: int, j: int, period: int | None = None) -> tuple[int, ...]:
        """When slot ``i`` adds its gradient of stage ``j`` to the chain's partial sum (end of that step)."""
        out: list[int] = []
        for i in range(self.n):
            t = self.bwd(c, i, j, period)
            if i:
                t = max(t, out[-1] + (1 if self.worker(i) != self.worker(i - 1) else 0))
            out.append(t)
        return tuple(out)

    def root(self) -> int:
        return self.worker(self.n - 1)

    def need(self, w: int, v: int, j: int, period: int | None = None) -> int:
        """First time worker ``w`` runs a forward of stage ``j`` at version ``>= v``."""
        return min(self.fwd(c, i, j, period) for c in range(max(0, v - 1), v + 3) for i in self.slots(w)
                   if self.version(c, i, j) >= v)

    @functools.cache  # noqa: B019 - a schedule is immutable and lives as long as its strategy
    def chain(self, j: int, period: int | None = None) -> list[int]:
        """Workers other than the root, in the order they first need the new version of stage ``j``."""
        others = [w for w in range(self.world) if w != self.root()]
        return sorted(others, key=lambda w: (self.need(w, 2, j, period), w))

    @functools.cache  # noqa: B019 - a schedule is immutable and lives as long as its strategy
    def arrivals(self, c: int, j: int, period: int | None = None) -> dict[int, int]:
        """Time step at whose start each worker applies the update of cycle ``c`` to stage ``j`` (the root: at
        the end of the step given)."""
        root_t = self.reduce_times(c, j, period)[-1]
        out = {self.root(): root_t}
        for k, w in enumerate(self.chain(j, period)):
            out[w] = root_t + 1 + k
        return out

    def _valid(self, period: int) -> bool:
        for j in range(self.n):
            for c in (0, 1):
                arr = self.arrivals(c, j, period)
                for w, t in arr.items():
                    need = self.need(w, c + 1, j, period)
                    if (t >= need) if w == self.root() else (t > need):
                        return False
        return True

    @cached_property
    def horizon(self) -> int:
        """Latest event of cycle 0 (later cycles: shifted by ``period``)."""
        return max(max(self.arrivals(0, j).values()) for j in range(self.n)) + 1

    def cycles_at(self, t: int) -> range:
        """Cycles that may have an event at time ``t``."""
        lo = max(0, -(-(t - self.horizon) // self.period))
        return range(lo, t // self.period + 1)

    @functools.cache  # noqa: B019 - a schedule is immutable and lives as long as its strategy
    def messages_sent(self, c: int, j: int) -> tuple[Message, ...]:
        """Every transfer of stage ``j``'s gradient in cycle ``c``."""
        out = []
        rt = self.reduce_times(c, j)
        for i in range(1, self.n):
            if self.worker(i) != self.worker(i - 1):
                out.append(
                    Message(
                        rt[i - 1], AFTER_REDUCE, c, j, i - 1, self.worker(i - 1), self.worker(i), "partial"
                    )
                )
        chain = self.chain(j)
        prev, t = self.root(), rt[-1]
        for k, w in enumerate(chain):
            phase = AFTER_REDUCE if k == 0 else RELAY  # the root sends after its reduce step
            out.append(Message(t, phase, c, j, 0, prev, w, "dist"))
            prev, t = w, t + 1
        return tuple(out)

    def bytes_per_step(self, stage_bytes: list[int], w: int, cycles: int) -> dict[int, int]:
        """Hand count: bytes worker ``w`` sends at each time step over ``cycles`` cycles."""
        out: dict[int, int] = defaultdict(int)
        for c in range(cycles):
            for j in range(self.n):
                for m in self.messages_sent(c, j):
                    if m.src == w:
                        out[m.time] += stage_bytes[j]
        return dict(out)
