"""When a `quietsync train` run stops: the first of its budgets reached, agreed by every worker.

Budgets (flags of :class:`~quietsync.train.config.TrainConfig`):

* ``--max-steps N``: committed optimizer steps (always set);
* ``--max-tokens N``: tokens fed by all workers together (each micro-batch counts ``micro_batch_size x
  seq_len`` tokens on the worker that fed it);
* ``--max-time-s S``: wall-clock seconds of training (the ``time_s`` of the metrics: setup excluded, evaluations
  included, continued across a resume);
* ``--target-loss X``: a held-out evaluation at or below ``X`` (rank 0's, the one reported; evaluations run
  every ``--eval-every`` steps, and the evaluation before the first step does not count).

The check runs once per committed step, after that step's evaluation (if one is due). Each worker's clock and
token count differ (ACCO's workers feed different numbers of micro-batches, a slow worker's clock runs ahead),
so the workers decide on values they all share: one all-reduce of a ``world x 3`` table (each worker fills its
row: tokens fed, seconds since the start, its evaluation's loss) on the transport's control group
(:meth:`~quietsync.transport.groups.ProcessGroups.agree_rows`: not link-emulated, not metered; its wait counts as
idle time). From the table every
worker reads the same sums: tokens = the column's sum, time = the slowest clock (the largest), loss = rank 0's.
So every worker stops after the same committed step, with nothing left waiting in a collective; the trainer
then calls ``strategy.finish()``, which syncs or drains what is in flight. A step that finish will commit (the
strategy's ``steps_in_flight``: dpu/wp's update in flight) counts toward ``--max-steps``, so such a run stops
one commit earlier and finish brings it to exactly ``--max-steps``.

The budgets are thresholds on committed steps: a run stops after the **first committed step** at which a budget
is reached, so a token budget may be passed by less than one step's tokens (exact when it is a multiple of
them). With only ``--max-steps`` no collective is added (the step count is the same on every worker).

**Local methods** (``Strategy.local_rounds``: localsgd, diloco in every variant) meet only at their syncs, so an
agreement after every inner step would add a barrier of its own to each one — a cross-node round trip on a real
link, and on any link the faster worker waiting for the slower at every step (in the equal-loss runs diloco
H=16 was idle 13 ms per ~100 ms step, in it and at its syncs). There the workers agree only every
``Strategy.meeting_period`` steps (H) and after every evaluation (``--eval-every``, the same steps on every
worker); in between only ``--max-steps`` is checked. ``--max-tokens`` and ``--max-time-s`` may then be passed by
up to H − 1 steps; ``--target-loss`` is checked at its evaluations as before (exact).
When several budgets are reached at the same step, ``stopped_by`` names the first of :data:`BUDGETS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BUDGETS = ("target_loss", "max_tokens", "max_time_s", "max_steps")
"""Values of ``stopped_by`` in ``summary.json``, in the order that names a tie."""


@dataclass(frozen=True)
class Budgets:
    """The budgets of one run (None = not set); validated by :class:`~quietsync.train.config.TrainConfig`."""

    max_steps: int
    """Committed optimizer steps."""
    max_tokens: int | None = None
    """Tokens of all workers together."""
    max_time_s: float | None = None
    """Wall-clock seconds of training."""
    target_loss: float | None = None
    """Held-out loss to reach (at an evaluation after a committed step)."""

    @property
    def agreed(self) -> bool:
        """Whether a budget besides ``max_steps`` is set (then the workers agree once per committed step)."""
        return any(v is not None for v in (self.max_tokens, self.max_time_s, self.target_loss))

    def reached(self, steps: float, tokens: float, time_s: float, eval_loss: float | None) -> str | None:
        """The budget (a name of :data:`BUDGETS`) that stops the run after a committed step with these totals,
        or None. ``eval_loss`` is the loss of the evaluation after this step (None when none ran)."""
        hits = {
            # a non-finite loss (a diverged evaluation) never counts as reaching the target
            "target_loss": self.target_loss is not None and eval_loss is not None and math.isfinite(eval_loss)
            and eval_loss <= self.target_loss,
            "max_tokens": self.max_tokens is not None and tokens >= self.max_tokens,
            "max_time_s": self.max_time_s is not None and time_s >= self.max_time_s,
            "max_steps": steps >= self.max_steps,
        }
        return next((name for name in BUDGETS if hits[name]), None)

    def describe(self) -> str:
        """``"300 steps, 1,000,000 tokens, 60 s or loss <= 3.5, whichever comes first"`` for the start line."""
        parts = [f"{self.max_steps} steps"]
        if self.max_tokens is not None:
            parts.append(f"{self.max_tokens:,} tokens")
        if self.max_time_s is not None:
            parts.append(f"{self.max_time_s:g} s")
        if self.target_loss is not None:
            parts.append(f"eval loss <= {self.target_loss:g}")
        if len(parts) == 1:
            return parts[0]
        return ", ".join(parts[:-1]) + f" or {parts[-1]}, whichever comes first"


class BudgetWatch:
    """One worker's side of the agreement (see the module docstring); every worker calls :meth:`check` after
    each committed step.

    Args:
        budgets: the run's budgets.
        strategy: this worker's strategy (its transport agrees; ``waiting`` books the wait as idle).
    """

    def __init__(self, budgets: Budgets, strategy: Any) -> None:
        self.budgets = budgets
        self.strategy = strategy
        self.agreements = 0
        """All-reduces run so far (one per agreed check)."""

    def check(self, tokens: int, time_s: float, eval_loss: float | None, steps: float | None = None,
              evaluated: bool = False) -> str | None:
        """After a committed step: which budget stops the run now (the same on every worker), or None.

        ``tokens``: this worker's tokens fed so far; ``time_s``: its seconds since the start of training;
        ``eval_loss``: its evaluation after this step, None when none ran; ``steps``: the steps ``--max-steps``
        counts (default the committed steps; after a resume on another number of workers, the learning-rate
        schedule's position, which follows tokens: :mod:`quietsync.train.elastic`); ``evaluated``: whether an
        evaluation was due after this step (the schedule's answer, the same on every worker).
        """
        steps = (self.strategy.steps + self.strategy.steps_in_flight) if steps is None else steps
        if not self.budgets.agreed or not self.due(evaluated):
            return "max_steps" if steps >= self.budgets.max_steps else None
        self.agreements += 1
        tokens_all, time_all, loss0 = self.agree(tokens, time_s, eval_loss)
        return self.budgets.reached(steps, tokens_all, time_all, loss0)

    def due(self, evaluated: bool) -> bool:
        """Whether the workers agree after this step: always, except inside a local method's round (module
        docstring); decided from what every worker knows alike (the committed steps, the evaluation schedule)."""
        s = self.strategy
        return evaluated or s.world_size == 1 or s.steps % s.meeting_period == 0  # meeting_period 1: every step

    def agree(self, tokens: int, time_s: float, eval_loss: float | None) -> tuple[float, float, float | None]:
        """``(tokens of all workers, the largest clock, rank 0's evaluation loss or None)``: one all-reduce."""
        # NaN marks "no evaluation" in a table of floats
        row = [float(tokens), float(time_s), math.nan if eval_loss is None else eval_loss]
        with self.strategy.waiting("budget_agree"):
            table = self.strategy.transport.agree_rows(row)
        loss0 = table[0][2]
        return sum(r[0] for r in table), max(r[1] for r in table), None if math.isnan(loss0) else loss0
