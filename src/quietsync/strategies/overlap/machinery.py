"""The overlap machinery ACCO, DPU and WP hold (a part): buffers, the communication worker, stage counting and
hand-over, over the sharded flat state (with, where a strategy needs one, the
:class:`~quietsync.strategies.overlap.estimate.EstimatingOptimizer` of :mod:`.estimate`).

Buffers (flat, padded, the parameters' dtype unless noted; Ψ parameters, N workers)::

    params   P  Ψ      the working parameters the model's tensors view (θ, or θ̃ while ACCO's stage 2 runs)
    grads    G  Ψ      where autograd accumulates the current stage's micro-batches (p.grad views it)
    comm     B  Ψ      handed to the communication worker: gradients go out of it (reduce-scatter) and
                       gathered parameters come back into it (all-gather) — Algorithm 1's ``Buffer_i``
    master      Ψ/N    fp32 master shard (the committed θ), ``grad shard`` Ψ/N, optimizer state K'Ψ/N
    scratch     Ψ/N+   a copy of master + optimizer state the estimate step runs on (never committed)

A **stage** is what the main thread computes between two hand-overs: it accumulates micro-batches into G
while a job runs on the communication worker. At a hand-over (:meth:`Overlap.hand_over`): P ← B (the
parameters the job produced), B ← G (the gradients to send), G ← 0, and the strategy submits the next job.
The number of micro-batches per stage is

* adaptive (default): at least ``min_accumulation``, then as many as it takes for the job to finish (the
  main thread never waits on the network), at most ``max_accumulation`` if set (the cap ``--adapt`` re-picks
  between stages: :mod:`.adapt_cap`);
* deterministic: exactly ``deterministic_accumulation`` (the main thread waits for the job if needed).

Stages with no job to overlap (ACCO's first stage, DPU/WP warm-up steps) hold ``deterministic_accumulation``
micro-batches in deterministic mode and ``min_accumulation`` otherwise. Every job all-reduces the per-worker
micro-batch counts (:meth:`Overlap.reduce`), so gradients are Σ over workers and micro-batches / Σ counts: a
slow worker weighs less. The same all-reduce carries each worker's median micro-batch wall time
(:attr:`Overlap.micro_batch_s`, measured between two ``step()`` calls, so a simulated straggler's sleep counts), so
every worker knows everybody's speed (:attr:`Overlap.peer_micro_batch_s`): ACCO uses it to let a straggler leave
its estimate stage empty (``acco.py``).

Precision and clipping: a job that is about to step the optimizer (DPU's and WP's update, ACCO's estimate and
commit) divides the reduced gradient by the loss scale of the stage(s) that produced it (fp16; the main thread
passes each stage's scale with its job and changes the scale only when it collects a commit, so every worker
follows the same sequence), measures its global norm with one scalar all-reduce (:meth:`Overlap.prepare`) and
clips it; an fp16 overflow — the same decision on every worker — skips that optimizer step (θ stays) and the
main thread commits nothing for it.

The strategy files hold what differs: their state machine (which job follows which stage) and their jobs
(the paper's recurrence): ACCO's two stages in ``acco.py``, DPU's warm-up/fill/overlap phases in ``dpu.py``,
and WP, the DPU machine with a predicting job, in ``wp.py``.

Checkpoints that reshard (:meth:`Overlap.logical_state`): the job in flight is **drained** first — its
gradients, summed over the old workers and divided by their micro-batch count, are reduced and its update
taken — so what is left is world-size independent: P and B (whole parameter vectors every worker holds
alike), the master shard, its optimizer state and the snapshot (each a ``Shard(0)`` piece of the unpadded
flat vector), the counters, and the drained job's per-worker micro-batch counts (folded onto the new workers
like the trainer's token counts: only metrics read them). A resumed job on any number of workers installs the
drained round at its next hand-over, exactly as the old world would have.

On CUDA the communication worker runs on its own stream, ordered after the main stream by events; the main
thread only polls :meth:`~quietsync.comm_worker.Job.done` (an event query) between micro-batches, never
synchronises the host per micro-batch.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...comm_worker import CommWorker, Job
from ...flat import nbytes, parse_dtype
from ...validate import check_int
from ..base import Strategy
from ..checkpoint.logical import ReshardError, SavedTensors, local_part
from ..config import StrategyConfig
from ..parts.accounting import StepAccounting
from ..parts.clipping import GradientCheck, prepare_gradient
from ..parts.part import Part
from ..substrates.sharded_state import ShardedState
from .estimate import EstimatingOptimizer

HISTORY = 100_000
"""Stages kept in :attr:`Overlap.stage_history`."""

SPEED_WINDOW = 8
"""Micro-batch wall times whose median is this worker's :attr:`Overlap.micro_batch_s` (a median, so an
evaluation or a checkpoint between two micro-batches does not make a worker look slow)."""

JOB_KINDS = ("estimate", "commit", "update")
"""The ``kind`` of a job's result (ACCO's two stages, DPU/WP's update), by index in a logical checkpoint."""


def fold_counts(counts: list[int], n: int) -> list[int]:
    """Per-worker counts of ``len(counts)`` old workers onto ``n`` new ones: new worker ``r`` takes the sum over
    old ``q`` with ``q mod n == r`` (totals kept)."""
    out = [0] * n
    for q, c in enumerate(counts):
        out[q % n] += int(c)
    return out


@dataclass
class OverlapConfig(StrategyConfig):
    """Accumulation knobs of ``acco``, ``dpu`` and ``wp``."""

    min_accumulation: int = 1
    """Micro-batches each worker computes per stage at least, before it looks at the communication job."""
    max_accumulation: int | None = None
    """Cap on micro-batches per stage: reaching it, the worker waits for the job (None = no cap)."""
    deterministic_accumulation: int | None = None
    """Fixed micro-batches per stage on this worker (reproducible runs, tests); None = adaptive: keep
    computing until the communication job has finished."""
    reduce_dtype: str = "float32"
    """dtype of gradients on the wire: float32, bfloat16 or float16."""

    def __post_init__(self) -> None:
        check_int("min_accumulation", self.min_accumulation, 1)
        check_int("max_accumulation", self.max_accumulation, 1, allow_none=True)
        check_int("deterministic_accumulation", self.deterministic_accumulation, 1, allow_none=True)
        if self.max_accumulation is not None and self.max_accumulation < self.min_accumulation:
            raise ValueError(
                f"max_accumulation must be >= min_accumulation ({self.min_accumulation}) or None, "
                f"got {self.max_accumulation}"
            )
        if self.deterministic_accumulation is not None and (
            self.deterministic_accumulation < self.min_accumulation
            or (self.max_accumulation is not None and self.deterministic_accumulation > self.max_accumulation)
        ):
            raise ValueError(
                "deterministic_accumulation must lie in [min_accumulation, max_accumulation], got "
                f"{self.deterministic_accumulation} with min_accumulation={self.min_accumulation}, "
                f"max_accumulation={self.max_accumulation}"
            )
        parse_dtype(self.reduce_dtype, "reduce_dtype")


class _Done:
    """A finished job (restored from a checkpoint, or drained by :meth:`Overlap.state_dict`)."""

    def __init__(self, result: dict[str, Any], t_start: float = 0.0, t_end: float = 0.0) -> None:
        self.result, self.t_start, self.t_end = result, t_start, t_end

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        return self.result


class Overlap(Part):
    """Stage machinery, jobs and bookkeeping of an overlapping sharded strategy (see the module docstring).

    Args:
        sharded: the sharded flat state the jobs reduce into, step and gather from.
        config: the accumulation knobs.
        accounting: the strategy's step accounting (waits count as idle, hand-overs as compute).
        name: thread name suffix of the communication worker.
        estimate: keep a scratch optimizer for uncommitted steps (ACCO's estimate, WP's prediction).
        snapshot: keep a copy of the committed master shard, so :meth:`committed_params` can rebuild θ while
            the model holds something else (ACCO's stage 2, WP).
        optimizer, optimizer_kwargs: the user's optimizer (for the scratch copy).
    """

    def __init__(self, sharded: ShardedState, config: OverlapConfig, accounting: StepAccounting, *, name: str,
                 estimate: bool, snapshot: bool, optimizer: Any = None,
                 optimizer_kwargs: dict[str, Any] | None = None) -> None:
        self.sharded = sharded
        self.config = config
        self.accounting = accounting
        self.transport = sharded.transport
        self.group = sharded.group
        self.n = self.transport.group_size(self.group)
        flat = sharded.flat
        self.grads = flat.new_grad_buffer()  # G
        flat.attach_grads(self.grads)
        self.comm_buf = flat.new_grad_buffer()  # B
        self.estimator = (EstimatingOptimizer(sharded.shard, sharded.lr, optimizer, optimizer_kwargs or {})
                          if estimate else None)
        self.snapshot = sharded.shard.master.clone() if snapshot else None
        self._snapshot_step = 0
        self._master_step = 0
        self.worker = CommWorker(
            self.transport.device, timeout_s=self.transport.timeout_s, name=f"quietsync-{name}"
        )
        self.job: Job | _Done | None = None
        self.stage_count = 0
        """Micro-batches accumulated into G in the current stage."""
        self.cap = config.max_accumulation
        """Cap on micro-batches per stage in force (``max_accumulation``; ``--adapt`` changes it between stages,
        :meth:`set_cap`)."""
        self.hand_overs = 0
        """Stages ended so far (one job submitted per hand-over): this worker's position in the pipeline."""
        self.holds_committed = True
        """Whether P holds θ (not an estimate or a prediction)."""
        self._last_job_end: float | None = None
        self._comm_wait_s = 0.0  # the communication worker's idle time waiting for a hand-over, this step
        self._compute_wait_s = 0.0
        self.stage_history: deque[list[int]] = deque(maxlen=HISTORY)
        """Per-worker micro-batch counts of each stage whose gradients were communicated, in order (the
        latest ``HISTORY``)."""
        self._pending_counts: list[list[int]] = []  # counts of stages consumed since the last commit
        self._end_now = False  # ending_stage(): the current stage ends at the next step(), however short
        self._recent_micro_batch_s: deque[float] = deque(maxlen=SPEED_WINDOW)
        self._step_left: float | None = None  # when the strategy's step() last returned (main thread)
        self.micro_batch_s = 0.0
        """Median wall time of this worker's recent micro-batches (0 = not measured yet); shared by
        :meth:`reduce`."""
        self._job_speeds: list[float] = []  # written by the communication worker in reduce()
        self.peer_micro_batch_s: list[float] = []
        """Every worker's :attr:`micro_batch_s` as the last collected job all-reduced them (by group rank)."""
        self.job_s: dict[str, float] = {}
        """Seconds the last collected job of each ``kind`` ran on this worker's communication thread (from
        its start there to its end, waiting for peers included; on CUDA the host side only)."""
        self.last_probe: tuple[float, float] | None = None
        """``(bandwidth, micro-batch seconds)`` the last job that carried a link probe agreed (:meth:`reduce`);
        written by the communication worker."""

    @classmethod
    def for_strategy(cls, strategy: Strategy, *, estimate: bool, snapshot: bool) -> Overlap:
        """The machinery of ``strategy`` over ``world``: its sharded state (rank 0's parameters broadcast) and
        buffers, built from the strategy's parameter groups, optimizer and config."""
        config = strategy.config
        assert isinstance(config, OverlapConfig)
        sharded = ShardedState(strategy.param_groups, strategy.optimizer_factory, strategy.optimizer_kwargs,
                               strategy.transport, "world", config.reduce_dtype)
        overlap = cls(sharded, config, strategy.accounting, name=strategy.name, estimate=estimate,
                      snapshot=snapshot, optimizer=strategy.optimizer_factory,
                      optimizer_kwargs=strategy.optimizer_kwargs)
        return overlap

    # ------------------------------------------------------------------ main thread
    def time_micro_batch(self) -> float | None:
        """At the top of the strategy's ``step()``: the main-thread time since the last ``step()`` returned is
        one micro-batch (data, forward, backward, and a simulated slow worker's sleep, like a slower device).
        Returns it (None when there is none to time)."""
        now = time.perf_counter()
        if self._step_left is not None and not self._end_now:
            self._recent_micro_batch_s.append(now - self._step_left)
            self.micro_batch_s = statistics.median(self._recent_micro_batch_s)
            return now - self._step_left
        return None

    def step_returned(self) -> None:
        """At the end of the strategy's ``step()`` (see :meth:`time_micro_batch`)."""
        self._step_left = time.perf_counter()

    def timed_step(self, advance: Callable[[], bool], adapter: Any = None) -> bool:
        """The strategy's ``step()``, ``advance()``, timed: the main-thread time before it is a micro-batch
        (:meth:`time_micro_batch`), handed to ``adapter`` (``--adapt``'s controller) when there is one."""
        seconds = self.time_micro_batch()
        if adapter is not None and seconds is not None:
            adapter.micro_batch(seconds)
        try:
            return advance()
        finally:
            self.step_returned()

    def backward(self, loss: torch.Tensor) -> bool:
        """One micro-batch of the current stage: its gradient accumulates into G (taken: True)."""
        self.sharded.flat.require_grads_attached(self.grads)
        self.worker.check()
        loss.backward()
        self.stage_count += 1
        return True

    @property
    def blocking_count(self) -> int:
        """Micro-batches of a stage that has no job to overlap with."""
        det = self.config.deterministic_accumulation
        return det if det is not None else self.config.min_accumulation

    def start(self, job: Callable[..., dict[str, Any]], *args: Any) -> bool:
        """A stage with no job to overlap: once it holds its micro-batches, hand its gradients over and submit
        ``job(count, *args)``. Returns whether it did."""
        self.worker.check()
        if self.stage_count < self.blocking_count and not self._end_now:
            return False
        self.submit(job, self.hand_over(install=None), *args)
        return True

    def stage_ready(self) -> bool:
        """Whether the current stage may end now (called after each micro-batch while a job runs)."""
        self.worker.check()
        if self._end_now:
            return True
        cfg, n = self.config, self.stage_count
        if n < cfg.min_accumulation:
            return False
        if cfg.deterministic_accumulation is not None:
            return n >= cfg.deterministic_accumulation
        if self.cap is not None and n >= self.cap:
            return True
        assert self.job is not None
        return self.job.done()

    def wait(self, name: str) -> dict[str, Any]:
        """Collect the running job's result, accounting any blocking as idle time."""
        job = self.job
        assert job is not None
        if job.done():
            result = job.wait()
        else:
            t0 = time.perf_counter()
            with self.accounting.idle(name):
                result = job.wait()
            self._compute_wait_s += time.perf_counter() - t0
        if self._last_job_end is not None and job.t_start:
            self._comm_wait_s += max(0.0, job.t_start - self._last_job_end)
        self._last_job_end = job.t_end or None
        self.job = None
        if job.t_start and job.t_end:
            self.job_s[result.get("kind", "")] = job.t_end - job.t_start
        if self._job_speeds:  # read here, while no job runs: the next one rewrites them
            self.peer_micro_batch_s, self._job_speeds = self._job_speeds, []
        counts = result.get("counts")
        if counts is not None:
            self.stage_history.append(list(counts))
            self._pending_counts.append(list(counts))
        return result

    def hand_over(self, install: Literal["committed", "estimate"] | None) -> int:
        """P ← B (unless ``install`` is None), B ← G, G ← 0; return the ended stage's local micro-batch count.
        ``install`` says what B holds: θ of a committed step, or an ``estimate`` (ACCO's θ̃, WP's prediction) —
        which :attr:`holds_committed` then records for evaluation and checkpoints."""
        t0 = time.perf_counter()
        with torch.no_grad():
            if install is not None:
                self.sharded.flat.data.copy_(self.comm_buf)
                self.holds_committed = install == "committed"
            self.comm_buf.copy_(self.grads)
            self.grads.zero_()
        t1 = time.perf_counter()
        self.accounting.add_compute(t1 - t0)
        self.transport.recorder.add("compute", "hand_over", t0, t1)
        count, self.stage_count = self.stage_count, 0
        self.hand_overs += 1
        return count

    def set_cap(self, cap: int) -> None:
        """Cap the stages from the current one on at ``cap`` micro-batches; only at a stage boundary (no
        micro-batch of the current stage computed yet), so a stage is never cut or stretched half-way."""
        if self.stage_count:
            raise RuntimeError(f"the stage cap changes only at a stage boundary; {self.stage_count} micro-batches "
                               "of the current stage are already accumulated")
        self.cap = int(cap)

    def install(self) -> None:
        """P ← B without handing gradients over: the committed θ of a blocking step (or of the last job)."""
        with torch.no_grad():
            self.sharded.flat.data.copy_(self.comm_buf)
        self.holds_committed = True

    def submit(self, fn: Callable[..., dict[str, Any]], *args: Any) -> None:
        """Run ``fn(*args)`` on the communication worker (one job at a time)."""
        self.job = self.worker.submit(fn, *args)

    def step_record(self) -> tuple[dict[str, Any], int]:
        """``(extra, local micro-batches)`` of the step being committed: the per-worker counts of the stages
        consumed since the last commit and the two waits (main thread on the worker and vice versa)."""
        counts = self._pending_counts
        per_worker = [sum(c[i] for c in counts) for i in range(self.n)] if counts else [0] * self.n
        extra = {
            "micro_batches_per_worker": per_worker,
            "stage_micro_batches": [list(c) for c in counts],
            "global_micro_batches": sum(per_worker),
            "compute_wait_s": self._compute_wait_s,
            "comm_wait_s": self._comm_wait_s,
        }
        self._pending_counts = []
        self._compute_wait_s = self._comm_wait_s = 0.0
        return extra, per_worker[self.transport.group_rank(self.group)]

    def behind_peers(self) -> bool:
        """Whether another worker has ended more stages than this one (a collective on the transport's control
        group). A loop that stops after a fixed number of micro-batches (a Trainer's ``max_steps``, the end of
        a data loader) can leave an adaptive worker one stage behind a peer whose job then waits for it; never
        more than one, since a job completes only once every worker submitted it."""
        return self.transport.agree(self.hand_overs, "max") > self.hand_overs

    @property
    def ending(self) -> bool:
        """Whether the current stage is being ended at once (inside :meth:`ending_stage`)."""
        return self._end_now

    @contextmanager
    def ending_stage(self) -> Iterator[None]:
        """Within this context the current stage may end at once (the strategy's ``step()`` hands it over with
        the micro-batches it holds, possibly none), as a worker catching up with its peers must."""
        self._end_now = True
        try:
            yield
        finally:
            self._end_now = False

    def outdated(self) -> None:
        """P no longer holds θ: a job committed a step whose parameters were not installed (B holds WP's
        prediction of them); :meth:`install_committed` gathers them."""
        self.holds_committed = False

    def install_committed(self, steps: int) -> None:
        """P ← θ of committed step ``steps``, for good (a strategy ending its run while P holds an estimate or
        a prediction): all-gathered from the master shards on the communication worker, so every worker calls
        it at the same step."""
        if self.holds_committed:
            return
        self.worker.submit(self._gather_committed, steps, self.sharded.flat.data).wait()
        self.holds_committed = True

    def drop_stage(self) -> None:
        """Forget the micro-batches of the current stage (G ← 0): they will never be handed over."""
        with torch.no_grad():
            self.grads.zero_()
        self.stage_count = 0
    def drop_pending(self) -> None:
        """Forget the stages consumed since the last commit (their round was dropped: an fp16 overflow)."""
        self._pending_counts = []

    # ------------------------------------------------------------------ communication worker
    def reduce(self, local_count: int, name: str,
               probe: tuple[float, float] | None = None) -> tuple[list[int], float]:
        """Job part: all-reduce the per-worker counts (and micro-batch times, kept for :attr:`peer_micro_batch_s`),
        reduce-scatter B: ``shard.grad`` ← Σ over workers (not divided). Returns the counts and their total.

        ``probe`` (``--adapt``: this worker's measured ``(bandwidth, micro-batch seconds)``) rides on the same
        all-reduce, two more floats per worker, and :attr:`last_probe` becomes the agreed pair: the fastest link
        any worker saw (as :class:`~quietsync.strategies.parts.link_probe.LinkProbe` agrees it) and the fastest
        worker's micro-batch (the one a cap must let hide the job; 0 where none measured yet)."""
        n, rank = self.n, self.transport.group_rank(self.group)
        counts = torch.zeros((4 if probe is not None else 2) * n, dtype=torch.float64, device=self.transport.device)
        counts[rank] = float(local_count)
        counts[n + rank] = self.micro_batch_s  # a float written by the main thread: read once, either value is fine
        if probe is not None:
            counts[2 * n + rank], counts[3 * n + rank] = float(probe[0]), float(probe[1])
        self.transport.all_reduce(counts, self.group, name=f"all_reduce/counts_{name}")
        values = counts.tolist()
        per_worker = [int(round(c)) for c in values[:n]]
        self._job_speeds = values[n:2 * n]
        if probe is not None:
            steps = [s for s in values[3 * n:] if s > 0]
            self.last_probe = (max(values[2 * n:3 * n]), min(steps) if steps else 0.0)
        self.sharded.reduce_scatter_grads(self.comm_buf, 1.0, name=name)
        return per_worker, float(sum(per_worker))

    def prepare(self, max_norm: float | None, fp16: bool) -> GradientCheck | None:
        """Job part: ``shard.grad`` (the averaged gradient's shard, already unscaled) measured over the group —
        one scalar all-reduce, so the finite decision is the same on every worker — and clipped to
        ``max_norm``. None when neither clipping nor fp16 is on (nothing runs)."""
        if max_norm is None and not fp16:
            return None
        return prepare_gradient([self.sharded.shard.grad], max_norm=max_norm, scale=None,
                                transport=self.transport, norm_group=self.group)

    def gather(self, shard: torch.Tensor, name: str) -> None:
        """Job part: B ← every worker's ``shard`` (parameters, in the working dtype)."""
        self.sharded.all_gather_params(self.comm_buf, shard, name)

    def commit_shard(self, lr_scale: float) -> None:
        """Job part: the real optimizer step on the master shard (state committed), keeping θ's snapshot."""
        if self.snapshot is not None:
            self.snapshot.copy_(self.sharded.shard.master)
            self._snapshot_step = self._master_step
        self.sharded.step(lr_scale)
        self._master_step += 1

    def _gather_committed(self, want_step: int, out: torch.Tensor) -> None:
        """Job: ``out`` ← θ of committed step ``want_step`` (from the master shard or its snapshot)."""
        if self._master_step == want_step:
            src = self.sharded.shard.master
        elif self.snapshot is not None and self._snapshot_step == want_step:
            src = self.snapshot
        else:  # pragma: no cover - a bookkeeping bug, not a user error
            raise RuntimeError(f"committed parameters of step {want_step} are no longer available")
        self.sharded.all_gather_params(out, src, "committed_params")

    # ------------------------------------------------------------------ contract helpers
    @contextmanager
    def committed_params(self, model: torch.nn.Module, steps: int) -> Iterator[torch.nn.Module]:
        """``model`` holds the committed θ of step ``steps`` inside the context.

        Free when P already holds θ. Otherwise θ is all-gathered from the master shards (or the snapshot), so
        every worker must enter the context at the same committed step — as the trainer does, right after
        ``step()`` returned True.
        """
        if self.holds_committed:
            yield model
            return
        flat = self.sharded.flat
        full = torch.empty_like(flat.data)
        self.worker.submit(self._gather_committed, steps, full).wait()
        saved = flat.data.clone()
        with torch.no_grad():
            flat.data.copy_(full)
        try:
            yield model
        finally:
            with torch.no_grad():
                flat.data.copy_(saved)

    def memory_report(self) -> dict[str, int]:
        """Bytes of every buffer (see the module docstring for what each is)."""
        return {
            **self.sharded.memory_report(),
            "grads": nbytes(self.grads),
            "comm_buffer": nbytes(self.comm_buf),
            "estimate_scratch": 0 if self.estimator is None else self.estimator.nbytes(),
            "committed_snapshot": nbytes(self.snapshot),
        }

    def _drain(self) -> None:
        """Wait for the running job (if any) and keep its result as already done."""
        if isinstance(self.job, Job):
            job = self.job
            result = job.wait()
            self.job = _Done(result, job.t_start, job.t_end)

    def position(self) -> dict[str, int]:
        return {"hand_overs": self.hand_overs}

    def state_dict(self) -> dict[str, Any]:
        """Drains the running job first (its result is part of the state), then saves every buffer."""
        self._drain()
        return {
            "sharded": self.sharded.state_dict(),
            "grads": self.grads.clone(),
            "comm_buf": self.comm_buf.clone(),
            "stage_count": self.stage_count,
            "hand_overs": self.hand_overs,
            "holds_committed": self.holds_committed,
            "pending_job": None if self.job is None else copy.deepcopy(self.job.result),
            "pending_counts": [list(c) for c in self._pending_counts],
            "master_step": self._master_step,
            "snapshot": None if self.snapshot is None else self.snapshot.clone(),
            "snapshot_step": self._snapshot_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.job, Job):
            raise RuntimeError("load_state_dict must be called on a fresh strategy, before training")
        self.sharded.load_state_dict(state["sharded"])
        with torch.no_grad():
            self.grads.copy_(state["grads"])
            self.comm_buf.copy_(state["comm_buf"])
        self.stage_count = int(state["stage_count"])
        self.hand_overs = int(state["hand_overs"])
        self.holds_committed = bool(state["holds_committed"])
        self.job = None if state["pending_job"] is None else _Done(state["pending_job"])
        self._pending_counts = [list(c) for c in state["pending_counts"]]
        self._master_step = int(state["master_step"])
        if self.snapshot is not None and state["snapshot"] is not None:
            self.snapshot.copy_(state["snapshot"])
        self._snapshot_step = int(state["snapshot_step"])
        self._last_job_end = self._step_left = None

    # ------------------------------------------------------------------ checkpoints that reshard
    def logical_state(self) -> dict[str, torch.Tensor]:
        """The world-size-independent state after draining the job in flight (see the module docstring):
        the sharded state's (``optim.*``), ``overlap.params`` (P), ``overlap.comm`` (B), ``overlap.snapshot``,
        ``overlap.counters`` and ``overlap.job_counts``."""
        self._drain()
        if self.stage_count or self._pending_counts:
            raise ReshardError("a stage is open (micro-batches not yet handed over): a checkpoint that reshards "
                               "is written right after a committed step")
        numel = self.sharded.flat.numel
        kind = -1 if self.job is None else JOB_KINDS.index(self.job.result["kind"])
        out = {
            **self.sharded.logical_state_dict(),
            "overlap.params": self.sharded.flat.data[:numel].detach(),
            "overlap.comm": self.comm_buf[:numel].detach(),
            "overlap.counters": torch.tensor([self.hand_overs, self._master_step, self._snapshot_step,
                                              int(self.holds_committed), kind], dtype=torch.int64),
        }
        if self.job is not None:
            out["overlap.job_counts"] = torch.tensor(self.job.result["counts"], dtype=torch.int64)
            if self.job.result.get("probe") is not None:  # --adapt's agreed pair (DPU/WP's drained update job)
                out["overlap.job_probe"] = torch.tensor(self.job.result["probe"], dtype=torch.float64)
        if self.snapshot is not None:
            out["overlap.snapshot"] = self.sharded.logical_piece(self.snapshot)
        return out

    def logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        """Tensors of this worker's layout to read :meth:`logical_state` of any world size into."""
        flat = self.sharded.flat
        out = self.sharded.logical_targets(saved)
        for key in ("overlap.params", "overlap.comm"):
            shape = saved.get(key, (None, None))[0]
            if shape is not None and tuple(shape) != (flat.numel,):
                raise ReshardError(f"the checkpoint's {key} has shape {tuple(shape)}; this model's flat buffer "
                                   f"has {flat.numel} elements")
            out[key] = torch.zeros(flat.numel, dtype=flat.dtype, device=flat.device)
        out["overlap.counters"] = torch.zeros(5, dtype=torch.int64)
        if "overlap.job_counts" in saved:
            out["overlap.job_counts"] = torch.zeros(saved["overlap.job_counts"][0], dtype=torch.int64)
        if "overlap.job_probe" in saved:
            out["overlap.job_probe"] = torch.zeros(2, dtype=torch.float64)
        if self.snapshot is not None:
            out["overlap.snapshot"] = self.sharded.logical_piece_target(self.snapshot.dtype)
        return out

    def load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        """Take :meth:`logical_targets` filled: the drained job is done, its result waiting to be collected."""
        if isinstance(self.job, Job):
            raise RuntimeError("load_logical must be called on a fresh strategy, before training")
        self.sharded.load_logical(filled)
        flat, numel = self.sharded.flat, self.sharded.flat.numel
        with torch.no_grad():
            for dst, key in ((flat.data, "overlap.params"), (self.comm_buf, "overlap.comm")):
                dst.zero_()
                dst[:numel].copy_(filled[key])
            self.grads.zero_()
        if self.snapshot is not None:
            self.sharded.load_logical_piece(self.snapshot, filled["overlap.snapshot"])
        hand_overs, master_step, snapshot_step, holds, kind = (int(x) for x in filled["overlap.counters"])
        self.hand_overs, self._master_step, self._snapshot_step = hand_overs, master_step, snapshot_step
        self.holds_committed = bool(holds)
        counts = fold_counts(local_part(filled["overlap.job_counts"]).tolist(), self.n) \
            if "overlap.job_counts" in filled else None
        self.job = None if kind < 0 else _Done({"kind": JOB_KINDS[kind], "counts": counts})
        if self.job is not None and "overlap.job_probe" in filled:
            self.job.result["probe"] = tuple(float(x) for x in filled["overlap.job_probe"])
        self.stage_count, self._pending_counts, self._last_job_end = 0, [], None

    def close(self) -> None:
        self.worker.close()
