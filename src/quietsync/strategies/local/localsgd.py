"""``localsgd``: Local SGD / K-batch synchronous SGD — local optimizer steps, parameters averaged every K
steps.

Every worker holds the whole model and its own copy of the optimizer (any torch optimizer). A step is

1. accumulate ``accumulation`` micro-batches locally: ``g = (1/A)·Σ ∇loss`` (no communication);
2. ``θ_i ← Opt_i(θ_i, g_i)`` — a local optimizer step, committed (``steps`` counts these inner steps); with
   ``max_grad_norm``, ``g_i`` (the local gradient) is clipped by its own norm first;
3. after every ``sync_every`` (K)-th step: ``θ_i ← mean over world of θ_j`` in one all-reduce; with
   ``average_optimizer_state`` also every floating, non-scalar optimizer state tensor (Adam moments, SGD
   momentum buffers) is averaged the same way.

Averaging runs over ``world``: every worker trains alone, so all of them take part (hierarchical training
— synchronous inside a node, periodic across nodes — is ``diloco`` with ``inner=ddp|zero1``).
With K = 1 and plain SGD this is synchronous data parallelism: ``mean_j(θ − lr·g_j) = θ − lr·mean_j g_j``.
The oracle peer is HF Accelerate's ``accelerate.local_sgd.LocalSGD`` (tested equal to 1e-6).

``finish()`` averages once more when local steps were taken since the last sync (``steps mod K ≠ 0``), with the
optimizer state too under ``average_optimizer_state`` — Accelerate's ``LocalSGD`` does the same when its
context exits — so the committed and exported model holds every step; ``finish(sync=False)`` instead resets
every worker to the last averaged θ (those local steps are dropped).

``committed_params()`` gives the **last averaged θ** (the globally agreed parameters); between syncs
``model`` holds this worker's local θ_i. Replicas are identical right after every sync.

Checkpoints that reshard (:mod:`~quietsync.strategies.checkpoint.replicas`): the last averaged θ and the base
lrs once; each worker's θ_i and optimizer state as its own replica. On another number of workers a surviving
worker continues its own θ_i and moments, a joining one starts from the last averaged θ with the mean of the
saved moments, a leaving one's drift since the last sync is dropped. Saved right after a sync (the trainer's
default cadence under ``--elastic``), θ_i equals θ for every worker and only the moments are approximated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ...flat import nbytes
from ...validate import check_int
from ..base import Strategy
from ..checkpoint import replicas
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
from ..registry import register
from ..substrates.sharded_optimizer import build_optimizer
from . import facts
from .adaptive import AdaptiveConfig, AdaptivePlan
from .arrival import Arrival


@dataclass
class LocalSGDConfig(AdaptiveConfig):
    """Knobs of the ``localsgd`` strategy."""

    sync_every: int = 8
    """K: average the parameters over all workers after every K-th local optimizer step (1 = synchronous
    DP)."""
    average_optimizer_state: bool = False
    """Also average the floating optimizer state tensors (Adam moments, momentum buffers) at each sync."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("sync_every", self.sync_every, 1)

    def round_length(self) -> int:
        """Steps between two syncs (a round of adaptive inner steps): K."""
        return self.sync_every


@register("localsgd", LocalSGDConfig, facts=facts.LOCALSGD)
class LocalSGD(Strategy):
    """Local SGD with periodic parameter averaging over ``world``; see the module docstring."""

    prepares_gradient = True  # it unscales and clips the gradient it commits (docs/contract.md)

    reshard_refusal = None  # the synced θ once, each worker's θ_i and moments as a replica (module docstring)

    discards_rounds = True

    local_rounds = True  # inner steps commit without a collective across workers (base.Strategy.local_rounds)

    @property
    def meeting_period(self) -> int:
        return int(self.config.sync_every)

    buffer_sync = "local"  # running statistics are averaged with the parameters, at every sync

    finish_policy = (
        "the local steps since the last sync (steps mod sync_every) are averaged once more, as Accelerate's "
        "LocalSGD does on exit (sync=False: dropped, every worker resets to the last average)"
    )

    config: LocalSGDConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.optimizer = build_optimizer(self.optimizer_factory, self.param_groups, self.optimizer_kwargs)
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.round = self.hold("round", OptimizerRound(self.optimizer, self.config.accumulation, self.params))
        broadcast_parameters(self.transport, self.params, "world")
        self.synced = [p.detach().clone() for p in self.params]
        """θ of the last sync (the committed parameters)."""
        self.adaptive = None if self.config.inner_steps == "fixed" else self.hold("adaptive", AdaptivePlan(
            self.transport, "world", self.config.sync_every, speeds=self.config.worker_speeds))
        """Adaptive inner steps: each worker's inner steps per round and the token weights (None: fixed)."""
        self.arrival = Arrival(self.transport)
        """Every worker waits for the slower ones before a sync, as long as a round of theirs can take (arrival.py)."""

    @property
    def window_plan(self) -> tuple[int, list[int]] | None:
        """Adaptive inner steps: ``(round, micro-batches of each worker in it)``, by which the trainer deals the data
        windows; None with fixed inner steps."""
        if self.adaptive is None:
            return None
        return self.steps // self.config.sync_every, self.adaptive.micro_batches(self.config.accumulation)

    def _step(self) -> bool:
        if not self.round.full:
            return False
        # the local gradient of this worker's inner step
        check = self._prepare_commit([p.grad for p in self.params if p.grad is not None])
        if check is None:  # fp16 overflow on some worker: the round is dropped on every worker
            self.discard_round()
            return False
        plan: dict[str, Any] = {}
        if self.adaptive is not None:  # a slow worker's inner step spans several nominal steps (adaptive.py)
            self.steps += self.adaptive.stride() - 1
        self.round.step(self._lr_scale(self.steps), self.accounting)
        sync = (self.steps + 1) % self.config.sync_every == 0
        if sync:  # before the plan's agreement and the average
            self.arrival.meet(self.accounting.idle)
        if self.adaptive is not None:
            self.adaptive.inner_step_done(self.accounting.compute_s)
            plan = self.adaptive.extra()
            if sync:
                self.adaptive.end_round()
        if sync:
            self.accounting.timed(self._average, "average")
        self._commit(extra={"synced": sync, **plan, **check})
        return True

    def _finish(self, sync: bool) -> None:
        if sync:  # a last average may come: a slower worker reaches the end later
            self.arrival.meet(self.accounting.idle)
        if self.adaptive is not None:
            # workers may stand at different nominal steps inside the round: decide on the agreed inner steps
            # (sync=False: every worker resets, the buffers' average being a collective)
            if sync and self.adaptive.end_partial() == 0:
                return
        elif self.steps % self.config.sync_every == 0:  # the last step synced (or none was taken)
            return
        if sync:
            self._average()
        else:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], self.synced)
            self.buffers.sync()

    def _average(self) -> None:
        """θ_i ← mean_j θ_j (and the optimizer state, if configured), one all-reduce each; keep the result."""
        tensors = list(self.params)
        if self.config.average_optimizer_state:
            tensors += self._optimizer_state_tensors()
        # adaptive inner steps: the mean of n·w_i·θ_i is the token-weighted average (exactly 1.0 at equal tokens)
        scale = 1.0 if self.adaptive is None else self.adaptive.scale()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for dtype, group in by_dtype.items():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                if scale != 1.0:
                    flat.mul_(scale)
                name = "average/params" if group[0] is self.params[0] else f"average/{dtype}"
                self.transport.all_reduce(flat, "world", op="avg", name=name)
                torch._foreach_copy_(
                    [t.data for t in group],
                    [c.view_as(t) for c, t in zip(flat.split([t.numel() for t in group]), group)],
                )
            torch._foreach_copy_(self.synced, [p.detach() for p in self.params])
        self.buffers.sync()

    def _optimizer_state_tensors(self) -> list[torch.Tensor]:
        """Floating, non-scalar state tensors, in parameter order (the same on every worker)."""
        out = []
        for p in self.params:
            for _, v in sorted(self.optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                    out.append(v)
        return out

    @contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """``model`` holds the parameters of the last sync (the globally agreed θ) within the context."""
        local = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], self.synced)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], local)

    def _memory(self) -> dict[str, int]:
        return {"synced_params": sum(nbytes(t) for t in self.synced)}

    def _state(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "synced": [t.clone() for t in self.synced]}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        with torch.no_grad():
            torch._foreach_copy_(self.synced, state["synced"])

    # ------------------------------------------------------------------ checkpoints that reshard
    @staticmethod
    def join_rule(key: str) -> replicas.JoinRule:
        """A joining worker's θ_i is the last averaged θ (``skip``: set from ``synced``); its moments are the
        saved workers' mean."""
        return "skip" if key.startswith("model.") else "mean"

    def rejoin(self) -> None:
        """A returning replica (torchft's heal): its θ_i is the last averaged θ, as its join rule says."""
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], self.synced)

    def _logical_state(self) -> dict[str, torch.Tensor]:
        names = parameter_names(self.module)
        mine = {**module_state(self.module), **optimizer_state(self.optimizer, names)}
        return {**base_lrs_state(self.round.lr.base_lrs),
                **{f"synced.{names[id(p)]}": s for p, s in zip(self.params, self.synced)},
                **replicas.own(self.rank, mine)}

    def _logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        names = parameter_names(self.module)
        self._replica_load = replicas.ReplicaLoad(
            saved, self.rank,
            lambda keys: {**module_targets(self.module), **optimizer_targets(self.optimizer, names, keys)},
            self.join_rule)
        return {**base_lrs_target(self.round.lr.base_lrs, saved),
                **{f"synced.{names[id(p)]}": torch.empty_like(s) for p, s in zip(self.params, self.synced)},
                **self._replica_load.targets}

    def _load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        names = parameter_names(self.module)
        load = self._replica_load
        mine = load.merged(filled)
        with torch.no_grad():
            torch._foreach_copy_(self.synced, [filled[f"synced.{names[id(p)]}"] for p in self.params])
            if load.joined:
                torch._foreach_copy_([p.data for p in self.params], self.synced)
            else:
                load_module(self.module, mine)
        load_optimizer(self.optimizer, names, mine)
        self.round.lr.base_lrs = [float(x) for x in filled["optim.base_lrs"]]
