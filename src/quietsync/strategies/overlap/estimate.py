"""An optimizer step taken without committing it: ACCO's estimate θ̃⁽ᵗ⁺¹⁾ and WP's prediction.

Both papers' overlapped rules need Opt(θ, g) *as the real optimizer would take it*, from its current moments
and step counter, but without changing them. :class:`EstimatingOptimizer` keeps a scratch copy of the master
shard and of the optimizer state, refreshes it from the real ones before each estimate, and steps the copy.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ...events import label
from ...flat import nbytes
from ..parts.lr import LRScaler
from ..substrates.sharded_optimizer import ShardedOptimizer, build_optimizer


class EstimatingOptimizer:
    """Runs the sharded optimizer on a scratch copy of the master shard and of the optimizer state.

    ``estimate(lr_scale)`` returns Opt(θ_shard, grad_shard) — the step the real optimizer *would* take from
    its current state — without touching the real master, moments or step counter (also before the first
    committed step, when the real state is still empty). Works for any torch optimizer whose state is a
    dict of tensors and Python values per parameter.
    """

    def __init__(self, shard: ShardedOptimizer, lr: LRScaler, factory: Any, kwargs: dict[str, Any]) -> None:
        self.shard = shard
        self.lr = lr
        self.master = shard.master.clone()
        self.views: list[torch.Tensor] = []
        groups = []
        for (a, b), real in zip(shard.slices, shard.optimizer.param_groups):
            view = self.master[a:b]
            view.grad = shard.grad[a:b]  # the estimate uses the gradient the real step would use
            self.views.append(view)
            groups.append({**{k: v for k, v in real.items() if k != "params"}, "params": [view]})
        self.optimizer = build_optimizer(factory, groups, kwargs)

    def estimate(self, lr_scale: float) -> torch.Tensor:
        real = self.shard.optimizer
        self.master.copy_(self.shard.master)
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
        self.lr.apply(lr_scale, self.optimizer)
        with label("quietsync/optimizer_step"):
            self.optimizer.step()
        return self.master

    def nbytes(self) -> int:
        state = sum(nbytes(v) for st in self.optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor))
        return nbytes(self.master) + state
