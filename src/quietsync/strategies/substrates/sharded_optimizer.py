"""A torch optimizer on this worker's fp32 master shard of a :class:`~quietsync.flat.FlatParams`.

ZeRO-1 style: each of ``count`` workers keeps optimizer state only for its ``1/count`` of the flat
parameter buffer. :class:`ShardedOptimizer` holds

* ``master`` — the fp32 master copy of the shard (the parameters the optimizer updates),
* ``grad`` — the reduced gradient of the shard (what a reduce-scatter writes),
* ``optimizer`` — any ``torch.optim.Optimizer`` built over per-group views of ``master``, so each original
  parameter group keeps its options (a group that misses this shard gets an empty view, which keeps the
  group count — and the state-dict layout — the same on every worker).

Learning rates are set by the caller before :meth:`ShardedOptimizer.step` (strategies hold an
:class:`~quietsync.strategies.parts.lr.LRScaler` for that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...events import label
from ...flat import FlatParams


class ShardedOptimizer:
    """The optimizer over shard ``index`` of ``count``.

    Args:
        flat: the flat parameter buffer.
        optimizer: a ``torch.optim.Optimizer`` subclass (or factory taking param groups and kwargs).
        optimizer_kwargs: its keyword arguments (lr, weight_decay, ...).
        index, count: which shard.
    """

    def __init__(self, flat: FlatParams, optimizer: Callable[..., torch.optim.Optimizer],
                 optimizer_kwargs: dict[str, Any], index: int, count: int) -> None:
        self.flat = flat
        self.lo, self.hi = flat.shard_bounds(index, count)
        dtype = flat.policy.master_dtype
        # copy=True: with fp32 parameters .to would return a view of flat.data, not a master of its own
        self.master = flat.data[self.lo : self.hi].detach().to(dtype=dtype, copy=True)
        self.grad = torch.zeros_like(self.master)
        self.slices = flat.group_slices(self.lo, self.hi)
        groups = []
        for (a, b), layout in zip(self.slices, flat.groups):
            view = self.master[a:b]
            view.grad = self.grad[a:b]  # the optimizer reads what the reduce-scatter writes, no copy
            groups.append({**layout.options, "params": [view]})
        self.optimizer = build_optimizer(optimizer, groups, optimizer_kwargs)

    def step(self) -> None:
        """One optimizer step of the master shard with the gradient in :attr:`grad` (lrs as set by the
        caller)."""
        with label("quietsync/optimizer_step"):
            self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {"master": self.master.clone(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["master"].shape != self.master.shape:
            raise ValueError(
                f"checkpoint shard has {state['master'].numel()} elements, this worker's has "
                f"{self.master.numel()} (was it saved with another world size?)"
            )
        self.master.copy_(state["master"])
        self.optimizer.load_state_dict(state["optimizer"])
        # load_state_dict may replace the param-group dicts; the param tensors (views of master) stay.


def build_optimizer(optimizer: Callable[..., torch.optim.Optimizer], groups: list[dict[str, Any]],
                    kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """``optimizer(groups, **kwargs)`` with a clear error for bad arguments."""
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer class or factory, got {optimizer!r}")
    try:
        opt = optimizer(groups, **kwargs)
    except TypeError as exc:
        name = getattr(optimizer, "__name__", repr(optimizer))
        raise ValueError(f"could not build optimizer {name} with {sorted(kwargs)}: {exc}") from exc
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"optimizer must build a torch.optim.Optimizer, got {type(opt).__name__}")
    return opt
