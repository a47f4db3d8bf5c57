"""``demo``: Decoupled Momentum (DeMo) over plain data parallelism (paper 001, after Peng et al. 2024).

Every worker holds the whole model and its own decoupled momentum ``delta``. A step:

1. accumulate ``accumulation`` micro-batches locally (no communication at all during backward); with
   ``max_grad_norm`` this local gradient is clipped by its own norm before it enters the momentum (fp16: an
   overflow on any worker drops the round on all, one flag all-reduce);
2. ``delta <- beta * delta + lr * g`` (DeMo-SGD; ``+ g`` for decoupled AdamW);
3. the **replicator** extracts a small part ``q`` of ``delta`` for all parameters at once
   (``dct``: top-k DCT-II coefficients per chunk; ``random`` / ``striding``: positions every rank
   derives from a shared seed; ``full``; ``none``), removes it from ``delta`` (error feedback) and
   exchanges it with every other worker in **one** collective (all-gather for ``dct``, all-reduce
   for the others) through the transport;
4. the averaged, decoded update (its sign by default) is applied by the base optimizer:
   DeMo-SGD (``base="sgd"``, the paper's default) or decoupled AdamW (``base="adamw"``).

Workers' parameters stay identical (they all apply the same averaged update). The knobs of
:class:`~quietsync.strategies.decoupled.round.DecoupledConfig` become the CLI flags ``--replicator
--compression --chunk --topk --sign/--no-sign --transfer-dtype --beta --replicate-every --skip-every``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..base import Strategy
from ..parts.broadcast import broadcast_parameters
from ..registry import register
from .round import DecoupledConfig, DecoupledRound, build_decoupled_optimizer


@register("demo", DecoupledConfig)
class DeMo(Strategy):
    """DeMo over plain data parallelism; see the module docstring."""

    reshard_refusal = (
        "each worker's decoupled momentum δ is its own (only a compressed part of it ever crosses the "
        "network) and its AdamW moments stay local, so there is no one state to split over another number of "
        "workers"
    )

    discards_rounds = True

    config: DecoupledConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.optimizer = build_decoupled_optimizer(
            self.config,
            self.optimizer_factory,
            self.param_groups,
            self.optimizer_kwargs,
            self.transport,
            "world",
        )
        self.round = self.hold(
            "round", DecoupledRound(self.optimizer, self.config.accumulation, list(model.parameters()))
        )
        broadcast_parameters(self.transport, list(model.parameters()), "world")

    def _backward(self, loss: torch.Tensor) -> None:
        self.round.backward(loss)

    def _step(self) -> bool:
        if not self.round.full:
            return False
        # the local gradient, before it enters the decoupled momentum (workers' gradients differ)
        check = self._prepare_commit([p.grad for p in self.round.params if p.grad is not None])
        if check is None:  # fp16 overflow on some worker: the round is dropped on every worker
            self.discard_round()
            return False
        extra = self.round.step(self._lr_scale(self.steps), self.accounting)
        self.optimizer.zero_grad(set_to_none=True)
        self._commit(extra={**extra, **check})
        return True


    def _state(self) -> dict[str, Any]:
        return {"model": self.module.state_dict()}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
