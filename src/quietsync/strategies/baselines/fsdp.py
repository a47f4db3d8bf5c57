"""``fsdp``: hybrid-sharded AdamW on PyTorch FSDP2 (HSDP), every byte through the transport.

The baseline of paper 001 done right: inside a node, parameters, gradients and optimizer state are sharded
(FSDP2 ``fully_shard`` over the shard group, ``reshard_after_forward``: ZeRO-3); across nodes the workers
holding the same shard average their gradient shards. A step:

1. ``accumulation`` micro-batches; each forward/backward all-gathers a unit's parameters inside the node
   (on ``shard``), the last backward reduce-scatters the gradients inside the node (on ``shard``), earlier
   ones accumulate unsharded gradients locally (``set_requires_gradient_sync(False)``);
2. one all-reduce of this worker's gradient shards over ``replicate`` (the slow link), averaging them
   across nodes — the replicate dimension of HSDP, issued by this strategy on the transport instead of
   by FSDP's internal all-reduce so that it is metered and link-emulated;
3. the optimizer (any torch optimizer, AdamW by default) on this worker's parameter shard — with
   ``max_grad_norm`` (or fp16) after clipping the averaged gradient by its global norm: squares of the shards
   summed over ``shard`` (one scalar all-reduce; the replicas across nodes hold the same shards).

Checkpoints that reshard (another number of nodes or workers per node): every replica holds the same state, so
the logical state is each parameter's and each optimizer state's ``Shard(0)`` pieces over the shard group
(:mod:`~quietsync.strategies.checkpoint.logical_shards`), written once whatever the number of nodes.

Numerically this is ``ddp``/``zero1`` (θ ← Opt(θ, ḡ) with ḡ the global micro-batch mean), which the
tests check. FSDP's collectives run through the transport by torch 2.13's custom all-gather/reduce-scatter
(see :mod:`~quietsync.strategies.substrates.fsdp_shards`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..base import Strategy
from ..checkpoint.logical import SavedTensors, base_lrs_state, base_lrs_target
from ..checkpoint.logical_shards import load_shards, shard_state, shard_targets
from ..parts.accumulation import AccumulationConfig, OptimizerRound
from ..registry import register
from ..substrates.fsdp_shards import FsdpShards
from ..substrates.sharded_optimizer import build_optimizer
from . import facts


def average_across_nodes(strategy: Strategy, grads: list[torch.Tensor | None]) -> None:
    """Average ``grads`` (this worker's gradient shards) over ``replicate`` in place, with one all-reduce."""
    transport = strategy.transport
    present = [g for g in grads if g is not None]
    if transport.group_size("replicate") == 1 or not present:
        return
    with strategy.accounting.idle("all_reduce"):
        flat = torch.cat([g.reshape(-1) for g in present])
        transport.all_reduce(flat, "replicate", op="avg", name="all_reduce/grad_shards")
        at = 0
        with torch.no_grad():
            for g in present:
                g.copy_(flat[at : at + g.numel()].view_as(g))
                at += g.numel()


@register("fsdp", AccumulationConfig, facts=facts.FSDP)
class FSDP(Strategy):
    """FSDP2 inside the node + gradient-shard all-reduce across nodes; see the module docstring."""

    prepares_gradient = True  # it unscales and clips the gradient it commits (docs/contract.md)

    discards_rounds = True

    reshard_refusal = None  # replicas across nodes agree; the shards are Shard(0) pieces (see logical_shards)

    config: AccumulationConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.shards = self.hold("shards", FsdpShards(model, self.param_groups, self.transport, "shard"))
        self.param_groups = self.shards.model_groups  # drop the whole pre-sharding parameters
        self.optimizer = build_optimizer(self.optimizer_factory, self.shards.groups, self.optimizer_kwargs)
        self.round = self.hold(
            "round", OptimizerRound(self.optimizer, self.config.accumulation, self.shards.local)
        )

    def _backward(self, loss: torch.Tensor) -> None:
        self.shards.before_backward(self.round.accumulator.next_is_last)
        self.round.backward(loss)

    def _step(self) -> bool:
        if not self.round.full:
            return False
        self.shards.gather_grads(self.accounting)
        average_across_nodes(self, [t.grad for t in self.shards.local])
        # the averaged gradient's shards: squares summed over the node (replicas hold the same shards)
        extra = self._prepare_commit([t.grad for t in self.shards.local if t.grad is not None],
                                     norm_group="shard", shared=True)
        if extra is None:  # fp16 overflow: the round is dropped on every worker
            self.discard_round()
            return False
        self.round.step(self._lr_scale(self.steps), self.accounting)
        self.shards.publish(self.accounting)
        self._commit(extra or None)
        return True

    @contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """The whole parameters, all-gathered inside the node (metered), for evaluation and export."""
        with self.shards.unsharded() as model:
            yield model

    # ------------------------------------------------------------------ checkpoints that reshard
    def _logical_state(self) -> dict[str, torch.Tensor]:
        return {
            **shard_state(self.shards, self.module, self.optimizer),
            **base_lrs_state(self.round.lr.base_lrs),
        }

    def _logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        return {**shard_targets(self.shards, self.module, self.optimizer, saved),
                **base_lrs_target(self.round.lr.base_lrs, saved)}

    def _load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        load_shards(self.shards, self.module, self.optimizer, filled)
        self.round.lr.base_lrs = [float(x) for x in filled["optim.base_lrs"]]
