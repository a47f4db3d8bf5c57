"""``ddp``: PyTorch's own DistributedDataParallel, the baseline everybody compares against.

Gradients of ``accumulation`` micro-batches are accumulated locally (DDP's ``no_sync``) and all-reduced
bucket by bucket during the last micro-batch's backward; then every worker runs the full optimizer on its
full replica. The bucket all-reduce goes through the transport by a DDP communication hook, so it is
metered and link-emulated like every quietsync strategy.

Because DDP decides at *forward* time whether the coming backward synchronises, the strategy sets that
for the next micro-batch at the end of each backward and each :meth:`step` (and at construction).

Precision and clipping: the averaged gradient (``p.grad`` after DDP's all-reduce, equal on every worker) is
unscaled (fp16) and clipped by its norm, computed locally — no collective is added.

Accounting: ``idle_s`` is the time the last micro-batch's backward spent after its last bucket's
all-reduce was issued (autograd has nothing left to compute then); the rest of that backward is compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ...validate import check_float
from ..base import Strategy
from ..checkpoint.logical import (
    SavedTensors,
    base_lrs_state,
    base_lrs_target,
    load_module,
    load_optimizer,
    module_state,
    module_targets,
    optimizer_state,
    optimizer_targets,
    parameter_names,
)
from ..parts.accumulation import AccumulationConfig, OptimizerRound
from ..registry import register
from ..substrates.sharded_optimizer import build_optimizer


@dataclass
class DDPConfig(AccumulationConfig):
    """Knobs of the ``ddp`` strategy."""

    bucket_cap_mb: float = 25.0
    """Size of DDP's gradient buckets (MB): smaller buckets start communicating earlier."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("bucket_cap_mb", self.bucket_cap_mb, 0, low_open=True)


@register("ddp", DDPConfig)
class DDP(Strategy):
    """torch DDP + local gradient accumulation; see the module docstring.

    ``group`` is the group DDP averages over: ``world`` (default), or ``shard`` when another strategy
    (hierarchical DiLoCo) runs DDP inside each node.
    """

    discards_rounds = True
    reshard_refusal = None  # every worker holds the same model and optimizer state after a step

    config: DDPConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, *, group: str = "world",
                 **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.group = group
        self.optimizer = build_optimizer(self.optimizer_factory, self.param_groups, self.optimizer_kwargs)
        self.round = self.hold("round", OptimizerRound(self.optimizer, self.config.accumulation,
                                                       list(model.parameters())))
        self._ddp: DistributedDataParallel | None = None
        if self.transport.group_size(group) > 1:
            pg = self.transport.process_group(group)
            device_ids = [self.transport.device.index] if self.transport.device.type == "cuda" else None
            self._ddp = DistributedDataParallel(
                model, process_group=pg, device_ids=device_ids, bucket_cap_mb=self.config.bucket_cap_mb,
                gradient_as_bucket_view=True,
            )
            self._ddp.register_comm_hook(None, self.transport.ddp_comm_hook(group))
        self._set_sync_for_next()

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
        self.round.backward(loss)
        self._set_sync_for_next()
        if last and self._ddp is not None:
            t1 = time.perf_counter()
            issued = [s.t0 for s in self.transport.recorder.spans("comm", since=t0) if s.name == "ddp_bucket"]
            # backward() counts the whole interval as compute; the tail after the last bucket is idle
            if issued:
                self.accounting.move_to_idle(max(0.0, t1 - max(issued)), t1, "ddp_wait")

    def _discard(self) -> None:
        self._set_sync_for_next()

    def _step(self) -> bool:
        if not self.round.full:
            self._set_sync_for_next()
            return False
        # the averaged gradient, equal on every worker of the group (DDP's all-reduce)
        extra = self._prepare_commit([p.grad for p in self.round.params if p.grad is not None],
                                     shared=self.group == "world")
        if extra is None:  # fp16 overflow: the round is dropped on every worker
            self.discard_round()
            return False
        self.round.step(self._lr_scale(self.steps), self.accounting)
        self._commit(extra or None)
        self._set_sync_for_next()
        return True

    def _state(self) -> dict[str, Any]:
        return {"model": self.module.state_dict()}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self._set_sync_for_next()

    def _logical_state(self) -> dict[str, torch.Tensor]:
        names = parameter_names(self.module)
        return {**module_state(self.module), **optimizer_state(self.optimizer, names),
                **base_lrs_state(self.round.lr.base_lrs)}

    def _logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        names = parameter_names(self.module)
        return {**module_targets(self.module), **optimizer_targets(self.optimizer, names, saved),
                **base_lrs_target(self.round.lr.base_lrs, saved)}

    def _load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        load_module(self.module, filled)
        load_optimizer(self.optimizer, parameter_names(self.module), filled)
        self.round.lr.base_lrs = [float(x) for x in filled["optim.base_lrs"]]
        self._set_sync_for_next()
