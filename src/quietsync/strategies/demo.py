"""``demo``: Decoupled Momentum (DeMo) over plain data parallelism (paper 001, after Peng et al. 2024).

Every worker holds the whole model and its own decoupled momentum ``delta``. A step:

1. accumulate ``accumulation`` micro-batches locally (no communication at all during backward);
2. ``delta <- beta * delta + lr * g`` (DeMo-SGD; ``+ g`` for decoupled AdamW);
3. the **replicator** extracts a small part ``q`` of ``delta`` for all parameters at once
   (``dct``: top-k DCT-II coefficients per chunk; ``random`` / ``striding``: positions every rank
   derives from a shared seed; ``full``; ``none``), removes it from ``delta`` (error feedback) and
   exchanges it with every other worker in **one** collective (all-gather for ``dct``, all-reduce
   for the others) through the transport;
4. the averaged, decoded update (its sign by default) is applied by the base optimizer:
   DeMo-SGD (``base="sgd"``, the paper's default) or decoupled AdamW (``base="adamw"``).

Workers' parameters stay identical (they all apply the same averaged update). The knobs of
:class:`DecoupledConfig` become the CLI flags ``--replicator --compression --chunk --topk
--sign/--no-sign --transfer-dtype --beta --replicate-every --skip-every``.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..optim import DecoupledAdamW, DecoupledOptimizer, DeMoSGD
from ..replicators import REPLICATORS, make_replicator
from ..sharded import scale_lrs
from .base import Strategy, StrategyConfig
from .registry import register

_TRANSFER = ("fp32", "bf16", "fp16")
_BASES = ("sgd", "adamw", "auto")


@dataclass
class DecoupledConfig(StrategyConfig):
    """Knobs shared by ``demo`` and ``flexdemo``."""

    accumulation: int = 1
    """Micro-batches per step on each worker (gradient accumulation)."""
    base: Literal["sgd", "adamw", "auto"] = "sgd"
    """Base optimizer: sgd = DeMo-SGD, adamw = decoupled AdamW (Adam moments stay local), auto = follow the optimizer argument (torch SGD -> sgd, anything else -> adamw)."""
    replicator: Literal["dct", "random", "striding", "full", "none"] = "dct"
    """What crosses the network: dct (DeMo top-k DCT, all-gather), random / striding (shared-seed positions, values only, all-reduce), full (all-reduce everything), none."""
    compression: float = 1 / 32
    """Bytes sent per step / bytes of the full fp32 gradient, in (0, 1]; the same meaning for every replicator (full and none ignore it)."""
    chunk: int = 64
    """DCT block edge for the dct replicator (chunk x chunk blocks for matrices, chunk-long for vectors; sizes are padded)."""
    topk: int | None = None
    """Coefficients sent per DCT block (DeMo's own knob, at most chunk**2); default: derived from --compression."""
    sign: bool = True
    """Apply sign() to the replicated update before the base optimizer uses it."""
    transfer_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """dtype the replicated values travel in (the residual keeps what the cast loses)."""
    beta: float = 0.999
    """Decay of the decoupled momentum: delta <- beta * delta + lr * g (DeMo's compression_decay)."""
    replicate_every: int = 1
    """Replicate only every n-th step; other steps apply the local gradient (DeToNATION's periodic replication)."""
    skip_every: int = 0
    """Skip replication every n-th step (0: never skip)."""
    seed: int = 0
    """Seed every rank shares for the random replicator's positions."""

    def __post_init__(self) -> None:
        if not isinstance(self.accumulation, int) or self.accumulation < 1:
            raise ValueError(f"accumulation must be an integer >= 1, got {self.accumulation!r}")
        if self.base not in _BASES:
            raise ValueError(f"base must be one of {', '.join(_BASES)}, got {self.base!r}")
        if self.replicator not in REPLICATORS:
            raise ValueError(f"replicator must be one of {', '.join(REPLICATORS)}, got {self.replicator!r}")
        if not isinstance(self.compression, (int, float)) or not 0 < self.compression <= 1:
            raise ValueError(f"compression must be in (0, 1], got {self.compression!r}")
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1, got {self.chunk!r}")
        if self.topk is not None and (not isinstance(self.topk, int) or not 1 <= self.topk <= self.chunk**2):
            raise ValueError(f"topk must be an integer in [1, chunk**2 = {self.chunk ** 2}], got {self.topk!r}")
        if self.transfer_dtype not in _TRANSFER:
            raise ValueError(f"transfer_dtype must be one of {', '.join(_TRANSFER)}, got {self.transfer_dtype!r}")
        if not isinstance(self.beta, (int, float)) or not 0 <= self.beta <= 1:
            raise ValueError(f"beta must be in [0, 1], got {self.beta!r}")
        if not isinstance(self.replicate_every, int) or self.replicate_every < 1:
            raise ValueError(f"replicate_every must be an integer >= 1, got {self.replicate_every!r}")
        if not isinstance(self.skip_every, int) or self.skip_every < 0 or self.skip_every == 1:
            raise ValueError(f"skip_every must be 0 (never) or an integer >= 2, got {self.skip_every!r}")


def build_decoupled_optimizer(
    config: DecoupledConfig, optimizer: Any, groups: list[dict[str, Any]], kwargs: dict[str, Any],
    transport: Any, group: str,
) -> DecoupledOptimizer:
    """The decoupled optimizer a strategy runs, from its config and the user's optimizer choice.

    ``base="auto"`` maps ``torch.optim.SGD`` (or :class:`DeMoSGD`) to DeMo-SGD and anything else to
    decoupled AdamW. Keyword arguments the chosen base does not take (``betas``/``eps`` for DeMo-SGD,
    ``momentum`` for either) are dropped; others are passed on.
    """
    base = config.base
    if base == "auto":
        sgd_like = optimizer in (torch.optim.SGD, DeMoSGD)
        base = "sgd" if sgd_like else "adamw"
    cls: type[DecoupledOptimizer] = DeMoSGD if base == "sgd" else DecoupledAdamW
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    ignored = {"betas", "eps", "momentum", "nesterov", "dampening", "amsgrad", "foreach", "fused", "maximize"}
    unknown = set(kwargs) - accepted - ignored
    if unknown:
        raise ValueError(f"optimizer arguments {sorted(unknown)} are not understood by {cls.__name__}")
    opt_kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    replicator = make_replicator(
        config.replicator, compression=config.compression, transfer_dtype=config.transfer_dtype,
        chunk=config.chunk, topk=config.topk, seed=config.seed,
    )
    return cls(groups, beta=config.beta, sign=config.sign, replicator=replicator, transport=transport,
               group=group, replicate_every=config.replicate_every, skip_every=config.skip_every, **opt_kwargs)


class DecoupledStrategy(Strategy):
    """Shared plumbing of ``demo`` and ``flexdemo``: accumulation, lr schedule, accounting."""

    config: DecoupledConfig
    _round: int
    """Micro-batches accumulated in the current step (subclasses set it to 0 at construction)."""

    def _backward(self, loss: torch.Tensor) -> None:
        (loss / self.config.accumulation).backward()
        self._round += 1

    def _timed_optimizer_step(self, fn: Any) -> None:
        """Run ``fn`` (the optimizer step); its collectives' seconds count as idle, the rest as compute."""
        before = self.transport.meter.snapshot()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        after = self.transport.meter.snapshot()
        comm = sum(v["seconds"] - before.get(g, {}).get("seconds", 0.0) for g, v in after.items())
        comm = min(max(comm, 0.0), t1 - t0)
        self._idle_s += comm
        if comm > 0:
            self.transport.recorder.add("idle", "replicate", t1 - comm, t1)
        self._add_compute((t1 - t0) - comm)

    def _grads_state(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.clone() for p in self.module.parameters()]

    def _load_grads(self, grads: list[torch.Tensor | None]) -> None:
        with torch.no_grad():
            for p, g in zip(self.module.parameters(), grads):
                p.grad = None if g is None else g.clone()


@register("demo", DecoupledConfig)
class DeMo(DecoupledStrategy):
    """DeMo over plain data parallelism; see the module docstring."""

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.optimizer = build_decoupled_optimizer(
            self.config, self.optimizer_factory, self.param_groups, self.optimizer_kwargs, self.transport, "world")
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self._round = 0
        if self.world_size > 1:  # replicas start identical: rank 0's parameters win
            params = [p for p in model.parameters()]
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            self.transport.broadcast(flat, src=0, group="world", name="init_params")
            with torch.no_grad():
                torch._foreach_copy_(params, [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in params]),
                                                                             params)])
        self._reset_step_accounting()

    def _step(self) -> bool:
        if self._round < self.config.accumulation:
            return False
        scale_lrs(self.optimizer, self.base_lrs, self._lr_scale(self.steps))
        self._timed_optimizer_step(self.optimizer.step)
        self.optimizer.zero_grad(set_to_none=True)
        self._round = 0
        self._commit(extra={"replicated": self.optimizer.last_replicated})
        return True

    def _state(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "base_lrs": list(self.base_lrs), "round": self._round, "grads": self._grads_state()}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.base_lrs = list(state["base_lrs"])
        self._round = int(state["round"])
        self._load_grads(state["grads"])
