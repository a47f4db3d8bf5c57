"""The trainer's side of adaptive inner steps (``--inner-steps adaptive``, localsgd and diloco): the data windows
dealt by the agreed plan, and the flags checked before any worker starts.

**Windows.** A worker that takes fewer inner steps in a round must read fewer windows, and no other worker may read
the ones it leaves. With fixed inner steps every worker reads ``perm[r::W]`` of the epoch's permutation
(:class:`~quietsync.data.sequences.ShardedSequences`), the same count each. Under adaptive inner steps every worker
knows the round's plan (the strategy's ``window_plan``: the round's number and each worker's micro-batches in it, agreed
at the previous sync), so :class:`PlannedSequences` deals the round's windows out of the epoch's permutation as one
stream: the round takes the next ``Σ_j c_j`` windows (``c_j`` = worker j's micro-batches × micro-batch size), dealt
one per worker in turn, a worker dropping out of the turn once it has its ``c_j``. So the windows all workers read
are a prefix of the permutation — nothing read twice, nothing skipped — and with every ``c_j`` equal it is exactly
the fixed order ``perm[r::W]``. A round that would run past the epoch's end starts the next epoch (the tail that does
not hold a whole round is left, as the fixed stream leaves the tail that does not hold a micro-batch per worker).

**Flags.** Every worker must meet each sync: the run stops, evaluates, checkpoints and checks its replicas only at
the end of a round (``--max-steps``, ``--eval-every``, ``--save-every`` and ``--check-replicas-every`` multiples of the
round length L, the steps between two syncs:
a default is moved up to the next multiple, with a note, a value the user gave is refused), and nothing adds a
collective to every round (``--on-nonfinite skip`` agrees on every round, so it is refused). Under
``--fault-tolerance torchft`` the plan cannot be agreed (the quorum, not a fixed world, decides who syncs): refused,
so a slow replica is never taken for a dead one by a change here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..data.sequences import ShardedSequences, Tokens, gather_windows

Plan = Callable[[], "tuple[int, list[int]] | None"]
"""The strategy's ``window_plan``: ``(round, micro-batches of each worker in it)``."""


def round_length(strategy_config: Any) -> int | None:
    """L of a strategy config under adaptive inner steps (None: fixed inner steps, or a strategy without them)."""
    if getattr(strategy_config, "inner_steps", "fixed") != "adaptive":
        return None
    return int(strategy_config.round_length())


def fit_defaults(cfg: Any, strategy_config: Any, given: set[str]) -> list[str]:
    """Move each of ``--max-steps``, ``--eval-every`` and ``--save-every`` the user did not give (its default) up to
    the next multiple of the round length, in ``cfg``; returns a note per flag moved. A value the user typed is
    left for :func:`adaptive_problem` to refuse: a default that fits no round is ours to fit, a typed one theirs."""
    period = round_length(strategy_config)
    notes: list[str] = []
    if period is None:
        return notes
    for name in ("max_steps", "eval_every", "save_every"):
        value = getattr(cfg, name)
        if name in given or not value or value % period == 0:
            continue
        fitted = -(-value // period) * period
        setattr(cfg, name, fitted)
        notes.append(f"--{name.replace('_', '-')} {value} -> {fitted}")
    return notes


def adaptive_problem(cfg: Any, strategy_config: Any, world: int | None) -> str | None:
    """The one-line refusal of a job that adaptive inner steps cannot run, or None."""
    period = round_length(strategy_config)
    if period is None:
        return None
    why = f"with --inner-steps adaptive (the workers meet only at round ends, every {period} steps)"
    if cfg.fault_tolerance != "none":
        return ("--inner-steps adaptive is not supported with --fault-tolerance torchft (its plan is agreed by a "
                "fixed world of workers; a torchft quorum decides who syncs)")
    if cfg.on_nonfinite == "skip":
        return f"--on-nonfinite must be stop {why}: skip agrees on every round"
    # every flag off the round in one line: one refusal per flag would send the user round once per flag
    off = [(flag, value) for flag, value in (("--max-steps", cfg.max_steps), ("--eval-every", cfg.eval_every),
                                             ("--save-every", cfg.save_every),
                                             ("--check-replicas-every", cfg.check_replicas_every))
           if value and value % period]
    if off:
        flags = " and ".join(flag for flag, _ in off)
        multiple = "a multiple" if len(off) == 1 else "multiples"
        got = ", ".join(f"{flag} {value}" for flag, value in off)
        fits = " ".join(f"{flag} {max(1, round(value / period)) * period}" for flag, value in off)  # the nearest
        return f"{flags} must be {multiple} of {period} {why}, got {got}; e.g. {fits}"
    speeds = getattr(strategy_config, "worker_speeds", None)
    if speeds is not None and world is not None and len(speeds) != world:
        return f"--worker-speeds must give one value per worker ({world}), got {len(speeds)}"
    return None


class PlannedSequences(ShardedSequences):
    """This worker's micro-batches, each round's windows dealt by the agreed plan (module docstring).

    Args:
        plan: the strategy's ``window_plan`` (read before every micro-batch); the rest as
            :class:`~quietsync.data.sequences.ShardedSequences`.
    """

    def __init__(self, tokens: Tokens, seq_len: int, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 plan: Plan) -> None:
        super().__init__(tokens, seq_len, micro_batch_size, rank, world_size, seed)
        self.plan = plan
        self.round = -1
        """The round whose windows are being read (-1: none yet)."""
        self.counts: list[int] = []
        """Windows of each worker in that round."""
        self.taken = 0
        """This worker's windows read in that round."""
        self.consumed = 0
        """Windows of the epoch's permutation dealt before that round."""
        self._perm: tuple[int, int, torch.Tensor] | None = None  # (epoch, offset, permutation)

    def _epoch_order(self) -> tuple[int, torch.Tensor]:
        """``(offset, permutation)`` of the current epoch: the draws of :class:`ShardedSequences`, whole."""
        if self._perm is None or self._perm[0] != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            offset = int(torch.randint(0, self.seq_len, (1,), generator=g))
            # as ShardedSequences draws it (int32 when it fits: the same permutation, half the memory)
            dtype = torch.int32 if self.num_windows < 2**31 else torch.int64
            self._perm = (self.epoch, offset, torch.randperm(self.num_windows, generator=g, dtype=dtype))
        return self._perm[1], self._perm[2]

    def _slot(self, t: int) -> int:
        """Where this worker's ``t``-th window of the round sits among the round's windows: dealt one per worker in
        turn, so pass ``t`` starts after ``Σ_j min(c_j, t)`` windows."""
        # then, within pass t, the lower ranks still in the turn come first
        return sum(min(c, t) for c in self.counts) + sum(1 for c in self.counts[:self.rank] if c > t)

    def __next__(self) -> torch.Tensor:
        plan = self.plan()
        if plan is None:
            raise RuntimeError("PlannedSequences needs a strategy with adaptive inner steps (its window_plan)")
        number, micro_batches = plan
        if number != self.round:  # a new round: the last one's windows were all read, by every worker
            self.consumed += sum(self.counts)
            counts = [m * self.micro_batch_size for m in micro_batches]
            if self.consumed + sum(counts) > self.num_windows:  # a round never spans two epochs
                self.epoch += 1
                self.consumed = 0
            self.round, self.counts, self.taken = number, counts, 0
        if self.taken + self.micro_batch_size > self.counts[self.rank]:
            raise RuntimeError(f"worker {self.rank} asked for more windows than round {self.round}'s plan deals it "
                               f"({self.counts[self.rank]})")
        offset, perm = self._epoch_order()
        slots = torch.tensor([self.consumed + self._slot(t) for t in range(self.taken,
                                                                            self.taken + self.micro_batch_size)])
        starts = offset + perm[slots].long() * self.seq_len  # int64: token offsets outgrow int32
        self.taken += self.micro_batch_size
        self.last_starts = (self.epoch, starts)  # the data audit's record (QUIETSYNC_AUDIT_DATA)
        return gather_windows(self.tokens, starts, self.seq_len)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "round": self.round, "counts": list(self.counts), "taken": self.taken,
                "consumed": self.consumed, "seed": self.seed, "world_size": self.world_size, "planned": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("planned"):
            raise ValueError("data state was saved without --inner-steps adaptive (its windows are not dealt by a "
                             "plan); resume with the flags it was saved with")
        if state["seed"] != self.seed or state["world_size"] != self.world_size:
            raise ValueError(f"data state was saved with seed {state['seed']} and world size {state['world_size']}, "
                             f"now {self.seed} and {self.world_size}")
        self.epoch, self.round, self.taken = int(state["epoch"]), int(state["round"]), int(state["taken"])
        self.counts, self.consumed = [int(c) for c in state["counts"]], int(state["consumed"])

    def logical_position(self) -> tuple[int, int]:
        """``(epoch, windows dealt)`` counting the open round whole: exact at a round's end, where the trainer
        checkpoints (every worker has read its share; the same on every worker)."""
        return self.epoch, self.consumed + sum(self.counts)

    def continue_from(self, epoch: int, consumed: int) -> None:
        super().continue_from(epoch, consumed)
        # round -1: the next micro-batch opens a round at the saved position
        self.round, self.counts, self.taken, self.consumed = -1, [], 0, int(consumed)


def training_stream(strategy: Any, tokens: Tokens, seq_len: int, micro_batch_size: int, rank: int, world: int,
                    seed: int) -> ShardedSequences:
    """The worker's training stream: dealt by the strategy's plan under adaptive inner steps, else the fixed one."""
    if getattr(strategy, "window_plan", None) is None:
        return ShardedSequences(tokens, seq_len, micro_batch_size, rank, world, seed)
    return PlannedSequences(tokens, seq_len, micro_batch_size, rank, world, seed, lambda: strategy.window_plan)


__all__ = ["PlannedSequences", "adaptive_problem", "round_length", "training_stream"]
