"""Whole parameters on every worker, kept identical: the substrate of a replicated strategy (a part).

Beside the sharded substrates (ZeRO-1's flat state, dim-0 shards on flat buffers and on FSDP2), :class:`Replicated`
is the plainest place parameters and optimizer state live: every worker holds the whole model and one torch
optimizer over it, and the strategy's rule makes every worker apply the same update, so the replicas stay
identical. It gives a replicated strategy (``ddp``, or signSGD in ``examples/custom_strategy.py``) everything but
its recurrence:

* set-up: rank 0's parameters broadcast (unless something else does it: torch DDP), the user's optimizer built
  over the strategy's parameter groups (``strategy.optimizer``);
* one round of accumulation (:class:`~quietsync.strategies.parts.accumulation.OptimizerRound`, ``accumulation``
  from the strategy's config): the base strategy hands each micro-batch's loss here and ``loss / accumulation``
  accumulates into ``p.grad``;
* :meth:`Replicated.gradient`: once the round is full, its gradient at its true scale — under fp16 divided by
  the loss scale and checked finite with one decision every worker shares (an overflow on any worker drops the
  round on every worker: None);
* :meth:`Replicated.commit`: the gradient the strategy left in ``p.grad`` clipped to ``max_grad_norm`` by its
  norm (the same on every worker: no collective), the optimizer step at the scheduled lr, the step recorded;
* the checkpoint (the model, the optimizer, the open round) and the logical form that reshards: the model, the
  optimizer state and the base lrs, once — the replicas are identical after every step.

So a strategy holding it clips and scales like every other (``prepares_gradient``) and reshards without code of
its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

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
from ..parts.accumulation import OptimizerRound
from ..parts.broadcast import broadcast_parameters
from ..parts.clipping import prepare_gradient
from ..parts.part import Part
from .sharded_optimizer import build_optimizer

if TYPE_CHECKING:
    from ..base import Strategy


class Replicated(Part):
    """The replicated substrate of ``strategy`` (see the module docstring).

    Args:
        strategy: the strategy holding it (its model, parameter groups, optimizer, transport, config with an
            ``accumulation`` field, lr schedule and step record).
        group: the group whose workers hold identical replicas (``world``; ``shard`` for ddp inside diloco).
        broadcast: broadcast rank 0's parameters over ``group`` (False where torch DDP already does).
    """

    prepares_gradient: ClassVar[bool] = True

    def __init__(self, strategy: Strategy, group: str = "world", *, broadcast: bool = True) -> None:
        self.strategy = strategy
        self.group = group
        self.module = strategy.module
        params = [p for g in strategy.param_groups for p in g["params"]]
        if broadcast:
            broadcast_parameters(strategy.transport, params, group)
        strategy.optimizer = build_optimizer(strategy.optimizer_factory, strategy.param_groups,
                                             strategy.optimizer_kwargs)
        self.round = OptimizerRound(strategy.optimizer, strategy.config.accumulation, params)
        self._extra: dict[str, Any] = {}

    # ------------------------------------------------------------------ the round
    def backward(self, loss: torch.Tensor) -> bool:
        """One micro-batch: its share ``loss / accumulation`` of the round's mean gradient, into ``p.grad``."""
        self.round.backward(loss)
        return True

    @property
    def round_full(self) -> bool:
        return self.round.full

    def gradient(self, shared: bool = False) -> list[torch.Tensor] | None:
        """The round's gradient (``p.grad`` of each parameter, in group order) once the round is full, at its true
        scale; None before that, and when fp16 found an overflow on some worker (the round is then dropped on every
        worker). ``shared``: the gradient is already equal on every worker of ``world`` (ddp's averaged one), so the
        fp16 decision needs no flag all-reduce."""
        if not self.round.full:
            return None
        for p in self.round.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.round.params]
        s = self.strategy
        if s.scaler is not None:
            scale = s.scaler.scale
            with s.accounting.idle("found_inf"):
                check = prepare_gradient(grads, max_norm=None, scale=scale, transport=s.transport,
                                         agree_group=None if shared else "world")
            s.scaler.update(check.finite)
            if not check.finite:
                if s.round_closes is None:  # discard_round() refuses such a strategy: drop this round here
                    self.discard()
                else:
                    s.discard_round()
                return None
            self._extra = {"loss_scale": scale, "overflow_skips": s.scaler.take_skipped()}
        return grads

    def commit(self, extra: dict[str, Any] | None = None) -> bool:
        """Commit the gradient the strategy left in ``p.grad``: clipped to ``max_grad_norm`` by its norm (its
        pre-clip norm in the step's ``extra["grad_norm"]``), the optimizer step at the scheduled lr, the step
        recorded with ``extra``. Returns True (what ``_step`` returns)."""
        s = self.strategy
        out, self._extra = self._extra, {}
        # scale=None below: gradient() already unscaled p.grad
        if s.max_grad_norm is not None:
            check = prepare_gradient([p.grad for p in self.round.params], max_norm=s.max_grad_norm, scale=None,
                                     transport=s.transport)
            out.update(grad_norm=check.norm, clipped=check.clipped)
        self.round.step(s._lr_scale(s.steps), s.accounting)  # noqa: SLF001 - the step the strategy commits
        s._commit({**out, **(extra or {})} or None)  # noqa: SLF001
        return True

    def discard(self) -> None:
        self.round.discard()
        self._extra = {}

    # ------------------------------------------------------------------ checkpoints
    def position(self) -> dict[str, int]:
        return self.round.position()

    def memory_report(self) -> dict[str, int]:
        return self.round.memory_report()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "round": self.round.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.round.load_state_dict(state["round"])

    def logical_state(self) -> dict[str, torch.Tensor]:
        names = parameter_names(self.module)
        return {**module_state(self.module), **optimizer_state(self.round.optimizer, names),
                **base_lrs_state(self.round.lr.base_lrs)}

    def logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        names = parameter_names(self.module)
        return {**module_targets(self.module), **optimizer_targets(self.round.optimizer, names, saved),
                **base_lrs_target(self.round.lr.base_lrs, saved)}

    def load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        load_module(self.module, filled)
        load_optimizer(self.round.optimizer, parameter_names(self.module), filled)
        self.round.lr.base_lrs = [float(x) for x in filled["optim.base_lrs"]]
