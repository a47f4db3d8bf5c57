"""The membership of a fixed world and of torchrun's elastic world (:mod:`quietsync.train.membership`).

Every worker trains from the start of its run to its end; each reads its own stream of micro-batches and feeds
the strategy until it commits. ``--on-nonfinite`` is agreed before a round commits
(:class:`~quietsync.train.nonfinite.NonFiniteGuard`), a checkpoint is written every ``--save-every`` steps and at
the run's end (:func:`save`), and a failed run names the newest checkpoint to resume from.

Under ``--elastic`` torchrun restarts the whole world at a new size; between restarts the world is fixed, so
:class:`ElasticWorld` steps as :class:`FixedWorld` does. The two differ in where a start resumes from
(``resume_point``, before the loop): ``--resume`` for a fixed world; for an elastic one, every start takes the
newest complete checkpoint every worker agrees on (:func:`agreed_checkpoint`), at any world size.
"""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..cli.launch import ERRORS_ENV, under_torchrun
from ..data.sequences import ShardedSequences
from ..faults.inject import flip_bit, pause
from ..strategies import StrategyConfig
from ..topology import GROUPS, Topology
from ..transport import Transport
from . import replicas
from .checkpoint import (
    checkpoint_root,
    complete_checkpoints,
    files_problem,
    latest_checkpoint,
    load_checkpoint,
    out_of_space,
    rank_file,
    remove_partial_writes,
    resolve_resume,
    save_checkpoint,
    step_folder,
)
from .config import TrainConfig
from .elastic import Nominal, TokenSchedule, accumulation_field
from .membership import COMMITTED, DROPPED, OPEN, STEP_SUMS
from .nonfinite import NonFiniteError, NonFiniteGuard
from .resume_check import check_checkpoint


def local_ranks(topology: Topology) -> list[int]:
    """Ranks whose files share this worker's disk: its torchrun node (all ranks for local workers)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", topology.world_size))
    local_rank = int(os.environ.get("LOCAL_RANK", topology.rank % max(1, local_world)))
    first = topology.rank - local_rank
    return list(range(first, first + local_world))


@dataclasses.dataclass
class Resume:
    """The checkpoint this worker resumes from."""

    folder: Path
    state: dict[str, Any]
    """This worker's rank file (``same_layout``), else rank 0's, tensors memory-mapped (config and counters)."""
    same_layout: bool
    """Whether the checkpoint was written by this world size and node count (then the rank files are loaded,
    exactly; else its world-size-independent part)."""
    finished: bool = False
    """An elastic run whose newest checkpoint already reached ``--max-steps``: there is nothing left to do."""


def agreed_checkpoint(cfg: TrainConfig, topology: Topology, transport: Transport, required: bool,
                      pass_over: bool) -> Path | None:
    """The newest complete checkpoint under ``--out`` whose files are whole, as rank 0 sees it, broadcast so every
    worker loads the same one (None when there is none and ``required`` is False). With ``pass_over``
    (``--elastic``) a checkpoint with a bad file is passed over, with a note naming it, for the next older one."""
    code, problem = -1, None  # broadcast as one int: the step, -1 (none) or -2 (a bad file)
    if topology.rank == 0:
        for folder in complete_checkpoints(cfg.out, local_ranks(topology)):
            problem = files_problem(folder, topology.world_size, topology.nodes)
            if problem is None:
                code = int(folder.name.split("-")[1])
                break
            if not pass_over:
                code = -2
                break
            print(f"quietsync train: --elastic: passing over {folder}: {problem}", flush=True)
            problem = None
    if topology.world_size > 1:
        agreed = torch.tensor([code], dtype=torch.int64, device=transport.device)
        transport.broadcast(agreed, src=0, group="world", name="resume_step")
        code = int(agreed.item())
    if code == -2:
        raise ValueError(f"--resume: {problem}" if problem else "--resume: rank 0 found a bad checkpoint file "
                         "(see its error)")
    if code < 0:
        if required:
            raise ValueError(f"--resume found no complete checkpoint under {checkpoint_root(cfg.out)}")
        return None
    return step_folder(cfg.out, code)


def _remove_partial_writes(cfg: TrainConfig) -> None:
    """What a write cut short left (``*.tmp``), removed once per node (no worker of the run is writing now)."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        remove_partial_writes(cfg.out)


def load_resume(folder: Path | None, cfg: TrainConfig, strategy_config: StrategyConfig | None, topology: Topology,
                finished_at_max: bool = False) -> Resume | None:
    """The checkpoint in ``folder`` as this worker resumes from it (None: no folder, a fresh run), checked against
    this run (one :class:`~quietsync.train.resume_check.ResumeMismatch` line on every worker otherwise); with
    ``finished_at_max``, a checkpoint whose schedule already reached ``--max-steps`` is ``finished``."""
    if folder is None:
        return None
    rank, world = topology.rank, topology.world_size
    head = load_checkpoint(folder, 0, mmap=True)
    local = local_ranks(topology)  # the same choice on every worker: all use the rank files, or none
    same = (head.get("world_size") == world and head.get("nodes", topology.nodes) == topology.nodes
            and all(rank_file(folder, r).is_file() for r in local))
    # resharding needs only rank 0's config and counters (mapped): the tensors come from logical/
    state = load_checkpoint(folder, rank) if same and rank != 0 else load_checkpoint(folder, 0, mmap=not same)
    position = float(head.get("schedule_position", head["strategy"]["steps"]))
    if finished_at_max and position >= cfg.max_steps:  # e.g. a node that rejoins as the run ends: nothing to do
        return Resume(folder, state, same, finished=True)
    for note in check_checkpoint(state, cfg, strategy_config, world, topology.nodes, folder):
        if rank == 0 and under_torchrun() and ERRORS_ENV not in os.environ:  # else the launcher did
            print(f"quietsync train: {note}", flush=True)
    return Resume(folder, state, same)


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
        data_identity: what the training ids are (:func:`~quietsync.data.shards.data_identity`); saved with each
            checkpoint.
    """

    speaks: bool

    def __init__(self, cfg: TrainConfig, strategy: Any, strategy_flags: StrategyConfig | None, clock: TokenSchedule,
                 nominal: Nominal, stream: ShardedSequences, resumed: bool, audit: bool,
                 data_identity: dict[str, Any] | None = None) -> None:
        self.cfg, self.strategy_flags, self.clock, self.nominal = cfg, strategy_flags, clock, nominal
        self.data_identity = data_identity
        self.stream = stream
        self.topology = strategy.transport.topology
        self.rank = self.topology.rank
        self.speaks = self.rank == 0
        self.fresh = not resumed
        self.audit = audit
        self.guard = NonFiniteGuard(cfg.on_nonfinite, strategy, cfg.nonfinite_skip_limit)
        self.windows: list[list[int]] = []  # --audit: the windows fed since the last committed step
        self.replicas_now: dict[str, Any] | None = None  # --check-replicas-every: this step's verdict, for its record
        self.first_differ: int | None = None  # the first checked step whose workers differed
        self.agreed: int | None = None  # the last checked step whose workers agreed (--on-replicas-differ stop says)
        self.checked: int | None = None  # the last step checked

    @classmethod
    def resume_point(cls, cfg: TrainConfig, strategy_config: StrategyConfig | None, topology: Topology,
                     transport: Transport) -> Resume | None:
        """Where this worker resumes from (None: a fresh run): ``--resume`` (bare: the newest complete checkpoint
        under ``--out``, agreed by every worker) or ``--resume DIR``."""
        if cfg.resume is None:
            return None
        _remove_partial_writes(cfg)
        if cfg.resume == "latest":
            folder = agreed_checkpoint(cfg, topology, transport, required=True, pass_over=False)
        else:
            folder = resolve_resume(str(cfg.resume), cfg.out, local_ranks(topology))
        return load_resume(folder, cfg, strategy_config, topology)

    @classmethod
    def start_note(cls, cfg: TrainConfig, resume: Resume | None, world: int, run_config: Any,
                   clock: TokenSchedule) -> str | None:
        """What rank 0 says about where the run starts (None: nothing)."""
        return None

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

    def abstain(self, strategy: Any) -> torch.Tensor | None:
        raise RuntimeError("a fixed or elastic world has no step without data (only a torchft replica that healed)")

    def fed(self, strategy: Any, index: int, loss: torch.Tensor | None) -> torch.Tensor | None:
        return loss

    def commit(self, strategy: Any, index: int) -> str:
        if self.guard.before_step():  # a non-finite round, dropped on every worker (--on-nonfinite skip)
            return DROPPED
        return COMMITTED if strategy.step() else OPEN

    def after_commit(self, strategy: Any) -> None:
        every = self.cfg.check_replicas_every
        if every and strategy.steps % every == 0:
            found = self._check_replicas(strategy)
            self.replicas_now = found
            if found.get("differ") and self.first_differ is None:
                self.first_differ = strategy.steps
                if self.speaks:  # once: a difference stays (nothing makes the workers equal again)
                    print(replicas.warning(found["differ"], strategy.steps), flush=True)

    def _check_replicas(self, strategy: Any) -> dict[str, Any]:
        """The replica check's verdict (every worker the same); ``--on-replicas-differ stop``: raised on a
        difference."""
        rows = self.guard.check_parameters(lambda module: replicas.fingerprint_of(strategy, module))
        found = replicas.with_why(replicas.verdict(rows), strategy)
        self.checked = strategy.steps
        if found.get("differ") and self.cfg.on_replicas_differ == "stop":
            raise replicas.ReplicasDiffer(replicas.stop_message(found["differ"], strategy.steps, self.agreed))
        if found.get("checked") and not found["differ"]:
            self.agreed = strategy.steps
        return found

    def busy(self) -> None:
        pass

    def step_tokens(self, fed: int) -> int:
        return fed

    def tokens_total(self, fed: int) -> int:
        return fed

    def record(self, record: dict[str, Any]) -> None:
        if self.replicas_now is not None:
            record["replicas"], self.replicas_now = self.replicas_now, None
        if self.audit:
            record["windows"] = list(self.windows)
            record["world_size"] = self.topology.world_size
            self.windows.clear()

    def finish(self, strategy: Any) -> bool:
        return strategy.finish()

    def after_step(self, strategy: Any, stopping: bool, tokens_fed: int) -> None:
        cfg = self.cfg
        if cfg.save_every and (strategy.steps % cfg.save_every == 0 or stopping):
            if cfg.on_replicas_differ == "stop" and self.checked != strategy.steps:
                self._check_replicas(strategy)  # no checkpoint of parameters the workers do not share is written
            with strategy.paused():  # the save stays out of the next step's compute_s
                save(self, strategy, tokens_fed)
        flip_bit(strategy.steps, self.rank, strategy.module)  # QUIETSYNC_FLIP_BIT: a test's memory error
        pause(strategy.steps, self.rank)  # QUIETSYNC_PAUSE: a test holds the workers here (else one env lookup)

    def close(self, strategy: Any, result: dict[str, Any]) -> dict[str, Any]:
        found = self._check_replicas(strategy)
        self.guard.close()  # not on a failure: tearing its group down would cut the peers' view of who failed first
        if found.get("differ") and self.speaks and self.first_differ is None:
            print(replicas.warning(found["differ"], strategy.steps), flush=True)
        if self.cfg.check_replicas_every:
            found["first_differ_step"] = self.first_differ
        return {"replicas": found}

    def failure(self, error: Exception, strategy: Any) -> Exception | None:
        if isinstance(error, NonFiniteError):  # every worker raises it at the same point (agreed), except as documented
            return NonFiniteError(f"{error}; {checkpoint_note(self.cfg, self.topology)}")
        if isinstance(error, replicas.ReplicasDiffer):  # agreed: every worker holds the same verdict
            return replicas.ReplicasDiffer(f"{error}; {checkpoint_note(self.cfg, self.topology)}")
        return None


class ElasticWorld(FixedWorld):
    """The membership of torchrun's elastic world (``--elastic``): a fixed world between torchrun's restarts.
    What differs is where each start resumes from: the newest complete checkpoint every worker agrees on, at any
    world size, passing over one with a bad file."""

    @classmethod
    def resume_point(cls, cfg: TrainConfig, strategy_config: StrategyConfig | None, topology: Topology,
                     transport: Transport) -> Resume | None:
        """Every start takes the newest complete checkpoint under ``--out`` (one with a bad file passed over), else
        ``--resume DIR``, else none; a checkpoint that already reached ``--max-steps`` is ``finished``."""
        _remove_partial_writes(cfg)
        folder = agreed_checkpoint(cfg, topology, transport, required=False, pass_over=True)
        if folder is None and cfg.resume not in (None, "latest"):
            folder = resolve_resume(str(cfg.resume), cfg.out, local_ranks(topology))
        return load_resume(folder, cfg, strategy_config, topology, finished_at_max=True)

    @classmethod
    def start_note(cls, cfg: TrainConfig, resume: Resume | None, world: int, run_config: Any,
                   clock: TokenSchedule) -> str | None:
        if resume is None:
            return (f"--elastic: no complete checkpoint under {checkpoint_root(cfg.out)}: the run starts on {world} "
                    "worker(s)")
        field = accumulation_field(run_config)
        per = f", {getattr(run_config, field)} micro-batch(es) per worker per step" if field else ""
        return (f"--elastic: resuming {resume.folder.name} (written by {resume.state.get('world_size')} worker(s)) "
                f"on {world} worker(s){per}; a step holds {clock.ratio:g} x the run's first tokens per step; "
                f"learning-rate schedule at step {clock.anchor_position:g} of {cfg.max_steps}")


def checkpoint_note(cfg: TrainConfig, topology: Topology) -> str:
    """Where a stopped run can resume from: the newest complete checkpoint under ``--out``."""
    newest = latest_checkpoint(cfg.out, local_ranks(topology))
    return f"newest checkpoint: {newest}" if newest is not None else "no checkpoint was written"


def save(world: FixedWorld, strategy: Any, tokens_total: int) -> None:
    """Write this worker's checkpoint file, unless any worker's state is not finite (then all raise); first,
    for a strategy that can reshard, the world-size-independent part (every worker takes part). Returns once every
    worker's file is written, so the checkpoint is complete when any worker goes on."""
    cfg = world.cfg
    state = strategy.state_dict()
    world.guard.check_state(state, strategy.steps)
    try:
        _write(world, strategy, state, tokens_total)
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        full = out_of_space(cfg.out, strategy.steps, e)
        if full is None:
            raise
        raise OSError(errno.ENOSPC, full) from e
    # every worker's file is on disk before any worker trains on: a worker that fails later names this checkpoint
    # (checkpoint_note) whichever worker wrote last, rather than a race deciding between it and "none"
    world.guard.agree(0)


def _write(world: FixedWorld, strategy: Any, state: dict[str, Any], tokens_total: int) -> None:
    """The checkpoint's files of this worker: the logical part (with every worker), then its rank file."""
    cfg, stream = world.cfg, world.stream
    # logical/ before the rank files: a step whose rank files are complete has it complete too
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
        "data_identity": world.data_identity,
    })


def gather_totals(transport: Transport, result: dict) -> dict[str, Any]:
    """The run's counters summed over the workers with one all-reduce (after the strategy is closed): the totals
    of the summary."""
    snap = transport.meter.snapshot()
    before = result.get("bytes_before", {})  # a resumed run's steps before the checkpoint (train_steps)
    keys = [(g, d) for g in GROUPS for d in ("sent", "recv")]
    values = [float(result["tokens_total"]), float(result["micro_batches"]), *(float(result[k]) for k in STEP_SUMS)]
    values += [float(snap.get(g, {}).get(d, 0)) + float(before.get(g, {}).get(d, 0)) for g, d in keys]
    t = torch.tensor(values, dtype=torch.float64, device=transport.device)  # float64: byte and token counts stay exact
    transport.all_reduce(t, group="world", op="sum", name="summary")
    v = t.tolist()
    by_group = {g: {"sent": 0, "recv": 0} for g in GROUPS}
    for (g, d), x in zip(keys, v[2 + len(STEP_SUMS):]):
        by_group[g][d] = int(x)
    return {
        "tokens": int(v[0]), "micro_batches": int(v[1]), **dict(zip(STEP_SUMS, v[2:2 + len(STEP_SUMS)])),
        "bytes_by_group": {g: c for g, c in by_group.items() if c["sent"] or c["recv"]},
    }


__all__ = ["ElasticWorld", "FixedWorld", "Resume", "agreed_checkpoint", "checkpoint_note", "gather_totals",
           "load_resume", "local_ranks", "save"]
