"""Adaptive inner steps for the local methods (a part): slow workers do fewer inner steps per outer round, and the
outer average weighs each worker by the tokens behind its contribution.

Async Local-SGD (Liu et al. 2024) and DiLoCo's Dynamic Local Updates (DyLU) let each worker take a number of local
steps proportional to its speed, so the fast ones do not wait for the slow one at every sync, and weigh each
worker's pseudo-gradient by the tokens it trained on. Here the round ends **by the fastest worker's H**: a round
lasts ``L`` *nominal* steps (``sync_every`` for localsgd, ``sync_every / fragments`` for diloco: the steps between
two syncs), and worker i takes

    H_i = max(1, round(L · v_i / max_j v_j))                   inner steps in it (v: inner steps per second)

so the fastest worker takes L and every worker arrives at the sync at about the same time. The plan is agreed at
each sync, not a wall-clock deadline: each worker measures its own compute time per inner step over the round that
just ended (:attr:`~quietsync.strategies.parts.accounting.StepAccounting.compute_s`, which leaves out evaluation and
checkpointing), averaged with the earlier rounds' (:data:`SMOOTHING`); the workers exchange their speeds through
the transport's control group (``Transport.agree``, one number per worker), and every worker derives the same next
plan from the same numbers. So the plan is a function of agreed values only (deterministic, testable:
``worker_speeds`` fixes the speeds instead of measuring them), the first round is synchronous (nothing measured
yet), and a worker whose speed changes gets its new share within a few syncs.

**Nominal steps.** ``steps`` stays the same on every worker at every sync: the k-th of worker i's H_i inner steps
in a round that starts at nominal step a ends at nominal step ``a + ceil(k·L/H_i)`` — a slow worker's inner step
advances ``steps`` by about L/H_i (:meth:`AdaptivePlan.stride`), its last one lands on ``a + L`` like everyone's. The
learning-rate schedule, ``--max-steps`` and the sync schedule read nominal steps; the metrics' ``tokens`` say what
each worker really fed.

**The weighted average.** With t_i the inner steps worker i took since the fragment's previous sync (times the
micro-batches per step, equal on every worker, so steps stand for tokens),

    w_i = t_i / Σ_j t_j,      Δ̄ = Σ_i w_i Δ_i      (localsgd: θ ← Σ_i w_i θ_i)

which each worker obtains through the unchanged mean over the group by sending ``n·w_i·Δ_i`` (n workers): every
exchange (fp32, bf16, int8, low-bit codes, replicators, SparseLoCo) averages it as before. With equal speeds every
factor is exactly 1.0 and nothing is scaled: the run is the synchronous method bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from ...transport import Transport
from ...validate import check_choice
from ..parts.accumulation import AccumulationConfig
from ..parts.part import Part

INNER_STEPS = ("fixed", "adaptive")

SMOOTHING = 0.5
"""Weight of the earlier rounds in a worker's measured seconds per inner step (an exponential moving average: the
last round counts half, the one before a quarter, ...)."""


@dataclass
class AdaptiveConfig(AccumulationConfig):
    """The inner-step knobs shared by the local methods (localsgd, diloco)."""

    inner_steps: Literal["fixed", "adaptive"] = "fixed"
    """fixed: every worker takes the same inner steps per round; adaptive: each worker's inner steps per round follow
    its measured speed (the fastest takes the full round), the average weighted by tokens (docs/local.md)."""
    worker_speeds: tuple[float, ...] | None = None
    """Adaptive inner steps: fix each worker's relative speed (one value > 0 per worker) instead of measuring it,
    for tests and controlled benchmarks."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("inner_steps", self.inner_steps, INNER_STEPS)
        if self.worker_speeds is not None:
            if isinstance(self.worker_speeds, (str, bytes)) or not hasattr(self.worker_speeds, "__iter__"):
                raise ValueError(f"worker_speeds must be a sequence of numbers, one per worker, got "
                                 f"{self.worker_speeds!r}")
            try:
                self.worker_speeds = tuple(float(v) for v in self.worker_speeds)
            except (TypeError, ValueError):
                raise ValueError(f"worker_speeds must be numbers, got {self.worker_speeds!r}") from None
            if not self.worker_speeds or any(not math.isfinite(v) or v <= 0 for v in self.worker_speeds):
                given = ", ".join(f"{v:g}" for v in self.worker_speeds) or "none"
                raise ValueError(f"worker_speeds must be finite numbers > 0 (one per worker), got {given}")
            if self.inner_steps != "adaptive":
                raise ValueError("worker_speeds needs inner_steps adaptive")

    def uneven_steps(self) -> str | None:
        """Adaptive inner steps: a slow worker takes fewer inner steps (``step()`` calls) per round."""
        if self.inner_steps != "adaptive":
            return None
        return "inner_steps='adaptive' gives each worker its own number of inner steps (step() calls) per round"


def plan_from_speeds(speeds: list[float], period: int) -> list[int]:
    """H_i = max(1, round(L · v_i / max v)) for every worker (all L while nothing is measured)."""
    top = max(speeds)
    if top <= 0:
        return [period] * len(speeds)
    return [max(1, min(period, round(period * v / top))) for v in speeds]


class AdaptivePlan(Part):
    """Each worker's inner steps per round, agreed at every sync, and the token weights of the outer average (module
    docstring).

    Args:
        transport: the transport (its control group agrees the speeds); ``group``: the sync group (its size and this
            worker's rank in it number the workers of the plan).
        period: L, nominal steps per round.
        fragments: pseudo-gradients with their own sync (diloco's F; 1 for localsgd): each weighs the tokens since
            its own previous sync.
        speeds: fixed relative speeds (``worker_speeds``), or None to measure.
    """

    def __init__(self, transport: Transport, group: str, period: int, fragments: int = 1,
                 speeds: tuple[float, ...] | None = None) -> None:
        self.transport = transport
        self.n = transport.group_size(group)
        self.me = transport.group_rank(group)
        if speeds is not None and len(speeds) != self.n:
            raise ValueError(f"worker_speeds must have one value per worker ({self.n}), got {len(speeds)}")
        self.period = int(period)
        self.fixed = None if speeds is None else [float(v) for v in speeds]
        self.speeds = list(self.fixed) if self.fixed is not None else [0.0] * self.n
        """The speeds the current plan was derived from (inner steps per second, or the fixed values)."""
        self.plan = plan_from_speeds(self.speeds, self.period)
        """Inner steps of each worker in the current round."""
        self.done = [0] * self.n
        """Inner steps of each worker in the rounds ended so far (agreed)."""
        self.ran: list[int] = []
        """The plan of the last round that ended (none yet in this process: not checkpointed, for the summary)."""
        self.launched = [[0] * self.n for _ in range(fragments)]
        """``done`` at each fragment's previous sync."""
        self.taken = 0
        """This worker's inner steps in the current round."""
        self.busy_s = 0.0
        """This worker's compute seconds in the current round."""
        self.rounds = 0
        """Rounds ended so far."""
        self.step_s: float | None = None
        """This worker's seconds per inner step, smoothed over the rounds measured (None: none yet)."""

    # ------------------------------------------------------------------ inner steps
    def stride(self) -> int:
        """Nominal steps the next inner step of this worker advances: ``ceil(k·L/H_i) − ceil((k−1)·L/H_i)``."""
        k, h = self.taken + 1, self.plan[self.me]
        return -(-k * self.period // h) - (-(-(k - 1) * self.period // h))

    def inner_step_done(self, compute_s: float) -> None:
        """An inner step committed; ``compute_s``: its main-thread compute time."""
        self.taken += 1
        self.busy_s += compute_s

    def end_round(self) -> None:
        """The round's last inner step (every worker calls it at the same sync): the round's steps are done, and the
        next round's plan is agreed from the speeds measured over this one (or the fixed ones)."""
        if self.taken != self.plan[self.me]:
            raise RuntimeError(f"the round ended after {self.taken} inner steps, the plan says {self.plan[self.me]}")
        self.done = [d + h for d, h in zip(self.done, self.plan)]
        if self.fixed is None:
            # seconds per inner step, smoothed over rounds: one round's timing on a shared machine is noisy
            now = self.busy_s / self.taken
            self.step_s = now if self.step_s is None else SMOOTHING * self.step_s + (1 - SMOOTHING) * now
            mine = 1.0 / max(self.step_s, 1e-9)
            # one number per worker through the control group: a sum in which only worker j's term is non-zero is
            # exactly worker j's value, so every worker derives the plan from the same numbers
            self.speeds = [self.transport.agree(mine if j == self.me else 0.0, "sum") for j in range(self.n)]
        self.ran = self.plan
        self.plan = plan_from_speeds(self.speeds, self.period)
        self.taken, self.busy_s = 0, 0.0
        self.rounds += 1

    def end_partial(self) -> int:
        """The end of training inside a round (``finish``): the inner steps each worker took in it are agreed
        (every worker calls it), so the last sync weighs what was really trained; returns their sum."""
        taken = [int(self.transport.agree(float(self.taken) if j == self.me else 0.0, "sum")) for j in range(self.n)]
        self.done = [d + t for d, t in zip(self.done, taken)]
        self.taken, self.busy_s = 0, 0.0
        return sum(taken)

    def pending(self, fragment: int = 0) -> int:
        """Inner steps of all workers since ``fragment``'s previous sync (as agreed)."""
        return sum(d - s for d, s in zip(self.done, self.launched[fragment]))

    def scale(self, fragment: int = 0) -> float:
        """``n·w_i`` for this worker's contribution to ``fragment``'s sync now (the tokens since its previous
        sync), and that sync noted. Exactly 1.0 when every worker took as many steps."""
        since = [d - s for d, s in zip(self.done, self.launched[fragment])]
        self.launched[fragment] = list(self.done)
        total = sum(since)
        if total == 0:
            return 1.0
        return float(self.n * since[self.me]) / float(total)

    def micro_batches(self, accumulation: int) -> list[int]:
        """Micro-batches each worker feeds in the current round (the trainer deals the data windows by it)."""
        return [h * accumulation for h in self.plan]

    def extra(self) -> dict[str, Any]:
        """What a step's metrics say about the plan: this worker's inner steps in the round."""
        return {"round_inner_steps": self.plan[self.me]}

    # ------------------------------------------------------------------ part protocol
    def summary(self) -> dict[str, str]:
        """Each worker's inner steps in all (agreed at the syncs) and in the last round that ended."""
        last = f" (last round: {', '.join(str(h) for h in self.ran)})" if self.ran else ""
        return {"inner steps per worker": ", ".join(str(d) for d in self.done) + last}

    def state_dict(self) -> dict[str, Any]:
        return {"speeds": list(self.speeds), "plan": list(self.plan), "done": list(self.done),
                "launched": [list(x) for x in self.launched], "taken": self.taken, "busy_s": self.busy_s,
                "rounds": self.rounds, "n": self.n, "step_s": self.step_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if int(state["n"]) != self.n:
            raise ValueError(f"the adaptive plan was saved by {state['n']} workers, this run has {self.n}")
        self.speeds = [float(v) for v in state["speeds"]]
        self.plan = [int(v) for v in state["plan"]]
        self.done = [int(v) for v in state["done"]]
        self.launched = [[int(v) for v in x] for x in state["launched"]]
        self.taken, self.busy_s, self.rounds = int(state["taken"]), float(state["busy_s"]), int(state["rounds"])
        self.step_s = None if state.get("step_s") is None else float(state["step_s"])


__all__ = ["AdaptiveConfig", "AdaptivePlan", "INNER_STEPS", "plan_from_speeds"]
