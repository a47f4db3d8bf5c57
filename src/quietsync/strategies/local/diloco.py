"""``diloco``: DiLoCo (Douillard et al. 2023) — H local inner steps, then an outer step on the averaged
pseudo-gradient; with Streaming DiLoCo's fragments and overlapped outer communication (Douillard et al. 2025).

Every worker runs the inner optimizer (the user's, AdamW by default) on its own data; ``steps`` counts these
inner steps. Per fragment f of the parameters (one fragment by default), every H = ``sync_every`` steps,
staggered by H/F between fragments (the :class:`~quietsync.strategies.local.outer.OuterSync` part):

    Δ_i = θ_global − θ_i                                     (pseudo-gradient of worker i)
    Δ̄   = mean_i Δ_i                 over the sync group   (fp32 / bf16 / int8, or a replicator + error feedback)
    θ_global ← OuterSGD(θ_global, Δ̄)  lr 0.7, momentum 0.9, Nesterov by default
    θ_i ← θ_global                                          (τ = 0: every worker continues from θ_global)
    θ_i ← α·θ_i + (1 − α)·θ_global                          (τ > 0: applied τ inner steps after the launch,
                                                              the communication overlapped with them)

The τ > 0 merge is Streaming DiLoCo's mixing of the local parameters, which moved on for τ steps, with the
freshly agreed global ones (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication: towards a
distributed free lunch", arXiv 2501.18512, the overlapping-communication section; α = ``mixing``, 0.5 by default,
an even blend not tuned here; α = 0 discards the τ local steps). With τ = 0 replicas are identical after every sync; with τ > 0 they agree on θ_global but
keep α·(their own drift).

**Hierarchical** (``inner``): ``local`` — each worker trains alone and the sync group is ``world``; ``ddp`` /
``zero1`` — the registered ``ddp``/``zero1`` strategy runs inside each node (group ``shard``, synchronous data
parallelism per node) and only the outer sync crosses nodes, over ``replicate``.

``committed_params()`` gives θ_global (the last globally agreed parameters, per fragment); between syncs
``model`` holds the local θ. With outer SGD lr = 1 and momentum 0 (no Nesterov), θ_global ← mean_i θ_i:
DiLoCo is Local SGD with K = H.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...validate import check_choice, check_float, check_int
from ..base import Strategy
from ..parts.accumulation import AccumulationConfig, OptimizerRound
from ..parts.broadcast import broadcast_parameters
from ..registry import get, register
from ..substrates.sharded_optimizer import build_optimizer
from .outer import PSEUDO_GRAD_DTYPES, PSEUDO_GRAD_REPLICATORS, OuterSync

_INNER = ("local", "ddp", "zero1")


@dataclass
class DiLoCoConfig(AccumulationConfig):
    """Knobs of the ``diloco`` strategy."""

    sync_every: int = 64
    """H: inner optimizer steps between two syncs of each fragment."""
    inner: Literal["local", "ddp", "zero1"] = "local"
    """Inner training: local (each worker alone; the sync spans world), ddp or zero1 (synchronous inside each node, the sync spans nodes over replicate)."""
    outer_lr: float = 0.7
    """Learning rate of the outer SGD on the averaged pseudo-gradient."""
    outer_momentum: float = 0.9
    """Momentum of the outer SGD (0: none)."""
    outer_nesterov: bool = True
    """Nesterov momentum for the outer SGD (takes effect only with outer_momentum > 0)."""
    fragments: int = 1
    """Streaming DiLoCo: split the parameters into this many fragments synced at staggered steps (must divide sync_every)."""
    overlap_delay: int = 0
    """tau: inner steps a fragment's outer communication overlaps before it is merged (0: blocking; at most sync_every/fragments)."""
    mixing: float = 0.5
    """alpha of the delayed merge theta_local <- alpha*theta_local + (1-alpha)*theta_global (only with overlap_delay > 0)."""
    pseudo_grad_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    """dtype pseudo-gradients travel in: fp32, bf16 (all-reduce) or int8 with a per-fragment scale (all-gather)."""
    pseudo_grad_replicator: Literal["none", "dct", "random", "striding", "full"] = "none"
    """Compress pseudo-gradients with a quietsync replicator (error feedback in its residual); none: dense exchange."""
    compression: float = 1 / 32
    """Replicator bandwidth: bytes sent / bytes of the fp32 pseudo-gradient, in (0, 1] (with pseudo_grad_replicator)."""
    seed: int = 0
    """Shared seed of the random replicator's positions."""
    offload_outer: bool = False
    """Keep theta_global and the outer optimizer state on CPU (saves 2 model copies of accelerator memory)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("sync_every", self.sync_every, 1)
        check_choice("inner", self.inner, _INNER)
        check_float("outer_lr", self.outer_lr, 0, low_open=True)
        check_float("outer_momentum", self.outer_momentum, 0, 1, high_open=True)
        check_int("fragments", self.fragments, 1, self.sync_every)
        if self.sync_every % self.fragments:
            raise ValueError(f"fragments must be a divisor of sync_every ({self.sync_every}), got {self.fragments}")
        check_int("overlap_delay", self.overlap_delay, 0, self.sync_every // self.fragments)
        check_float("mixing", self.mixing, 0, 1)
        check_choice("pseudo_grad_dtype", self.pseudo_grad_dtype, PSEUDO_GRAD_DTYPES)
        check_choice("pseudo_grad_replicator", self.pseudo_grad_replicator, PSEUDO_GRAD_REPLICATORS)
        check_float("compression", self.compression, 0, 1, low_open=True)
        check_int("seed", self.seed, 0)
        if self.pseudo_grad_replicator != "none" and self.pseudo_grad_dtype == "int8":
            raise ValueError("pseudo_grad_replicator must be none with pseudo_grad_dtype int8 "
                             "(replicators send fp32 or bf16 values)")


@register("diloco", DiLoCoConfig)
class DiLoCo(Strategy):
    """DiLoCo / Streaming DiLoCo, optionally hierarchical; see the module docstring."""

    reshard_refusal = (
        "each worker's inner optimizer state is its own and its inner model drifts between outer syncs, so "
        "there is no one state to split over another number of workers"
    )

    discards_rounds = True

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
                **self.optimizer_kwargs))
            self.optimizer = self.inner.optimizer
        self.outer = self.hold("outer", OuterSync(
            self.params, self.transport, self.sync_group, sync_every=cfg.sync_every, fragments=cfg.fragments,
            overlap_delay=cfg.overlap_delay, mixing=cfg.mixing, outer_lr=cfg.outer_lr,
            outer_momentum=cfg.outer_momentum, outer_nesterov=cfg.outer_nesterov,
            pseudo_grad_dtype=cfg.pseudo_grad_dtype, replicator=cfg.pseudo_grad_replicator,
            compression=cfg.compression, seed=cfg.seed, offload=cfg.offload_outer,
            on_params_written=self._params_written))

    @property
    def model(self) -> torch.nn.Module:
        return self.module if self.inner is None else self.inner.model

    def _params_written(self) -> None:
        """The outer sync overwrote the model parameters: a ZeRO-1 inner keeps an fp32 master of its shard,
        which must follow (else its next all-gather would bring the old values back)."""
        sharded = getattr(self.inner, "sharded", None)
        if sharded is not None:
            shard = sharded.shard
            with torch.no_grad():
                shard.master.copy_(sharded.flat.data[shard.lo:shard.hi])

    # ------------------------------------------------------------------ inner steps
    def _backward(self, loss: torch.Tensor) -> None:
        (self.round if self.inner is None else self.inner).backward(loss)

    def _step(self) -> bool:
        if self.inner is not None:
            if not self.inner.step():
                return False
            inner_idle = self.inner.last_step_metrics().idle_s
            self.accounting.idle_s += inner_idle  # the inner strategy's blocking collectives
            self.accounting.compute_s -= inner_idle
        else:
            if not self.round.full:
                return False
            self.round.step(self._lr_scale(self.steps), self.accounting)
        extra = self.outer.after_inner_step(self.steps + 1, self.accounting.timed, self.accounting.idle)
        self._commit(extra=extra)
        return True

    # ------------------------------------------------------------------ contract
    @contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """``model`` holds θ_global (the globally agreed parameters) within the context."""
        with self.outer.global_params():
            yield self.model

    def _position(self) -> dict[str, int]:
        return {"pending_fragment": self.outer.pending_fragment}

    def _state(self) -> dict[str, Any]:
        return {} if self.inner is not None else {"model": self.module.state_dict()}  # an inner strategy saves its own

    def _load_state(self, state: dict[str, Any]) -> None:
        if self.inner is None:
            self.module.load_state_dict(state["model"])
