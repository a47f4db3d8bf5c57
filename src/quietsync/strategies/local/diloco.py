"""``diloco``: DiLoCo (Douillard et al. 2023) — H local inner steps, then an outer step on the averaged
pseudo-gradient; with Streaming DiLoCo's fragments and overlapped outer communication (Douillard et al. 2025).

Every worker runs the inner optimizer (the user's, AdamW by default) on its own data; ``steps`` counts these
inner steps. Per fragment f of the parameters (one fragment by default), every H = ``sync_every`` steps,
staggered by H/F between fragments (when: the :class:`~quietsync.strategies.local.outer.OuterSync` part; what:
:meth:`DiLoCo.pseudo_gradient`, :meth:`DiLoCo.outer_step` and :meth:`DiLoCo.merge` below):

    Δ_i = θ_global − θ_i                                     (pseudo-gradient of worker i)
    Δ̄   = mean_i Δ_i                 over the sync group   (fp32 / bf16 / int8 / fp4 / int4 / int2, or a
                                                              replicator + error feedback)
    θ_global ← OuterSGD(θ_global, Δ̄)  lr 0.7, momentum 0.9, Nesterov by default
    θ_i ← θ_global                                          (τ = 0: every worker continues from θ_global)
    θ_i ← α·θ_i + (1 − α)·θ_global                          (τ > 0: applied τ inner steps after the launch,
                                                              the communication overlapped with them)

The τ > 0 merge is Streaming DiLoCo's mixing of the local parameters, which moved on for τ steps, with the
freshly agreed global ones (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication: towards a
distributed free lunch", arXiv 2501.18512, the overlapping-communication section; α = ``mixing``, 0.5 by
default, an even blend not tuned here; α = 0 discards the τ local steps). With τ = 0 replicas are identical
after every sync; with τ > 0 they agree on θ_global but keep α·(their own drift).

Fragments are contiguous runs of tensors (``fragment_pattern = contiguous``) or whole layers strided over the
depth (``strided``: layer l in fragment l mod F, Streaming DiLoCo's pattern). Low-bit pseudo-gradients
(``fp4``, ``fp4_e3m0``, ``int4``, ``int2``) travel packed with a bf16 scale per ``pseudo_grad_block`` elements
and are averaged in fp32 (Streaming DiLoCo sends 4-bit outer gradients).

**SparseLoCo** (``outer = sparseloco``; Sarfi et al. 2025, arXiv 2508.15706) replaces the outer momentum by a
per-worker error-feedback accumulator: ``e_i ← β·e_i + Δ_i``, ``q_i = Q(TopK(e_i))`` (chunk-wise top-k, values
in ``pseudo_grad_dtype``, 2-bit in the paper), ``e_i ← e_i − decode(q_i)``, ``θ_global ← θ_global − lr·mean_i
decode(q_i)``.

**Hierarchical** (``inner``): ``local`` — each worker trains alone and the sync group is ``world``; ``ddp`` /
``zero1`` — the registered ``ddp``/``zero1`` strategy runs inside each node (group ``shard``, synchronous data
parallelism per node) and only the outer sync crosses nodes, over ``replicate``.

Precision and clipping: ``max_grad_norm`` clips the inner gradient of every inner step by its norm — the local
gradient (``local``), or the node-averaged one (``ddp``/``zero1``, done by the inner strategy); fp16 drops a round
that overflowed on any worker on every worker (the inner strategy agrees over ``world``).

``finish()`` syncs every fragment that has inner steps since its last sync once more (an outer step on that
partial round's pseudo-gradient; a fragment in flight is waited for first) and every worker takes θ_global, so
the committed and exported model holds every inner step; ``finish(sync=False)`` only resets the workers to
θ_global of the last syncs.

``committed_params()`` gives θ_global (the last globally agreed parameters, per fragment); between syncs
``model`` holds the local θ. With outer SGD lr = 1 and momentum 0 (no Nesterov), θ_global ← mean_i θ_i:
DiLoCo is Local SGD with K = H.

Checkpoints that reshard: θ_global, the outer optimizer, the fragment schedule (``steps``, the fragment in
flight) once; each **replica** — a worker with ``inner=local``, a node with ``inner=ddp|zero1`` (its inner
strategy's state, sharded over the node's workers for zero1) — writes its local θ, its inner optimizer state
and its error-feedback residuals under ``replica.<i>.`` (:mod:`~quietsync.strategies.checkpoint.replicas`). On
another number of replicas a survivor continues its own; a joiner starts from θ_global with the saved
replicas' mean inner optimizer state and an empty residual; a leaver's drift since its last sync is dropped.
Saved right after an outer sync with τ = 0 (the trainer's default cadence under ``--elastic`` with one
fragment), every local θ equals θ_global, so only the inner moments are approximated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...events import label
from ...models.units import layer_units
from ...validate import check_choice
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
from ..registry import get, register
from ..substrates.sharded_optimizer import build_optimizer
from . import facts
from .adapt import AdaptConfig, SyncPeriod
from .adapt_bits import bits_candidates
from .adaptive import AdaptivePlan
from .arrival import Arrival
from .outer import OuterSync
from .outer_config import OuterConfig

_INNER = ("local", "ddp", "zero1")


@dataclass
class DiLoCoConfig(OuterConfig, AdaptConfig):
    """Knobs of the ``diloco`` strategy: the outer loop's (:class:`OuterConfig`), the inner training, and
    ``--adapt`` (:class:`~quietsync.strategies.local.adapt.AdaptConfig`)."""

    inner: Literal["local", "ddp", "zero1"] = "local"
    """Inner training: local (each worker alone; the sync spans world), ddp or zero1 (synchronous inside each
    node, the sync spans nodes over replicate)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("inner", self.inner, _INNER)
        if self.inner_steps == "adaptive" and self.inner != "local":
            raise ValueError(f"inner must be local with inner_steps adaptive (a node's workers step together), "
                             f"got {self.inner!r}")
        self.check_adapt_knobs()
        if self.adapt:
            candidates = self.adapt_candidates(self.sync_every, self.fragments, self.overlap_delay)
            dtypes = bits_candidates(self) if "bits" in self.adapted_knobs() else (self.pseudo_grad_dtype,)
            self.token_factors(candidates, dtypes)
        if self.adapt and self.inner_steps == "adaptive":
            raise ValueError("adapt re-picks H for every worker while inner_steps adaptive gives each worker its own "
                             "share of H: use one of them (adapt=False or inner_steps='fixed')")


@register("diloco", DiLoCoConfig, facts=facts.DILOCO)
class DiLoCo(Strategy):
    """DiLoCo / Streaming DiLoCo, optionally hierarchical; see the module docstring."""

    prepares_gradient = True  # it unscales and clips the gradient it commits (docs/contract.md)

    reshard_refusal = None  # θ_global and the outer state once, each replica's inner state (module docstring)

    discards_rounds = True

    local_rounds = True  # inner steps commit without a collective across workers (base.Strategy.local_rounds)

    @property
    def meeting_period(self) -> int:
        return int(self.config.sync_every)

    buffer_sync = "local"  # running statistics are averaged whenever a fragment's outer step is merged

    finish_policy = (
        "every fragment with inner steps since its last sync is synced once more (an outer step on the partial "
        "round's pseudo-gradient, blocking; a fragment in flight is waited for, its delayed merge superseded) and "
        "every worker takes theta_global (sync=False: no final sync, every worker resets to theta_global)"
    )

    config: DiLoCoConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        cfg = self.config
        self.params = [p for g in self.param_groups for p in g["params"]]
        broadcast_parameters(self.transport, self.params, "world")  # every replica, every node, starts equal
        self.inner = None
        if cfg.inner == "local":
            self.sync_group = "world"
            self.optimizer = build_optimizer(self.optimizer_factory, self.param_groups, self.optimizer_kwargs)
            self.round = self.hold("round", OptimizerRound(self.optimizer, cfg.accumulation, self.params))
        else:
            self.sync_group = "replicate"
            cls, _ = get(cfg.inner)
            self.inner = self.hold("inner", cls(
                model, self.optimizer_factory, param_groups=self.param_groups, transport=self.transport,
                config={"accumulation": cfg.accumulation}, lr_schedule=self.lr_schedule, group="shard",
                precision=self.precision, max_grad_norm=self.max_grad_norm, **self.optimizer_kwargs))
            self.optimizer = self.inner.optimizer
        layers = layer_units(model, self.params) if cfg.fragment_pattern == "strided" else None
        self.outer = self.hold("outer", OuterSync(self.params, self.transport, self.sync_group, cfg, self,
                                                  on_params_written=self._params_written, layers=layers))
        self.period = cfg.round_length()
        """Nominal steps between two syncs (a round of adaptive inner steps)."""
        self.adaptive = None if cfg.inner_steps == "fixed" else self.hold("adaptive", AdaptivePlan(
            self.transport, self.sync_group, self.period, cfg.fragments, cfg.worker_speeds))
        """Adaptive inner steps: each worker's inner steps per round and the token weights (None: fixed)."""
        # a sync in flight (overlap_delay > 0) meets on the sync group's twin, from the communication thread
        self.arrival = Arrival(self.transport, self.sync_group if cfg.overlap_delay > 0 else None)
        """Every worker waits for the slower ones before a sync, as long as a round of theirs can take (arrival.py):
        with adaptive inner steps here, before the plan's agreement; else in the outer sync, before its collectives."""
        if self.adaptive is None:
            self.outer.arrival = self.arrival
        self.adapter: SyncPeriod | None = None
        if cfg.adapt:  # H re-picked during the run (adapt.py); the outer sync runs on the adapter's schedule
            if self.transport.fault_tolerant:
                raise ValueError("adapt needs every worker to take each decision together, which --fault-tolerance "
                                 "torchft's replicas (agreeing only inside their group) cannot; use a fixed H")
            self.adapter = self.hold("adapt", SyncPeriod(self.transport, self.sync_group, cfg, model,
                                                         self.param_groups))
            self.outer.schedule = self.adapter.schedule
            self.adapter.bind(self.outer.exchanges, self.outer.quiesce)

    @property
    def window_plan(self) -> tuple[int, list[int]] | None:
        """Adaptive inner steps: ``(round, micro-batches of each worker in it)``, by which the trainer deals the data
        windows; None with fixed inner steps."""
        if self.adaptive is None:
            return None
        return self.steps // self.period, self.adaptive.micro_batches(self.config.accumulation)

    @property
    def model(self) -> torch.nn.Module:
        return self.module if self.inner is None else self.inner.model

    def _params_written(self) -> None:
        """The outer sync overwrote the model parameters: an inner strategy that keeps its own copy (ZeRO-1's
        fp32 master shard) must follow, else its next all-gather would bring the old values back."""
        if self.inner is not None:
            self.inner.parameters_overwritten()

    # ------------------------------------------------------------------ the outer step, per fragment f
    def pseudo_gradient(self, f: int) -> torch.Tensor:
        """Δ = θ_global[f] − θ_local[f]: this worker's pseudo-gradient (fp32, a fresh buffer), taken at launch."""
        o = self.outer
        local = torch.cat([self.params[i].detach().reshape(-1).float() for i in o.fragments[f]])
        delta = o.globals[f].to(o.device) - local
        if self.adaptive is not None:
            # the group's mean of n·w_i·Δ_i is the token-weighted Σ w_i Δ_i (the factor is exactly 1 at equal tokens)
            scale = self.adaptive.scale(f)
            if scale != 1.0:
                delta.mul_(scale)
        return delta

    def outer_step(self, f: int, delta: torch.Tensor) -> None:
        """Δ̄ = mean over the sync group of Δ, as it crosses the wire (the fragment's exchange: fp32, bf16, int8,
        packed low-bit or a replicator, with error feedback where configured); then θ_global[f] ← OuterSGD(θ_global[f],
        Δ̄). On the main thread, or on the communication worker while τ inner steps continue."""
        o = self.outer
        g = o.globals[f]
        g.grad = o.exchanges[f].average(delta).to(o.store)
        with label("quietsync/optimizer_step"):
            o.optimizers[f].step()
        g.grad = None

    def merge(self, f: int, alpha: float) -> None:
        """θ_local[f] ← α·θ_local[f] + (1 − α)·θ_global[f] (α = 0: every worker continues from θ_global)."""
        o = self.outer
        sizes = [self.params[i].numel() for i in o.fragments[f]]
        with torch.no_grad():
            for i, chunk in zip(o.fragments[f], o.globals[f].to(o.device).split(sizes)):
                p = self.params[i]
                chunk = chunk.view_as(p).to(p.dtype)
                if alpha == 0.0:
                    p.data.copy_(chunk)
                else:
                    p.data.mul_(alpha).add_(chunk, alpha=1 - alpha)
        self._params_written()

    # ------------------------------------------------------------------ inner steps
    def _backward(self, loss: torch.Tensor) -> None:
        (self.round if self.inner is None else self.inner).backward(loss)

    def _scales_own_loss(self) -> bool:
        """With an inner ddp/zero1, the inner strategy scales the loss (fp16) and drops overflowing rounds."""
        return self.config.inner == "local"

    def _step(self) -> bool:
        check: dict[str, Any] = {}
        if self.inner is not None:
            self.inner.max_grad_norm = self.max_grad_norm  # it clips the node-averaged inner gradient
            if not self.inner.step():
                return False
            inner = self.inner.last_step_metrics()
            self.accounting.reclassify_as_idle(inner.idle_s)  # its blocking collectives
            check = {k: v for k, v in inner.extra.items()
                     if k in ("grad_norm", "clipped", "loss_scale", "overflow_skips")}
        else:
            if not self.round.full:
                return False
            # the local inner gradient of this worker
            check = self._prepare_commit([p.grad for p in self.params if p.grad is not None])
            if check is None:  # fp16 overflow on some worker: the round is dropped on every worker
                self.discard_round()
                return False
            if self.adaptive is not None:  # a slow worker's inner step spans several nominal steps (adaptive.py)
                self.steps += self.adaptive.stride() - 1
            self.round.step(self._lr_scale(self.steps), self.accounting)
            if self.adaptive is not None:
                self.adaptive.inner_step_done(self.accounting.compute_s)
                check = {**check, **self.adaptive.extra()}
                if (self.steps + 1) % self.period == 0:  # the round's last inner step, on every worker
                    self.arrival.meet(self.accounting.idle)  # before the plan's agreement, the sync's first collective
                    self.adaptive.end_round()
        extra = self.outer.after_inner_step(self.steps + 1, self.accounting.timed, self.accounting.idle)
        if extra["applied"] != -1:
            self.buffers.sync()
        if self.adapter is not None:
            decision = self.adapter.after_inner_step(self.steps + 1, extra["synced"], self.accounting.compute_s)
            if decision is not None:
                extra["adapt"] = decision.record(self.steps + 1)
        self._commit(extra={**extra, **check})
        return True

    def _finish(self, sync: bool) -> None:
        fragments = None
        if sync:  # a last sync may come: a slower worker reaches the end later
            self.arrival.meet(self.accounting.idle)
        if self.adaptive is not None and sync:
            # workers may stand at different nominal steps inside a round: the fragments to sync follow the agreed
            # inner steps, the same on every worker
            self.adaptive.end_partial()
            fragments = [f for f in range(self.config.fragments) if self.adaptive.pending(f) > 0]
        self.outer.finish(self.steps, sync, self.accounting.timed, self.accounting.idle, fragments)
        self.buffers.sync()

    # ------------------------------------------------------------------ contract
    @contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """``model`` holds θ_global (the globally agreed parameters) within the context."""
        with self.outer.global_params():
            yield self.model

    def _position(self) -> dict[str, int]:
        return {"pending_fragment": self.outer.pending_fragment}

    def _open_round(self) -> dict[str, int]:
        """The inner round only: a fragment in flight is part of the logical state."""
        return {k: v for k, v in self.position().items() if k not in ("steps", "pending_fragment")}

    def _state(self) -> dict[str, Any]:
        return (
            {} if self.inner is not None else {"model": self.module.state_dict()}
        )  # an inner strategy saves its own

    def _load_state(self, state: dict[str, Any]) -> None:
        if self.inner is None:
            self.module.load_state_dict(state["model"])

    # ------------------------------------------------------------------ checkpoints that reshard
    @property
    def replica(self) -> int:
        """This worker's replica: its rank with local inner steps, its node with an inner ddp/zero1."""
        return self.transport.group_rank(self.sync_group)

    def join_rule(self, key: str) -> replicas.JoinRule:
        """What a joining replica gets for ``key``: θ_global for its parameters and a ZeRO-1 master
        (``skip``: written from θ_global), the outer slots' own rules, the mean of the rest (inner optimizer
        state)."""
        slots = self.outer.worker_slots()
        if key in slots:
            return slots[key][1]
        return "skip" if key.startswith("model.") or key == "optim.flat.master" else "mean"

    def rejoin(self) -> None:
        """A returning replica (torchft's heal): what its join rule zeroes (error-feedback residuals) starts empty,
        its local parameters from θ_global (no drift)."""
        with torch.no_grad():
            for key, (tensor, _) in self.outer.worker_slots().items():
                if self.join_rule(key) == "zero":
                    tensor.zero_()
        self.outer.start_from_global()

    def _mine(self) -> dict[str, torch.Tensor]:
        if self.inner is None:
            names = parameter_names(self.module)
            state = {**module_state(self.module), **optimizer_state(self.optimizer, names)}
        else:
            state = self.inner._logical_state()  # noqa: SLF001 - the inner strategy is held, not a peer
        return {**state, **{k: t for k, (t, _) in self.outer.worker_slots().items()}}

    def _logical_state(self) -> dict[str, torch.Tensor]:
        out = {**self.outer.shared_state(), **replicas.own(self.replica, self._mine())}
        if self.inner is None:
            out.update(base_lrs_state(self.round.lr.base_lrs))
        if self.adapter is not None:
            out.update(self.adapter.logical_state())
        return out

    def _logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        names = parameter_names(self.module)

        def build(keys: Any) -> dict[str, torch.Tensor]:
            if self.inner is None:
                out = {**module_targets(self.module), **optimizer_targets(self.optimizer, names, keys)}
            else:
                out = self.inner._logical_targets(keys)  # noqa: SLF001
            out.update({k: torch.empty_like(t) for k, (t, _) in self.outer.worker_slots().items()})
            return out

        self._replica_load = replicas.ReplicaLoad(saved, self.replica, build, self.join_rule)
        out = {**self.outer.shared_targets(saved), **self._replica_load.targets}
        if self.inner is None:
            out.update(base_lrs_target(self.round.lr.base_lrs, saved))
        if self.adapter is not None:
            out.update(self.adapter.logical_targets(saved))
        return out

    def _load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        load = self._replica_load
        mine = load.merged(filled)
        self.outer.load_shared(filled, mine)
        if self.adapter is not None:
            self.adapter.load_logical(filled)
        inner_state = {k: v for k, v in mine.items() if not k.startswith("outer.")}
        if self.inner is None:
            if not load.joined:
                load_module(self.module, inner_state)
            load_optimizer(self.optimizer, parameter_names(self.module), inner_state)
            self.round.lr.base_lrs = [float(x) for x in filled["optim.base_lrs"]]
        else:
            if load.joined:  # its parameters come from θ_global below; its buffers are this model's own
                inner_state.update(module_state(self.module))
            self.inner._load_logical(inner_state)  # noqa: SLF001
            self.inner.steps = self.steps
        if load.joined:
            self.outer.start_from_global()
