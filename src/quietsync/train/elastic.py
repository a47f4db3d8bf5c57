"""Runs that survive losing and regaining nodes: ``--elastic`` under torchrun, and what a step holds when the
number of workers changes (``--batch-policy``), with the learning-rate schedule following tokens.

torchrun is the elastic engine::

    torchrun --nnodes 1:2 --nproc-per-node 8 --max-restarts 10 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 --rdzv-id myjob -m quietsync train --elastic --out /shared/run

When a node's agent dies, the other workers' next collective fails (at once when its connections close, or
after ``--timeout-s`` when the node vanishes); their agents restart them (one of ``--max-restarts``) and the
c10d rendezvous admits whoever is there (at least the minimum of ``--nnodes``) after ``last_call_timeout``.
When a node comes back its agent waits in the rendezvous; the running agents see it at their next membership
check (every ``--monitor-interval`` s) and restart their workers with it (membership changes do not count as
restarts). quietsync's part, in every worker start under ``--elastic``:

* resume from the newest complete checkpoint under ``--out`` (a fresh run when there is none) — on another
  number of workers through the checkpoint's world-size-independent part (every strategy but cdp has one);
  the checkpoint every worker loads is rank 0's choice, broadcast;
* checkpoints by default after every outer synchronisation (``diloco``: every ``sync_every / fragments``
  steps; ``localsgd``: every ``sync_every``), else every :data:`DEFAULT_SAVE_EVERY` steps;
* ``--out`` must be on a file system every node sees (each worker reads what others wrote).

**Batch policy** (``--batch-policy``), when a run resumes on ``W`` workers after starting on ``W0``:

* ``global`` (default): the same tokens per step — each worker's micro-batches per step (``--accumulation``;
  ``--deterministic-accumulation`` for acco/dpu/wp) become ``ceil(A0 · W0 / W)``; exact when ``W`` divides
  ``A0 · W0``, else the step holds a little more (rounded up). The tuned lr/batch pair is kept.
* ``worker``: the same micro-batches per worker: a step holds ``W / W0`` of the original global batch.

Either way the learning-rate schedule and ``--max-steps`` count **tokens**: the schedule's position advances
by ``(A · W) / (A0 · W0)`` per committed step (1 when nothing changed: the schedule is then exactly the usual
one), and the run ends when the position reaches ``--max-steps``, so a run that lost a node for a while ends
after the tokens an uninterrupted one would have fed. (acco/dpu/wp without a fixed count adapt their
micro-batches per stage themselves; their position advances by ``W / W0``.)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["BATCH_POLICIES", "DEFAULT_SAVE_EVERY", "Nominal", "TokenSchedule", "accumulation_field",
           "default_save_every", "rescaled"]

BATCH_POLICIES = ("global", "worker")

DEFAULT_SAVE_EVERY = 10
"""Checkpoint cadence under ``--elastic`` for strategies without an outer synchronisation (steps)."""


def default_save_every(strategy: str, strategy_config: Any) -> int:
    """The ``--save-every`` of an elastic run that does not set it: after every outer synchronisation for the
    local methods (only θ_global and the outer state are global; each worker writes its own inner state in
    parallel), else :data:`DEFAULT_SAVE_EVERY`."""
    sync_every = getattr(strategy_config, "sync_every", None)
    if isinstance(sync_every, int) and sync_every > 0:
        return max(1, sync_every // int(getattr(strategy_config, "fragments", 1) or 1))
    return DEFAULT_SAVE_EVERY


def accumulation_field(strategy_config: Any) -> str | None:
    """The strategy-config field that fixes each worker's micro-batches per step, or None (adaptive)."""
    if strategy_config is None:
        return None
    names = {f.name for f in dataclasses.fields(strategy_config)}
    if "accumulation" in names:
        return "accumulation"
    # None: acco/dpu/wp adapt their micro-batches per stage (no fixed count)
    if "deterministic_accumulation" in names and strategy_config.deterministic_accumulation is not None:
        return "deterministic_accumulation"
    return None


@dataclass(frozen=True)
class Nominal:
    """What a step held when the run started: the reference of the batch policy and of the token schedule."""

    world_size: int
    """Workers at step 0."""
    accumulation: int
    """Each worker's micro-batches per step at step 0 (1 where the strategy adapts it)."""

    def state(self) -> dict[str, int]:
        return {"world_size": self.world_size, "accumulation": self.accumulation}

    @classmethod
    def of(cls, strategy_config: Any, world: int) -> Nominal:
        """The nominal step of a run starting now with ``strategy_config`` on ``world`` workers."""
        field = accumulation_field(strategy_config)
        return cls(world, int(getattr(strategy_config, field)) if field else 1)


def rescaled(strategy_config: Any, policy: str, nominal: Nominal, world: int) -> tuple[Any, float]:
    """``(strategy config for world, tokens per step / nominal tokens per step)`` under ``policy``."""
    field = accumulation_field(strategy_config)
    accumulation = nominal.accumulation
    if policy == "global" and world != nominal.world_size:
        accumulation = math.ceil(nominal.accumulation * nominal.world_size / world)
    if field is not None and getattr(strategy_config, field) != accumulation:
        strategy_config = dataclasses.replace(strategy_config, **{field: accumulation})
    per_worker = accumulation if field is not None else 1  # adaptive: the ratio is W / W0
    return strategy_config, (per_worker * world) / (nominal.accumulation * nominal.world_size)


@dataclass(frozen=True)
class TokenSchedule:
    """``f(step) = schedule(position(step))``: a schedule of committed steps driven by tokens instead.

    ``position(step) = anchor_position + (step - anchor_step) · ratio``: the position (in nominal steps) of
    the resumed checkpoint, advanced by ``ratio`` nominal steps per committed step."""

    schedule: Any
    """The run's schedule of nominal steps (``WarmupCosine``)."""
    anchor_step: int
    """Committed steps at the resume."""
    anchor_position: float
    """The schedule's position there."""
    ratio: float
    """Tokens per step now / nominal tokens per step."""

    def position(self, step: int) -> float:
        return self.anchor_position + (step - self.anchor_step) * self.ratio

    def __call__(self, step: int) -> float:
        return self.schedule(self.position(step))
