"""The membership of a fixed world and of torchrun's elastic world (:mod:`quietsync.train.membership`).

Every worker trains from the start of its run to its end; each reads its own stream of micro-batches and feeds
the strategy until it commits. ``--on-nonfinite`` is agreed before a round commits
(:class:`~quietsync.train.nonfinite.NonFiniteGuard`), a checkpoint is written every ``--save-every`` steps and at
the run's end (:func:`save`), and a failed run names the newest checkpoint to resume from.

Under ``--elastic`` torchrun restarts the whole world at a new size; between restarts the world is fixed, so
:class:`ElasticWorld` steps as :class:`FixedWorld` does.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch

from ..data.sequences import ShardedSequences
from ..faults.inject import pause
from ..strategies import StrategyConfig
from ..topology import Topology
from .checkpoint import latest_checkpoint, save_checkpoint, step_folder
from .config import TrainConfig
from .elastic import Nominal, TokenSchedule
from .membership import COMMITTED, DROPPED, OPEN
from .nonfinite import NonFiniteError, NonFiniteGuard


def local_ranks(topology: Topology) -> list[int]:
    """Ranks whose files share this worker's disk: its torchrun node (all ranks for local workers)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", topology.world_size))
    local_rank = int(os.environ.get("LOCAL_RANK", topology.rank % max(1, local_world)))
    first = topology.rank - local_rank
    return list(range(first, first + local_world))


class FixedWorld:
    """The membership of a static world (the module docstring; the protocol's methods are documented there).

    Args:
        cfg: the run's flags.
        strategy: this worker's strategy.
        strategy_flags: the strategy's config as the flags gave it (the batch policy may have rescaled the one it
            runs); saved with each checkpoint.
        clock: the learning-rate schedule's position by committed step (follows tokens: train/elastic.py).
        nominal: what a step held when the run started (the batch policy's reference).
        stream: this worker's micro-batches.
        resumed: whether the run resumed from a checkpoint (else it starts here).
        audit: whether records hold the windows fed (``QUIETSYNC_AUDIT_DATA``).
    """

    speaks: bool

    def __init__(self, cfg: TrainConfig, strategy: Any, strategy_flags: StrategyConfig | None, clock: TokenSchedule,
                 nominal: Nominal, stream: ShardedSequences, resumed: bool, audit: bool) -> None:
        self.cfg, self.strategy_flags, self.clock, self.nominal = cfg, strategy_flags, clock, nominal
        self.stream = stream
        self.topology = strategy.transport.topology
        self.rank = self.topology.rank
        self.speaks = self.rank == 0
        self.fresh = not resumed
        self.audit = audit
        self.guard = NonFiniteGuard(cfg.on_nonfinite, strategy, cfg.nonfinite_skip_limit)
        self.windows: list[list[int]] = []  # --audit: the windows fed since the last committed step

    ended = False

    def position(self, strategy: Any) -> float:
        return self.clock.position(strategy.steps + strategy.steps_in_flight)

    def begin_step(self, strategy: Any) -> None:
        pass

    def micro_batches(self, strategy: Any) -> Iterator[torch.Tensor]:
        while True:  # the strategy decides when a step is full (the loop stops reading at its commit)
            batch = next(self.stream)
            if self.audit:
                epoch, starts = self.stream.last_starts
                self.windows += [[epoch, int(x)] for x in starts]
            yield batch

    def fed(self, strategy: Any, index: int, loss: torch.Tensor | None) -> torch.Tensor | None:
        return loss

    def commit(self, strategy: Any, index: int) -> str:
        if self.guard.before_step():  # a non-finite round, dropped on every worker (--on-nonfinite skip)
            return DROPPED
        return COMMITTED if strategy.step() else OPEN

    def after_commit(self, strategy: Any) -> None:
        pass

    def step_tokens(self, fed: int) -> int:
        return fed

    def tokens_total(self, fed: int) -> int:
        return fed

    def record(self, record: dict[str, Any]) -> None:
        if self.audit:
            record["windows"] = list(self.windows)
            record["world_size"] = self.topology.world_size
            self.windows.clear()

    def finish(self, strategy: Any) -> bool:
        return strategy.finish()

    def after_step(self, strategy: Any, stopping: bool, tokens_fed: int) -> None:
        cfg = self.cfg
        if cfg.save_every and (strategy.steps % cfg.save_every == 0 or stopping):
            with strategy.paused():
                save(self, strategy, tokens_fed)
        pause(strategy.steps, self.rank)  # QUIETSYNC_PAUSE: a test holds the workers here (else one env lookup)

    def close(self, strategy: Any, result: dict[str, Any]) -> dict[str, Any]:
        self.guard.check_parameters()
        self.guard.close()  # not on a failure: tearing its group down would cut the peers' view of who failed first
        return {}

    def failure(self, error: Exception, strategy: Any) -> Exception | None:
        if isinstance(error, NonFiniteError):  # every worker raises it at the same point (agreed), except as documented
            return NonFiniteError(f"{error}; {checkpoint_note(self.cfg, self.topology)}")
        return None


class ElasticWorld(FixedWorld):
    """The membership of torchrun's elastic world (``--elastic``): a fixed world between torchrun's restarts.
    What differs is where a start resumes from (:func:`~quietsync.train.loop.resume_point`: the newest complete
    checkpoint every worker agrees on, at any world size), settled before the loop."""


def checkpoint_note(cfg: TrainConfig, topology: Topology) -> str:
    """Where a stopped run can resume from: the newest complete checkpoint under ``--out``."""
    newest = latest_checkpoint(cfg.out, local_ranks(topology))
    return f"newest checkpoint: {newest}" if newest is not None else "no checkpoint was written"


def save(world: FixedWorld, strategy: Any, tokens_total: int) -> None:
    """Write this worker's checkpoint file, unless any worker's state is not finite (then all raise); first,
    for a strategy that can reshard, the world-size-independent part (every worker takes part)."""
    cfg, stream = world.cfg, world.stream
    state = strategy.state_dict()
    world.guard.check_state(state, strategy.steps)
    if strategy.reshard_refusal is None:
        from .logical_checkpoint import save_logical  # torch.distributed.checkpoint: imported when first used

        save_logical(step_folder(cfg.out, strategy.steps), strategy, stream, tokens_total)
    save_checkpoint(cfg.out, strategy.steps, world.rank, {
        "strategy": state, "data": stream.state_dict(),
        "tokens_total": tokens_total, "rng": torch.get_rng_state(),
        "config": dataclasses.asdict(cfg),  # the strategy's config is in strategy.state_dict()["config"]
        "strategy_flags": None if world.strategy_flags is None else dataclasses.asdict(world.strategy_flags),
        "nominal": world.nominal.state(),
        "schedule_position": world.clock.position(strategy.steps),
        "world_size": strategy.world_size, "nodes": strategy.transport.topology.nodes,
    })


__all__ = ["ElasticWorld", "FixedWorld", "checkpoint_note", "local_ranks", "save"]
