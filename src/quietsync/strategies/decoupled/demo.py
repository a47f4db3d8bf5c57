"""``demo``: Decoupled Momentum (DeMo) over plain data parallelism (paper 001, after Peng et al. 2024).

Every worker holds the whole model and its own decoupled momentum ``delta``. A step accumulates
``accumulation`` micro-batches locally (no communication at all during backward; with ``max_grad_norm`` this local
gradient ``g`` is clipped by its own norm before it enters the momentum; fp16: an overflow on any worker drops the
round on all, one flag all-reduce), then runs DeMo's update, spelled out in :meth:`DeMo._update`:

1. **momentum**: ``delta <- beta * delta + lr * g`` (DeMo-SGD; ``+ g`` for decoupled AdamW);
2. **extract**: the replicator picks a small part ``q`` of ``delta`` for all parameters at once (``dct``: the
   top-k DCT-II coefficients of every chunk; ``random`` / ``striding``: positions every rank derives from a shared
   seed; ``full``; ``none``) and removes it from ``delta`` (error feedback);
3. **exchange**: ``q`` crosses to every other worker in **one** collective through the transport (all-gather for
   ``dct``, all-reduce for the others) and comes back as ``Q``, each coefficient averaged over the workers that
   sent it, decoded;
4. **apply**: the base optimizer applies ``Q`` (its sign by default): DeMo-SGD (``base="sgd"``, the paper's
   default: ``theta <- theta - lr * sign(Q)``) or decoupled AdamW (``base="adamw"``). Where every parameter group
   applies the sign, step 3 hands ``sign(Q)`` over already (``dct`` takes it tile by tile while it decodes).

The codec behind steps 1-3 (blocks, transforms, top-k, packing) is :mod:`quietsync.wire`'s
(:class:`~quietsync.wire.replicators.DCTReplicator` for ``dct``); for ``dct`` the momentum lives in the DCT domain,
so step 1 transforms the gradient and step 3 inverts the mean, two transforms a step.

Workers' parameters stay identical (they all apply the same averaged update). The knobs of
:class:`~quietsync.strategies.decoupled.round.DecoupledConfig` become the CLI flags ``--replicator
--compression --chunk --topk --sign/--no-sign --transfer-dtype --beta --replicate-every --skip-every``; ``--adapt``
re-picks ``topk`` during the run from the measured link (:mod:`~quietsync.strategies.decoupled.adapt_topk`).

Checkpoints that reshard: the parameters (identical on every worker), the base lrs and the decoupled step and
replicator counters once; each worker's decoupled momentum δ (in its replicator's domain, which does not
depend on the world size: every worker holds whole parameters) and base-optimizer state as its own replica
(:mod:`~quietsync.strategies.checkpoint.replicas`). On another number of workers a survivor keeps its δ and
moments; a joiner starts with δ = 0 (it owes the others nothing, as at the start of a run) and the saved
workers' mean moments (equal to each worker's where they agree: decoupled AdamW's moments of the shared
update); a leaver's δ — the part of its gradients not yet sent — is dropped. With a setting whose workers'
parameters part (``--replicate-every 2``: the facts' ``apart``) the model is saved once all the same, rank 0's,
and on another number of workers every worker starts from it (a resume on the same workers reads each worker's
own).
"""

from __future__ import annotations

from typing import Any

import torch

from ..base import Strategy
from ..checkpoint import replicas
from ..checkpoint.logical import (
    SavedTensors,
    base_lrs_state,
    base_lrs_target,
    load_module,
    module_state,
    module_targets,
    optimizer_state,
    optimizer_targets,
    parameter_names,
)
from ..parts.broadcast import broadcast_parameters
from ..registry import register
from . import facts
from .adapt_topk import DeMoConfig, TopkController
from .round import DecoupledConfig, DecoupledRound, build_decoupled_optimizer

__all__ = ["DeMo", "DeMoConfig", "DecoupledConfig"]


@register("demo", DeMoConfig, facts=facts.DEMO)
class DeMo(Strategy):
    """DeMo over plain data parallelism; see the module docstring."""

    prepares_gradient = True  # it unscales and clips the gradient it commits (docs/contract.md)

    reshard_refusal = None  # the model once, each worker's δ and moments as a replica (module docstring)

    discards_rounds = True

    config: DeMoConfig

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
        self.adapter: TopkController | None = None
        if self.config.adapt:  # k re-picked during the run (adapt_topk.py)
            if self.transport.fault_tolerant:
                raise ValueError("adapt needs every worker to take each decision together, which --fault-tolerance "
                                 "torchft's replicas (agreeing only inside their group) cannot; use a fixed topk")
            self.adapter = self.hold("adapt", TopkController(self.transport, "world", self.config,
                                                             self.optimizer.replicator, model, self.param_groups))

    def _step(self) -> bool:
        if not self.round.full:
            return False
        # the local gradient, before it enters the decoupled momentum (workers' gradients differ)
        check = self._prepare_commit([p.grad for p in self.round.params if p.grad is not None])
        if check is None:  # fp16 overflow on some worker: the round is dropped on every worker
            self.discard_round()
            return False
        extra = self.round.step(self._lr_scale(self.steps), self.accounting, self._update)
        self.optimizer.zero_grad(set_to_none=True)
        if self.adapter is not None:  # after the exchange: a new k takes effect at the next extraction
            decision = self.adapter.after_step(self.steps + 1, extra["replicated"], self.accounting.compute_s)
            if decision is not None:
                extra["adapt"] = decision.record(self.steps + 1)
        self._commit(extra={**extra, **check})
        return True

    @torch.no_grad()
    def _update(self) -> None:
        """DeMo's update on every parameter at once (the module docstring's steps 1-4)."""
        opt = self.optimizer
        step = opt.begin_step()  # t <- t + 1; whether t replicates (--replicate-every / --skip-every)
        if step is None:  # no parameter has a gradient
            return
        if step.replicates:
            opt.momentum(step)  # 1. delta <- beta * delta + lr * g
            q = opt.extract(step)  # 2. q <- the fast components of delta; delta <- delta - q
            update = opt.exchange(step, q)  # 3. Q <- every worker's q, averaged (one collective)
        else:
            update = opt.local_update(step)  # between replications: the local lr * g
        opt.apply(step, update)  # 4. theta <- theta - lr * sign(Q) (or decoupled AdamW on Q)

    def _state(self) -> dict[str, Any]:
        return {"model": self.module.state_dict()}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])

    # ------------------------------------------------------------------ checkpoints that reshard
    @staticmethod
    def join_rule(key: str) -> replicas.JoinRule:
        """A joining worker's δ starts empty; its base-optimizer state is the saved workers' mean."""
        return "zero" if key.endswith(".delta") else "mean"

    def rejoin(self) -> None:
        """A returning replica (torchft's heal): its δ starts empty, as its join rule says (it owes nothing); the
        parameters and the base-optimizer state are the peer's."""
        with torch.no_grad():
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and self.join_rule(f".{key}") == "zero":
                        value.zero_()

    def _logical_state(self) -> dict[str, torch.Tensor]:
        opt = self.optimizer
        out = {**module_state(self.module), **base_lrs_state(self.round.lr.base_lrs),
               "optim.decoupled.step": torch.tensor(opt.decoupled_step, dtype=torch.int64)}
        for key, value in opt.replicator.state_dict().items():
            out[f"optim.replicator.{key}"] = torch.tensor(int(value), dtype=torch.int64)
        if self.adapter is not None:
            out.update(self.adapter.logical_state())
        return {**out, **replicas.own(self.rank, optimizer_state(opt, parameter_names(self.module)))}

    def _logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        names = parameter_names(self.module)
        self._replica_load = replicas.ReplicaLoad(
            saved, self.rank, lambda keys: optimizer_targets(self.optimizer, names, keys), self.join_rule)
        counters = {k: torch.zeros((), dtype=torch.int64) for k in saved
                    if k == "optim.decoupled.step" or k.startswith("optim.replicator.")}
        return {**module_targets(self.module), **base_lrs_target(self.round.lr.base_lrs, saved),
                "optim.decoupled.step": torch.zeros((), dtype=torch.int64), **counters,
                **(self.adapter.logical_targets(saved) if self.adapter is not None else {}),
                **self._replica_load.targets}

    def _load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        load_module(self.module, filled)
        mine = self._replica_load.merged(filled)
        names = parameter_names(self.module)
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, p in enumerate(q for g in self.optimizer.param_groups for q in g["params"]):
            head = f"optim.{names[id(p)]}."
            entry = {k[len(head):]: v for k, v in mine.items() if k.startswith(head) and "." not in k[len(head):]}
            if entry:
                state[i] = entry
        replicator = {k[len("optim.replicator."):]: int(v) for k, v in filled.items()
                      if k.startswith("optim.replicator.")}
        self.optimizer.load_state_dict({  # δ in the domain it was saved in: this run's replicator's
            "state": state, "param_groups": self.optimizer.state_dict()["param_groups"],
            "decoupled": {"step": int(filled["optim.decoupled.step"]), "replicator": replicator,
                          "momentum_domain": self.optimizer.replicator.momentum_domain}})
        self.round.lr.base_lrs = [float(x) for x in filled["optim.base_lrs"]]
        if self.adapter is not None:
            self.adapter.load_logical(filled)
