"""Learning-rate scaling: how a strategy applies ``lr_schedule`` to the optimizer it runs (a part).

Every strategy applies the schedule the same way: before each optimizer step, each parameter group's lr
becomes its *base* lr (the one it was built with) times ``lr_schedule(committed_steps)``. The base lrs are
part of the checkpoint so a resumed run continues the same schedule.
"""

from __future__ import annotations

from typing import Any

import torch

from .part import Part


class LRScaler(Part):
    """The base lrs of ``optimizer``'s groups and the one way to scale them."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # read once, before apply() overwrites each group's lr with a scaled one
        self.base_lrs: list[float] = [g["lr"] for g in optimizer.param_groups]

    def apply(self, scale: float, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Set each group's lr to its base lr times ``scale`` (on ``optimizer``, by default the one held;
        another one must have the same groups, e.g. a scratch copy that estimates a step)."""
        target = self.optimizer if optimizer is None else optimizer
        for group, base in zip(target.param_groups, self.base_lrs):
            group["lr"] = base * scale

    def state_dict(self) -> dict[str, Any]:
        return {"base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        base_lrs = [float(x) for x in state["base_lrs"]]
        if len(base_lrs) != len(self.base_lrs):
            raise ValueError(
                f"checkpoint has {len(base_lrs)} parameter groups, this optimizer {len(self.base_lrs)}"
            )
        self.base_lrs = base_lrs
