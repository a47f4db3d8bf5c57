"""Decoupled AdamW: Adam moments stay local; the replicated momentum is fed as the gradient.

Paper 001's variant: sharing Adam's two moments would cost 2-3x the bandwidth, so only the
replicator's payload crosses the network; each worker keeps its own ``exp_avg`` / ``exp_avg_sq``
and feeds them the averaged update ``Q`` (or ``sign(Q)``). Here the decoupled momentum is
``delta <- beta * delta + g`` (no lr inside: Adam is scale-free, and a warm-up lr of 0 must not
erase gradients), so with the ``full`` replicator, ``beta=0`` and no sign this is exactly
``torch.optim.AdamW`` on the all-reduced gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ..transport import Collectives
from ..validate import check_float
from ..wire.replicators import Replicator
from .decoupled import DecoupledOptimizer

__all__ = ["DecoupledAdamW"]


class DecoupledAdamW(DecoupledOptimizer):
    """AdamW over the replicated decoupled momentum (see the module docstring).

    Args:
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        beta: decay of the decoupled momentum.
        sign: feed ``sign(Q)`` instead of ``Q`` to Adam.
        (others as :class:`~quietsync.optim.demo_sgd.DeMoSGD`)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        beta: float = 0.999,
        sign: bool = False,
        replicator: Replicator | str = "dct",
        transport: Collectives | None = None,
        group: str = "world",
        replicate_every: int = 1,
        skip_every: int = 0,
        replicator_kwargs: dict[str, Any] | None = None,
    ) -> None:
        for i, b in enumerate(betas):
            check_float(f"betas[{i}]", b, 0, 1, high_open=True)
        check_float("eps", eps, 0)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "beta": beta,
                    "sign": sign}
        super().__init__(params, defaults, replicator, transport, group, replicate_every, skip_every,
                         replicator_kwargs)

    def _delta_scale(self, group: dict[str, Any]) -> float:
        return 1.0

    def _apply(self, group: dict[str, Any], params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        by_step: dict[float, list[int]] = {}
        for i, p in enumerate(params):
            st = self.state[p]
            if "exp_avg" not in st:
                st["step"] = torch.tensor(0.0)  # a tensor: logical checkpoints hold tensors only
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["step"] += 1
            by_step.setdefault(float(st["step"]), []).append(i)
        # decay before the moments, as torch.optim.AdamW does: the full-replicator oracle is AdamW
        if wd:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        for step, idx in by_step.items():  # params skipped on some steps may have other counts
            ps = [params[i] for i in idx]
            gs = [updates[i].to(params[i].dtype) for i in idx]
            m = [self.state[p]["exp_avg"] for p in ps]
            v = [self.state[p]["exp_avg_sq"] for p in ps]
            torch._foreach_lerp_(m, gs, 1.0 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, gs, gs, 1.0 - b2)
            bc1, bc2 = 1.0 - b1**step, 1.0 - b2**step
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, math.sqrt(bc2))
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(ps, m, denom, value=-lr / bc1)
