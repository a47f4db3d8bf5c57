"""``ddp``: PyTorch's own DistributedDataParallel, the baseline everybody compares against.

Gradients of ``accumulation`` micro-batches are accumulated locally (DDP's ``no_sync``) and all-reduced bucket by
bucket during the last micro-batch's backward; then every worker runs the full optimizer on its full replica (the
:class:`~quietsync.strategies.substrates.replicated.Replicated` substrate: optimizer, round, checkpoints, the
logical form that reshards). The bucket all-reduce goes through the transport by a DDP communication hook, so it is
metered and link-emulated like every quietsync strategy. ``comm_hook`` picks the hook: the plain fp32 average,
PowerSGD (rank ``powersgd_rank`` after ``powersgd_start_iter`` plain iterations; :mod:`.powersgd`, PyTorch's
algorithm through the transport) or an fp16/bf16 average. PowerSGD's state (per-parameter residuals, warm-start
``Q``, iteration, seed generator) is checkpointed, so a resume on the same workers is exact; it is per worker, so
such a checkpoint is not resharded.

Because DDP decides at *forward* time whether the coming backward synchronises, the strategy sets that
for the next micro-batch at the end of each backward and each :meth:`step` (and at construction).

Precision and clipping: the averaged gradient (``p.grad`` after DDP's all-reduce, equal on every worker) is
unscaled (fp16) and clipped by its norm, computed locally — no collective is added.

Under torchft (``--fault-tolerance torchft``) DDP runs inside each replica group and the replicas present average
the gradient with one more all-reduce, which the quorum commits (:mod:`~quietsync.strategies.parts.across_replicas`).

Accounting: ``idle_s`` is the time the last micro-batch's backward spent after its last bucket's
all-reduce was issued (autograd has nothing left to compute then); the rest of that backward is compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel

from ...validate import check_choice, check_float, check_int
from ..base import Strategy
from ..parts.accumulation import AccumulationConfig
from ..parts.across_replicas import average_across, split_groups
from ..registry import register
from ..substrates.replicated import Replicated
from . import facts
from .powersgd import CAST_HOOK_DTYPES, PowerSGDState, cast_hook, powersgd_hook

COMM_HOOKS = ("allreduce", "powersgd", "fp16", "bf16")


@dataclass
class DDPConfig(AccumulationConfig):
    """Knobs of the ``ddp`` strategy."""

    bucket_cap_mb: float = 25.0
    """Size of DDP's gradient buckets (MB): smaller buckets start communicating earlier."""
    comm_hook: Literal["allreduce", "powersgd", "fp16", "bf16"] = "allreduce"
    """How buckets travel: allreduce (fp32 average), powersgd (rank-r PowerSGD with error feedback and warm
    start, PyTorch's algorithm), fp16 or bf16 (averaged in half precision); every byte through the transport."""
    powersgd_rank: int = 1
    """PowerSGD: rank r of each compressed gradient matrix (comm_hook powersgd)."""
    powersgd_start_iter: int = 10
    """PowerSGD: plain all-reduce iterations before compression starts, >= 2 (comm_hook powersgd)."""
    powersgd_warm_start: bool = True
    """PowerSGD: start each power iteration from the previous step's Q (comm_hook powersgd)."""
    powersgd_error_feedback: bool = True
    """PowerSGD: add what compression lost to the next gradient (comm_hook powersgd)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("bucket_cap_mb", self.bucket_cap_mb, 0, low_open=True)
        check_choice("comm_hook", self.comm_hook, COMM_HOOKS)
        check_int("powersgd_rank", self.powersgd_rank, 1)
        check_int("powersgd_start_iter", self.powersgd_start_iter, 0)
        if self.comm_hook == "powersgd" and (self.powersgd_warm_start or self.powersgd_error_feedback) \
                and self.powersgd_start_iter < 2:
            raise ValueError(f"powersgd_start_iter must be >= 2 with warm start or error feedback (DDP rebuilds "
                             f"its buckets after the first iteration), got {self.powersgd_start_iter}")


@register("ddp", DDPConfig, facts=facts.DDP)
class DDP(Strategy):
    """torch DDP + local gradient accumulation; see the module docstring.

    ``group`` is the group DDP averages over: ``world`` (default), or ``shard`` when another strategy
    (hierarchical DiLoCo) runs DDP inside each node.
    """

    discards_rounds = True

    buffer_sync = "ddp"  # torch DDP syncs the module state at construction and rank 0's buffers before each forward
    reshard_refusal = None  # every worker holds the same model and optimizer state after a step

    config: DDPConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, *, group: str = "world",
                 **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.group, self.across = split_groups(self.transport, group)  # torchft: DDP per replica group, then across
        group = self.group
        # torch DDP broadcasts rank 0's module state itself
        self.replicas = self.hold("replicas", Replicated(self, group, broadcast=False))
        self.round = self.replicas.round
        self._ddp: DistributedDataParallel | None = None
        self._hook: Any = None
        self.powersgd: PowerSGDState | None = None
        if self.config.comm_hook == "powersgd":
            names = {id(p): n for n, p in model.named_parameters()}
            self.powersgd = self.hold("powersgd", PowerSGDState(
                rank=self.config.powersgd_rank, start_iter=self.config.powersgd_start_iter,
                warm_start=self.config.powersgd_warm_start, error_feedback=self.config.powersgd_error_feedback,
                names=names))
            # its residuals are per worker: a checkpoint resumes on the same workers only
            self.reshard_refusal = ("PowerSGD's error-feedback residuals differ from worker to worker and have no "
                                    "world-size-independent form")
        if self.transport.group_size(group) > 1:
            pg = self.transport.process_group(group)
            device_ids = [self.transport.device.index] if self.transport.device.type == "cuda" else None
            self._ddp = DistributedDataParallel(
                model, process_group=pg, device_ids=device_ids, bucket_cap_mb=self.config.bucket_cap_mb,
                gradient_as_bucket_view=True,
            )
            self._ddp.register_comm_hook(None, self._comm_hook(group))
        self._set_sync_for_next()

    def _comm_hook(self, group: str) -> Any:
        """The DDP communication hook of ``comm_hook`` (every one goes through the transport)."""
        cfg = self.config
        if cfg.comm_hook == "allreduce":
            return self.transport.ddp_comm_hook(group)
        if cfg.comm_hook in CAST_HOOK_DTYPES:
            return cast_hook(self.transport, cfg.comm_hook, group)
        self._hook = powersgd_hook(self.transport, self.powersgd, group)
        return self._hook

    def _close(self) -> None:
        if self._hook is not None:
            self._hook.close()

    @property
    def model(self) -> torch.nn.Module:
        return self._ddp if self._ddp is not None else self.module

    def _set_sync_for_next(self) -> None:
        """Whether the next micro-batch's backward all-reduces (DDP reads it in that micro-batch's forward): set
        after every backward as well as after every step, so a loop whose ``step()`` comes after the next forward
        (an adapter paying the step late) still syncs the right micro-batch — a full round commits (or is
        dropped) before the next micro-batch counts."""
        if self._ddp is not None:
            acc = self.round.accumulator
            count = acc.count if acc.count < acc.size else 0
            self._ddp.require_backward_grad_sync = count == acc.size - 1

    def _backward(self, loss: torch.Tensor) -> None:
        last = self.round.accumulator.next_is_last
        t0 = time.perf_counter()
        self.replicas.backward(loss)
        self._set_sync_for_next()
        if last and self._ddp is not None:
            t1 = time.perf_counter()
            issued = [s.t0 for s in self.transport.recorder.spans("comm", since=t0)
                      if s.name.startswith("ddp_bucket")]
            # backward() counts the whole interval as compute; the tail after the last bucket is idle
            if issued:
                self.accounting.move_to_idle(max(0.0, t1 - max(issued)), t1, "ddp_wait")

    def _finish(self, sync: bool) -> None:
        # torch DDP gives every replica rank 0's buffers before each forward; the last forward's are rank 0's too
        self.buffers.sync(self.group, from_rank0=True)

    def _discard(self) -> None:
        self._set_sync_for_next()

    def _step(self) -> bool:
        # the averaged gradient, equal on every worker of the group (DDP's all-reduce); None: the round is not
        # full, or fp16 overflowed (the round is dropped on every worker)
        grads = self.replicas.gradient(shared=self.group == "world")
        if grads is not None:
            if self.across is not None:  # torchft: the replicas present average the group's gradient
                with self.accounting.idle("all_reduce/replicas"):
                    average_across(self.transport, grads, self.across, "all_reduce/replicas")
            self.replicas.commit()
        self._set_sync_for_next()
        return grads is not None

    def _load_state(self, state: dict[str, Any]) -> None:
        self._set_sync_for_next()

    def _load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        super()._load_logical(filled)
        self._set_sync_for_next()
