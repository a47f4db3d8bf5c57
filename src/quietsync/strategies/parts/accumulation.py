"""Fixed gradient accumulation (parts): the ``accumulation`` knob, its round counter, and the local round.

Strategies that step every ``accumulation`` micro-batches (ddp, zero1, demo, flexdemo, localsgd, diloco)
take their config from :class:`AccumulationConfig` and hold an :class:`Accumulator`. Those whose update is a
full (unsharded) optimizer on every worker (ddp, localsgd, diloco's local inner steps) hold an
:class:`OptimizerRound`: micro-batches accumulate into ordinary ``p.grad``, then one optimizer step at the
scheduled lr.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ...events import label
from ...flat import nbytes
from ...validate import check_int
from ..config import StrategyConfig
from .accounting import StepAccounting
from .lr import LRScaler
from .part import Part


@dataclass
class AccumulationConfig(StrategyConfig):
    """Configs of strategies with fixed gradient accumulation."""

    accumulation: int = 1
    """Micro-batches per step on each worker (gradient accumulation)."""

    def __post_init__(self) -> None:
        check_int("accumulation", self.accumulation, 1)


class Accumulator(Part):
    """Counts the micro-batches of the current round; a round is full after ``size`` of them."""

    def __init__(self, size: int) -> None:
        check_int("accumulation", size, 1)
        self.size = size
        self.count = 0

    def add(self) -> None:
        self.count += 1

    @property
    def full(self) -> bool:
        """Whether the round holds ``size`` micro-batches (time to step)."""
        return self.count >= self.size

    @property
    def round_full(self) -> bool:
        return self.full

    @property
    def next_is_last(self) -> bool:
        """Whether the next micro-batch completes the round."""
        return self.count == self.size - 1

    def reset(self) -> None:
        self.count = 0

    def discard(self) -> None:
        """Forget the open round's micro-batches (see ``Strategy.discard_round``)."""
        self.reset()

    def position(self) -> dict[str, int]:
        return {"round": self.count}

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # size itself: a full round saved between its last backward and its step
        check_int("checkpoint accumulation count", state["count"], 0, self.size)
        self.count = int(state["count"])


class OptimizerRound(Part):
    """One round of a full optimizer on this worker (a part): ``accumulation`` micro-batches accumulate into
    ``p.grad`` (each loss scaled by ``1/accumulation``, so the round's gradient is their mean), then the
    optimizer steps at the scheduled lr. Checkpoints hold the optimizer, its base lrs, the round's count and
    the open round's ``p.grad``.

    Args:
        optimizer: a torch optimizer over ``params``.
        accumulation: micro-batches per round.
        params: the parameters autograd accumulates into.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, accumulation: int, params: list[torch.Tensor]
    ) -> None:
        self.optimizer = optimizer
        self.lr = LRScaler(optimizer)
        self.accumulator = Accumulator(accumulation)
        self.params = params

    def backward(self, loss: torch.Tensor) -> bool:
        """One micro-batch: its share ``loss / accumulation`` of the round's mean gradient (taken: True)."""
        (loss / self.accumulator.size).backward()
        self.accumulator.add()
        return True

    @property
    def full(self) -> bool:
        return self.accumulator.full

    @property
    def round_full(self) -> bool:
        return self.accumulator.full

    def discard(self) -> None:
        """Forget the open round: ``p.grad`` zeroed in place (DDP's buckets view it), counter reset."""
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()
        self.accumulator.reset()

    def step(self, lr_scale: float, accounting: StepAccounting) -> dict[str, Any]:
        """The optimizer step on the main thread (counted as compute); gradients zeroed in place; round
        closed. Returns the step's extras for its metrics (none here)."""
        t0 = time.perf_counter()
        self.lr.apply(lr_scale)
        with label("quietsync/optimizer_step"):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # in place: DDP's gradient buckets view p.grad
        accounting.add_compute(time.perf_counter() - t0)
        self.accumulator.reset()
        return {}

    def position(self) -> dict[str, int]:
        return self.accumulator.position()

    def memory_report(self) -> dict[str, int]:
        opt_state = sum(nbytes(v) for st in self.optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor))
        return {"params": sum(nbytes(p) for p in self.params),
                "grads": sum(nbytes(p.grad) for p in self.params if p.grad is not None),
                "optimizer_state": opt_state}

    def state_dict(self) -> dict[str, Any]:
        # clone the open round's p.grad: the live tensor is zeroed in place at the next step
        return {"optimizer": self.optimizer.state_dict(), "lr": self.lr.state_dict(),
                "round": self.accumulator.state_dict(),
                "grads": [None if p.grad is None else p.grad.clone() for p in self.params]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr.load_state_dict(state["lr"])
        self.accumulator.load_state_dict(state["round"])
        with torch.no_grad():
            for p, g in zip(self.params, state["grads"]):
                if g is None:
                    p.grad = None
                elif p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)  # keep the tensor: DDP's gradient buckets view it
