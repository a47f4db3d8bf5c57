"""``ddp``: PyTorch's own DistributedDataParallel, the baseline everybody compares against.

Gradients of ``accumulation`` micro-batches are accumulated locally (DDP's ``no_sync``) and all-reduced
bucket by bucket during the last micro-batch's backward; then every worker runs the full optimizer on its
full replica. The bucket all-reduce goes through the transport by a DDP communication hook, so it is
metered and link-emulated like every quietsync strategy.

Because DDP decides at *forward* time whether the coming backward synchronises, the strategy sets that
for the next micro-batch at the end of each :meth:`step` (and at construction): call ``strategy.model``'s
forward after the previous ``step()``, as the ordinary loop does.

Accounting: ``idle_s`` is the time the last micro-batch's backward spent after its last bucket's
all-reduce was issued (autograd has nothing left to compute then); the rest of that backward is compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..sharded import build_optimizer, scale_lrs
from .base import Strategy, StrategyConfig
from .registry import register


@dataclass
class DDPConfig(StrategyConfig):
    """Knobs of the ``ddp`` strategy."""

    accumulation: int = 1
    """Micro-batches per step on each worker (gradient accumulation)."""
    bucket_cap_mb: float = 25.0
    """Size of DDP's gradient buckets (MB): smaller buckets start communicating earlier."""

    def __post_init__(self) -> None:
        if not isinstance(self.accumulation, int) or self.accumulation < 1:
            raise ValueError(f"accumulation must be an integer >= 1, got {self.accumulation!r}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")


@register("ddp", DDPConfig)
class DDP(Strategy):
    """torch DDP + local gradient accumulation; see the module docstring."""

    config: DDPConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.optimizer = build_optimizer(self.optimizer_factory, self.param_groups, self.optimizer_kwargs)
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self._round = 0
        self._ddp: DistributedDataParallel | None = None
        if self.world_size > 1:
            pg = self.transport.process_group("world")
            device_ids = [self.transport.device.index] if self.transport.device.type == "cuda" else None
            self._ddp = DistributedDataParallel(
                model, process_group=pg, device_ids=device_ids, bucket_cap_mb=self.config.bucket_cap_mb,
                gradient_as_bucket_view=True,
            )
            self._ddp.register_comm_hook(None, self.transport.ddp_comm_hook("world"))
        self._set_sync_for_next()

    @property
    def model(self) -> torch.nn.Module:
        return self._ddp if self._ddp is not None else self.module

    def _set_sync_for_next(self) -> None:
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = self._round == self.config.accumulation - 1

    def _backward(self, loss: torch.Tensor) -> None:
        last = self._round == self.config.accumulation - 1
        t0 = time.perf_counter()
        (loss / self.config.accumulation).backward()
        if last and self._ddp is not None:
            t1 = time.perf_counter()
            issued = [s.t0 for s in self.transport.recorder.spans("comm", since=t0) if s.name == "ddp_bucket"]
            if issued:
                idle = max(0.0, t1 - max(issued))
                self._idle_s += idle
                self._compute_s -= idle  # backward() adds the whole interval as compute
                self.transport.recorder.add("idle", "ddp_wait", t1 - idle, t1)
        self._round += 1

    def _step(self) -> bool:
        if self._round < self.config.accumulation:
            self._set_sync_for_next()
            return False
        t0 = time.perf_counter()
        scale_lrs(self.optimizer, self.base_lrs, self._lr_scale(self.steps))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self._add_compute(time.perf_counter() - t0)
        self._round = 0
        self._commit()
        self._set_sync_for_next()
        return True

    def _state(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "base_lrs": self.base_lrs, "round": self._round,
                "grads": [None if p.grad is None else p.grad.clone() for p in self.module.parameters()]}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.base_lrs = list(state["base_lrs"])
        self._round = int(state["round"])
        with torch.no_grad():
            for p, g in zip(self.module.parameters(), state["grads"]):
                if g is not None:
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
                elif p.grad is not None:
                    p.grad.zero_()
        self._set_sync_for_next()
