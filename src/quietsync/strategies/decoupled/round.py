"""The decoupled-momentum family's shared pieces (beside ``demo`` and ``flexdemo``, which hold them).

* :class:`DecoupledConfig` — the knobs both strategies take (replicator, compression, chunk, top-k, sign,
  transfer dtype, momentum decay, periodic replication, accumulation);
* :func:`build_decoupled_optimizer` — the decoupled optimizer (DeMo-SGD or decoupled AdamW) with its
  replicator, from a config and the user's optimizer choice;
* :class:`DecoupledRound` — the round both run: accumulation into ordinary ``p.grad``, the optimizer step at
  the scheduled lr with replication time counted as idle, and the checkpoint of all of it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...optim import DecoupledAdamW, DecoupledOptimizer, DeMoSGD, check_replication_schedule
from ...transport import Transport
from ...validate import check_choice, check_float, check_int
from ...wire.replicators import REPLICATORS, make_replicator
from ..parts.accounting import StepAccounting
from ..parts.accumulation import AccumulationConfig, OptimizerRound

_TRANSFER = ("fp32", "bf16", "fp16", "fp4", "fp4_e3m0", "int4", "int2")
_BASES = ("sgd", "adamw", "auto")


@dataclass
class DecoupledConfig(AccumulationConfig):
    """Knobs shared by ``demo`` and ``flexdemo``."""

    base: Literal["sgd", "adamw", "auto"] = "sgd"
    """Base optimizer: sgd = DeMo-SGD, adamw = decoupled AdamW (Adam moments stay local), auto = follow the
    optimizer argument (torch SGD -> sgd, anything else -> adamw)."""
    replicator: Literal["dct", "random", "striding", "full", "none"] = "dct"
    """What crosses the network: dct (DeMo top-k DCT, all-gather), random / striding (shared-seed positions,
    values only, all-reduce), full (all-reduce everything), none."""
    compression: float = 1 / 32
    """Bytes sent per step / bytes of the full fp32 gradient, in (0, 1]; the same meaning for every replicator
    (full and none ignore it)."""
    chunk: int = 64
    """DCT block edge for the dct replicator (chunk x chunk blocks for matrices, chunk-long for vectors; sizes
    are padded)."""
    topk: int | None = None
    """Coefficients sent per DCT block (DeMo's own knob, at most chunk**2); default: derived from
    --compression."""
    sign: bool = True
    """Apply sign() to the replicated update before the base optimizer uses it."""
    transfer_dtype: Literal["fp32", "bf16", "fp16", "fp4", "fp4_e3m0", "int4", "int2"] = "fp32"
    """What the replicated values travel in: fp32, bf16, fp16, or packed fp4, fp4_e3m0, int4, int2 codes with a
    bf16 scale per transfer_block values (all-gathered; the residual keeps what the cast or quantization
    loses)."""
    transfer_block: int = 64
    """Values per scale of a low-bit transfer_dtype (the dct replicator uses one scale per block's k values)."""
    beta: float = 0.999
    """Decay of the decoupled momentum: delta <- beta * delta + lr * g (DeMo's compression_decay)."""
    replicate_every: int = 1
    """Replicate only every n-th step; other steps apply the local gradient (DeToNATION's periodic
    replication)."""
    skip_every: int = 0
    """Skip replication every n-th step (0: never skip)."""
    seed: int = 0
    """Seed every rank shares for the random replicator's positions."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("base", self.base, _BASES)
        check_choice("replicator", self.replicator, REPLICATORS)
        check_float("compression", self.compression, 0, 1, low_open=True)
        check_int("chunk", self.chunk, 1)
        check_int("topk", self.topk, 1, self.chunk**2, allow_none=True)
        check_choice("transfer_dtype", self.transfer_dtype, _TRANSFER)
        check_int("transfer_block", self.transfer_block, 1)
        check_float("beta", self.beta, 0, 1)
        check_replication_schedule(self.replicate_every, self.skip_every)


def build_decoupled_optimizer(
    config: DecoupledConfig, optimizer: Any, groups: list[dict[str, Any]], kwargs: dict[str, Any],
    transport: Transport, group: str,
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
        transfer_block=config.transfer_block, chunk=config.chunk, topk=config.topk, seed=config.seed,
    )
    return cls(
        groups,
        beta=config.beta,
        sign=config.sign,
        replicator=replicator,
        transport=transport,
        group=group,
        replicate_every=config.replicate_every,
        skip_every=config.skip_every,
        **opt_kwargs,
    )


class DecoupledRound(OptimizerRound):
    """One round of a decoupled strategy (a part): an :class:`OptimizerRound` whose optimizer is the decoupled
    one, so the step's collective (the replication) is counted as idle time and the step reports whether it
    replicated. Gradients are left to the strategy (demo drops them; flexdemo's live on its shard)."""

    def step(self, lr_scale: float, accounting: StepAccounting,
             update: Callable[[], Any] | None = None) -> dict[str, Any]:
        """The decoupled optimizer's step (replication inside) at the scheduled lr -- ``update`` when given (a
        strategy's own spelling of it), else ``optimizer.step`` --; closes the round; returns the step's
        extras."""
        self.lr.apply(lr_scale)
        accounting.timed(update or self.optimizer.step, "replicate")
        self.accumulator.reset()
        return {"replicated": self.optimizer.last_replicated}

