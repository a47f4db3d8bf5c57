"""Machinery shared by the overlapping sharded strategies (ACCO, DPU, WP): two gradient buffers, a
communication buffer, a sharded optimizer that can *estimate* without committing, adaptive accumulation.

Buffers (flat, padded, the parameters' dtype unless noted; Ψ parameters, N workers)::

    params   P  Ψ      the working parameters the model's tensors view (θ, or θ̃ while ACCO's stage 2 runs)
    grads    G  Ψ      where autograd accumulates the current stage's micro-batches (p.grad views it)
    comm     B  Ψ      handed to the communication worker: gradients go out of it (reduce-scatter) and
                       gathered parameters come back into it (all-gather) — Algorithm 1's ``Buffer_i``
    master      Ψ/N    fp32 master shard (the committed θ), ``grad shard`` Ψ/N, optimizer state K'Ψ/N
    scratch     Ψ/N+   a copy of master + optimizer state the estimate step runs on (never committed)

A **stage** is what the main thread computes between two hand-overs: it accumulates micro-batches into G
while a job runs on the communication worker. At a hand-over (``_switch``): P ← B (the parameters the job
produced), B ← G (the gradients to send), G ← 0, and the next job is submitted. The number of micro-batches
per stage is

* adaptive (default): at least ``min_accumulation``, then as many as it takes for the job to finish (the
  main thread never waits on the network), at most ``max_accumulation`` if set;
* deterministic: exactly ``deterministic_accumulation`` (the main thread waits for the job if needed).

Stages with no job to overlap (ACCO's first stage, DPU/WP warm-up steps) hold ``deterministic_accumulation``
micro-batches in deterministic mode and ``min_accumulation`` otherwise. Every job all-reduces the per-worker
micro-batch counts, so gradients are Σ over workers and micro-batches / Σ counts: a slow worker weighs less.

On CUDA the communication worker runs on its own stream, ordered after the main stream by events; the main
thread only polls :meth:`~quietsync.comm_worker.Job.done` (an event query) between micro-batches, never
synchronises the host per micro-batch.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..comm_worker import CommWorker, Job
from ..flat import parse_dtype
from ..sharded import build_optimizer, scale_lrs
from .base import StrategyConfig
from .zero1 import ShardedBase

HISTORY = 100_000
"""Stages kept in :attr:`OverlapBase.stage_history`."""


def _check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{extra}, got {value!r}")


@dataclass
class OverlapConfig(StrategyConfig):
    """Accumulation knobs shared by ``acco``, ``dpu`` and ``wp``."""

    min_accumulation: int = 1
    """Micro-batches each worker computes per stage at least, before it looks at the communication job."""
    max_accumulation: int | None = None
    """Cap on micro-batches per stage: reaching it, the worker waits for the job (None = no cap)."""
    deterministic_accumulation: int | None = None
    """Fixed micro-batches per stage on this worker (reproducible runs, tests); None = adaptive: keep computing until the communication job has finished."""
    reduce_dtype: str = "float32"
    """dtype of gradients on the wire: float32, bfloat16 or float16."""

    def __post_init__(self) -> None:
        _check_int("min_accumulation", self.min_accumulation, 1)
        _check_int("max_accumulation", self.max_accumulation, 1, allow_none=True)
        _check_int("deterministic_accumulation", self.deterministic_accumulation, 1, allow_none=True)
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
    """A finished job (restored from a checkpoint, or drained by :meth:`state_dict`)."""

    def __init__(self, result: dict[str, Any], t_start: float = 0.0, t_end: float = 0.0) -> None:
        self.result, self.t_start, self.t_end = result, t_start, t_end

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        return self.result


class EstimatingOptimizer:
    """Runs the sharded optimizer on a scratch copy of the master shard and of the optimizer state.

    ``estimate(lr_scale)`` returns Opt(θ_shard, grad_shard) — the step the real optimizer *would* take from
    its current state — without touching the real master, moments or step counter (also before the first
    committed step, when the real state is still empty). Works for any torch optimizer whose state is a
    dict of tensors and Python values per parameter.
    """

    def __init__(self, sharded: Any, factory: Any, kwargs: dict[str, Any]) -> None:
        self.sharded = sharded
        self.master = sharded.master.clone()
        self.views: list[torch.Tensor] = []
        groups = []
        for (a, b), real in zip(sharded.slices, sharded.optimizer.param_groups):
            view = self.master[a:b]
            view.grad = sharded.grad[a:b]  # the estimate uses the gradient the real step would use
            self.views.append(view)
            groups.append({**{k: v for k, v in real.items() if k != "params"}, "params": [view]})
        self.optimizer = build_optimizer(factory, groups, kwargs)

    def estimate(self, lr_scale: float) -> torch.Tensor:
        real = self.sharded.optimizer
        self.master.copy_(self.sharded.master)
        for rg, sg, view in zip(real.param_groups, self.optimizer.param_groups, self.views):
            for k, v in rg.items():
                if k != "params":
                    sg[k] = v
            (p,) = rg["params"]
            src = real.state.get(p)
            if not src:
                self.optimizer.state.pop(view, None)
                continue
            dst = self.optimizer.state.setdefault(view, {})
            for k, v in src.items():
                if isinstance(v, torch.Tensor):
                    if k in dst and isinstance(dst[k], torch.Tensor) and dst[k].shape == v.shape \
                            and dst[k].dtype == v.dtype:
                        dst[k].copy_(v)
                    else:
                        dst[k] = v.clone()
                else:
                    dst[k] = copy.deepcopy(v)
            for k in [k for k in dst if k not in src]:
                del dst[k]
        scale_lrs(self.optimizer, self.sharded.base_lrs, lr_scale)
        self.optimizer.step()
        return self.master

    def nbytes(self) -> int:
        state = sum(v.numel() * v.element_size() for st in self.optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor))
        return self.master.numel() * self.master.element_size() + state


class OverlapBase(ShardedBase):
    """Base of ACCO / DPU / WP: stage machinery, jobs, bookkeeping, checkpoints (see the module docstring)."""

    config: OverlapConfig
    uses_estimate = False
    """Whether jobs run uncommitted optimizer steps (ACCO's estimate, WP's prediction): keeps a scratch copy."""
    keeps_snapshot = False
    """Whether the model may hold something other than θ after a commit (then a shard snapshot of θ is kept
    so :meth:`committed_params` can rebuild it)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.n = self.transport.group_size(self.group)
        self.grads = self.flat.new_grad_buffer()  # G
        self.flat.attach_grads(self.grads)
        self.comm_buf = self.flat.new_grad_buffer()  # B
        self.estimator = (EstimatingOptimizer(self.sharded, self.optimizer_factory, self.optimizer_kwargs)
                          if self.uses_estimate else None)
        self.snapshot = self.sharded.master.clone() if self.keeps_snapshot else None
        self._snapshot_step = 0
        self._master_step = 0
        self.worker = CommWorker(self.transport.device, timeout_s=self.transport.timeout_s,
                                 name=f"quietsync-{self.name}")
        self._job: Job | _Done | None = None
        self._stage_count = 0  # micro-batches accumulated into G in the current stage
        self._holds_committed = True  # whether P holds θ (not an estimate)
        self._last_job_end: float | None = None
        self._comm_wait_s = 0.0  # the communication worker's idle time waiting for a hand-over, this step
        self._compute_wait_s = 0.0
        self.stage_history: deque[list[int]] = deque(maxlen=HISTORY)
        """Per-worker micro-batch counts of each stage whose gradients were communicated, in order (the
        latest ``HISTORY``)."""
        self._pending_counts: list[list[int]] = []  # counts of stages consumed since the last commit

    # ------------------------------------------------------------------ knobs
    @property
    def blocking_count(self) -> int:
        """Micro-batches of a stage that has no job to overlap with."""
        det = self.config.deterministic_accumulation
        return det if det is not None else self.config.min_accumulation

    def _stage_ready(self) -> bool:
        """Whether the current stage may end now (called after each micro-batch while a job runs)."""
        cfg, n = self.config, self._stage_count
        if n < cfg.min_accumulation:
            return False
        if cfg.deterministic_accumulation is not None:
            return n >= cfg.deterministic_accumulation
        if cfg.max_accumulation is not None and n >= cfg.max_accumulation:
            return True
        assert self._job is not None
        return self._job.done()

    # ------------------------------------------------------------------ main thread
    def _backward(self, loss: torch.Tensor) -> None:
        if not self.flat.grads_attached_to(self.grads):
            raise RuntimeError(
                "parameter .grad tensors were replaced (e.g. by zero_grad(set_to_none=True)); the strategy "
                "owns the gradients — do not zero them yourself"
            )
        self.worker.check()
        loss.backward()
        self._stage_count += 1

    def _wait(self, name: str) -> dict[str, Any]:
        """Collect the running job's result, accounting any blocking as idle time."""
        job = self._job
        assert job is not None
        if job.done():
            result = job.wait()
        else:
            t0 = time.perf_counter()
            with self._idle(name):
                result = job.wait()
            self._compute_wait_s += time.perf_counter() - t0
        if self._last_job_end is not None and job.t_start:
            self._comm_wait_s += max(0.0, job.t_start - self._last_job_end)
        self._last_job_end = job.t_end or None
        self._job = None
        counts = result.get("counts")
        if counts is not None:
            self.stage_history.append(list(counts))
            self._pending_counts.append(list(counts))
        return result

    def _hand_over(self, install: bool) -> int:
        """P ← B (if ``install``), B ← G, G ← 0; return the ended stage's local micro-batch count."""
        t0 = time.perf_counter()
        with torch.no_grad():
            if install:
                self.flat.data.copy_(self.comm_buf)
            self.comm_buf.copy_(self.grads)
            self.grads.zero_()
        t1 = time.perf_counter()
        self._add_compute(t1 - t0)
        self.transport.recorder.add("compute", "hand_over", t0, t1)
        count, self._stage_count = self._stage_count, 0
        return count

    def _install(self) -> None:
        """P ← B without handing gradients over (a blocking step's parameters)."""
        with torch.no_grad():
            self.flat.data.copy_(self.comm_buf)

    def _submit(self, fn: Any, *args: Any) -> None:
        self._job = self.worker.submit(fn, *args)

    def _commit_step(self) -> None:
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
        self._commit(extra, micro_batches=per_worker[self.transport.group_rank(self.group)])

    # ------------------------------------------------------------------ communication worker
    def _count_vector(self, local: int) -> torch.Tensor:
        v = torch.zeros(self.n, dtype=torch.float64, device=self.transport.device)
        v[self.transport.group_rank(self.group)] = float(local)
        return v

    def _reduce(self, local_count: int, name: str) -> tuple[list[int], float]:
        """All-reduce the per-worker counts, reduce-scatter B: ``sharded.grad`` ← Σ over workers (not divided)."""
        counts = self._count_vector(local_count)
        self.transport.all_reduce(counts, self.group, name=f"all_reduce/counts_{name}")
        per_worker = [int(round(c)) for c in counts.tolist()]
        self.reduce_scatter_grads(self.comm_buf, 1.0, name=name)
        return per_worker, float(sum(per_worker))

    def _gather(self, shard: torch.Tensor, name: str) -> None:
        """B ← every worker's ``shard`` (parameters, in the working dtype)."""
        send = shard.to(self.flat.dtype) if shard.dtype != self.flat.dtype else shard.clone()
        self.transport.all_gather(self.comm_buf, send, self.group, name=f"all_gather/{name}")

    def _commit_shard(self, lr_step: int) -> None:
        """The real optimizer step on the master shard (state committed), keeping θ's snapshot if needed."""
        if self.snapshot is not None:
            self.snapshot.copy_(self.sharded.master)
            self._snapshot_step = self._master_step
        self.sharded.step(self._lr_scale(lr_step))
        self._master_step += 1

    def _gather_committed(self, want_step: int, out: torch.Tensor) -> None:
        """Job: ``out`` ← θ of committed step ``want_step`` (from the master shard or its snapshot)."""
        if self._master_step == want_step:
            src = self.sharded.master
        elif self.snapshot is not None and self._snapshot_step == want_step:
            src = self.snapshot
        else:  # pragma: no cover - a bookkeeping bug, not a user error
            raise RuntimeError(f"committed parameters of step {want_step} are no longer available")
        send = src.to(self.flat.dtype) if src.dtype != self.flat.dtype else src.clone()
        self.transport.all_gather(out, send, self.group, name="all_gather/committed_params")

    # ------------------------------------------------------------------ contract
    @contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """``self.model`` holds the committed θ inside the context.

        Free when the model already holds θ (always for DPU; for ACCO right after a committed step).
        Otherwise (WP after its first overlapped step, ACCO during stage 2) θ is all-gathered from the
        master shards, so every worker must enter the context at the same committed step — as the trainer
        does, right after ``step()`` returned True.
        """
        if self._holds_committed:
            yield self.model
            return
        full = torch.empty_like(self.flat.data)
        job = self.worker.submit(self._gather_committed, self.steps, full)
        job.wait()
        saved = self.flat.data.clone()
        with torch.no_grad():
            self.flat.data.copy_(full)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                self.flat.data.copy_(saved)

    def memory_report(self) -> dict[str, int]:
        """Bytes of every buffer this worker holds (see the module docstring for what each is)."""
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        report = super().memory_report()
        report.update({
            "grads": size(self.grads),
            "comm_buffer": size(self.comm_buf),
            "estimate_scratch": 0 if self.estimator is None else self.estimator.nbytes(),
            "committed_snapshot": size(self.snapshot),
        })
        report.update(self._extra_memory())
        return report

    def _extra_memory(self) -> dict[str, int]:
        return {}

    def _drain(self) -> None:
        """Wait for the running job (if any) and keep its result as already done."""
        if isinstance(self._job, Job):
            job = self._job
            result = job.wait()
            self._job = _Done(result, job.t_start, job.t_end)

    def _state(self) -> dict[str, Any]:
        self._drain()
        state = {
            **self._sharded_state(),
            "grads": self.grads.clone(),
            "comm_buf": self.comm_buf.clone(),
            "stage_count": self._stage_count,
            "holds_committed": self._holds_committed,
            "pending_job": None if self._job is None else copy.deepcopy(self._job.result),
            "pending_counts": [list(c) for c in self._pending_counts],
            "master_step": self._master_step,
            "snapshot": None if self.snapshot is None else self.snapshot.clone(),
            "snapshot_step": self._snapshot_step,
        }
        state.update(self._algo_state())
        return state

    def _load_state(self, state: dict[str, Any]) -> None:
        if isinstance(self._job, Job):
            raise RuntimeError("load_state_dict must be called on a fresh strategy, before training")
        self._load_sharded_state(state)
        with torch.no_grad():
            self.grads.copy_(state["grads"])
            self.comm_buf.copy_(state["comm_buf"])
        self._stage_count = int(state["stage_count"])
        self._holds_committed = bool(state["holds_committed"])
        self._job = None if state["pending_job"] is None else _Done(state["pending_job"])
        self._pending_counts = [list(c) for c in state["pending_counts"]]
        self._master_step = int(state["master_step"])
        if self.snapshot is not None and state["snapshot"] is not None:
            self.snapshot.copy_(state["snapshot"])
        self._snapshot_step = int(state["snapshot_step"])
        self._last_job_end = None
        self._load_algo_state(state)

    def _algo_state(self) -> dict[str, Any]:
        return {}

    def _load_algo_state(self, state: dict[str, Any]) -> None:
        pass

    def _close(self) -> None:
        self.worker.close()
