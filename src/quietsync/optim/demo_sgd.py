"""DeMo-SGD: SGD on the replicated decoupled momentum (paper 001; DeMo, Peng et al. 2024).

``delta <- beta * delta + lr * g``; the replicator sends part of ``delta`` and returns the average
``Q``; then ``theta <- theta * (1 - lr * wd) - lr * sign(Q)`` (``sign=True``, DeMo's default) or
``theta <- theta * (1 - lr * wd) - Q`` (``sign=False``: ``Q`` already carries the lr). With the
``full`` replicator, ``beta=0`` and no sign this is exactly SGD on the all-reduced gradient.

Usable in a plain loop::

    opt = DeMoSGD(model.parameters(), lr=1e-3, replicator="dct", transport=transport,
                  replicator_kwargs={"compression": 1/32, "chunk": 64})
    loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..transport import Collectives
from ..wire.replicators import Replicator
from .decoupled import DecoupledOptimizer

__all__ = ["DeMoSGD"]


class DeMoSGD(DecoupledOptimizer):
    """DeMo-SGD (see the module docstring).

    Args:
        params: parameters or groups; groups may override ``lr``, ``beta``, ``sign``, ``weight_decay``.
        lr: learning rate.
        beta: decay of the decoupled momentum (DeMo's ``compression_decay``).
        sign: apply ``sign`` to the replicated update.
        weight_decay: decoupled weight decay.
        replicator, transport, group, replicate_every, skip_every, replicator_kwargs:
            see :class:`~quietsync.optim.decoupled.DecoupledOptimizer`.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        beta: float = 0.999,
        sign: bool = True,
        weight_decay: float = 0.0,
        replicator: Replicator | str = "dct",
        transport: Collectives | None = None,
        group: str = "world",
        replicate_every: int = 1,
        skip_every: int = 0,
        replicator_kwargs: dict[str, Any] | None = None,
    ) -> None:
        defaults = {"lr": lr, "beta": beta, "sign": sign, "weight_decay": weight_decay}
        super().__init__(params, defaults, replicator, transport, group, replicate_every, skip_every,
                         replicator_kwargs)

    def _delta_scale(self, group: dict[str, Any]) -> float:
        return float(group["lr"])

    def _apply(self, group: dict[str, Any], params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        if wd:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        ups = [u.to(p.dtype) for p, u in zip(params, updates)]
        torch._foreach_add_(params, ups, alpha=-lr if group["sign"] else -1.0)

    def _apply_sparse(self, group: dict[str, Any], params: list[torch.Tensor],
                      updates: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Only the sent positions move (a zero update leaves a parameter bit for bit as it is); fp32/fp64
        contiguous parameters, where ``p + alpha * u`` rounds once either way (``alpha * u`` is exact: ``u`` is a
        sign, or ``alpha`` is -1)."""
        if not all(p.is_contiguous() and p.dtype in (torch.float32, torch.float64) for p in params):
            return False
        lr, wd = group["lr"], group["weight_decay"]
        if wd:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        alpha = -lr if group["sign"] else -1.0
        for p, (at, values) in zip(params, updates):
            if at.numel():
                p.view(-1).index_add_(0, at, values.to(p.dtype), alpha=alpha)
        return True
