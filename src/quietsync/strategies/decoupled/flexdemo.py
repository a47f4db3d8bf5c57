"""``flexdemo``: FlexDeMo -- hybrid sharding inside a node, decoupled momentum across nodes (paper 001).

Workers of one node form the **shard group**; workers with the same local index on different nodes
form the **replicate group**. A step (Algorithm 1 of paper 001):

1. accumulate ``accumulation`` micro-batches locally (no communication during backward);
2. **reduce-scatter** the gradients inside the node (one collective on ``shard``, fast link):
   every worker receives the node-averaged gradient of its shard. Each parameter is sharded along
   dim 0 (rows padded to a multiple of the node size), as FSDP2 does, so a shard of a matrix is
   still a matrix and DeMo's 2-D DCT blocks keep their meaning;
3. (with ``max_grad_norm``: the node-averaged gradient is clipped by its norm over the node — squares summed
   over ``shard``, one scalar all-reduce; fp16: an overflow on any node drops the round everywhere)
   the decoupled optimizer runs on the shard only -- momentum, Adam moments and the fp32 master
   copy exist for ``1/workers_per_node`` of the model on each worker -- and its replicator sends the
   compressed shard to the workers holding **the same shard** on the other nodes (one collective
   on ``replicate``, the slow link); the gather therefore grows with the number of nodes, not of
   workers;
4. **all-gather** the updated shards inside the node (one collective on ``shard``) into the
   model's parameters.

Degenerate cases: one node -> the replicate group has one worker, the replicator hands the whole
momentum back and this is sharded training with the base optimizer on the node-averaged gradient
(exactly sharded AdamW with ``base=adamw --no-sign``); one worker per node -> shards are whole
parameters and this is ``demo`` over the replicate group.

Substrate (``params``), both dim-0 sharded and both with every byte metered and link-emulated:

* ``sharded`` (default): PyTorch FSDP2 over the shard group
  (:class:`~quietsync.strategies.substrates.fsdp_shards.FsdpShards`): parameters too are sharded inside the node
  (ZeRO-3, ``reshard_after_forward``); FSDP all-gathers a unit's parameters for its forward and backward and
  reduce-scatters the gradients in the last backward of the round, through the transport. Step 4 is then not needed:
  the optimizer updates the shards FSDP holds.
* ``replicated``: quietsync's flat substrate
  (:class:`~quietsync.strategies.substrates.dim0_shards.FlatDimZeroShards`):
  whole parameters on every worker (ZeRO-2), one reduce-scatter and one all-gather per step, fewer bytes
  inside the node than ``sharded`` moves (which all-gathers in every forward and backward).

Checkpoints that reshard: each node's state (parameter shards, decoupled momentum, optimizer state, counters)
is written under ``replica.<node>.`` as ``Shard(0)`` pieces over the node's workers
(:mod:`~quietsync.strategies.checkpoint.logical_shards`), so a job resumes on another number of workers per
node, either substrate; on another number of nodes each node is a replica
(:mod:`~quietsync.strategies.checkpoint.replicas`): a surviving node keeps its state, a joining node starts
from the saved parameters (the same on every node) with δ = 0 and the nodes' mean optimizer moments, a leaving
node's δ is dropped.

See ``docs/flexdemo.md`` for the memory and speed of both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...validate import check_choice
from ..base import Strategy
from ..checkpoint import replicas
from ..checkpoint.logical import SavedTensors, base_lrs_state, base_lrs_target
from ..checkpoint.logical_shards import load_shards, shard_state, shard_targets
from ..registry import register
from ..substrates.dim0_shards import DimZeroShards, FlatDimZeroShards
from ..substrates.fsdp_shards import FsdpShards
from . import facts
from .round import DecoupledConfig, DecoupledRound, build_decoupled_optimizer

__all__ = ["DimZeroShards", "FlexDeMo", "FlexDeMoConfig"]


@dataclass
class FlexDeMoConfig(DecoupledConfig):
    """Knobs of ``flexdemo``: the decoupled ones plus where parameters live."""

    params: Literal["sharded", "replicated"] = "sharded"
    """sharded = FSDP2 inside the node (parameters, gradients and optimizer state sharded: ZeRO-3); replicated
    = whole parameters on every worker, gradients and optimizer state sharded (ZeRO-2, fewer intra-node
    bytes)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("params", self.params, ("sharded", "replicated"))


@register("flexdemo", FlexDeMoConfig, facts=facts.FLEXDEMO)
class FlexDeMo(Strategy):
    """Hybrid-sharded decoupled momentum; see the module docstring."""

    prepares_gradient = True  # it unscales and clips the gradient it commits (docs/contract.md)

    reshard_refusal = None  # across workers per node and across nodes (each node a replica)

    discards_rounds = True

    config: FlexDeMoConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        substrate = FsdpShards if self.config.params == "sharded" else FlatDimZeroShards
        self.shards = self.hold("shards", substrate(model, self.param_groups, self.transport, "shard"))
        self.param_groups = self.shards.model_groups  # drop the whole pre-sharding parameters
        self.optimizer = build_decoupled_optimizer(
            self.config, self.optimizer_factory, self.shards.groups, self.optimizer_kwargs, self.transport,
            "replicate")
        self.round = self.hold("round", DecoupledRound(self.optimizer, self.config.accumulation,
                                                       self.shards.grad_holders))

    def _backward(self, loss: torch.Tensor) -> None:
        self.shards.before_backward(self.round.accumulator.next_is_last)
        self.round.backward(loss)

    def _step(self) -> bool:
        if not self.round.full:
            return False
        # 1. this worker's shard of the node-averaged gradient (reduce-scatter on ``shard``)
        self.shards.gather_grads(self.accounting)
        # the node-averaged gradient (what enters the momentum), clipped by its norm over the node
        check = self._prepare_commit([t.grad for t in self.shards.local if t.grad is not None],
                                     norm_group="shard")
        if check is None:  # fp16 overflow on some node: the round is dropped on every worker
            self.discard_round()
            return False
        # 2. the decoupled optimizer on the shard; replication across nodes happens inside
        extra = {**self.round.step(self._lr_scale(self.steps), self.accounting), **check}
        # 3. the updated shards into the model (replicated: all-gather on ``shard``; sharded: FSDP's next
        # forward)
        self.shards.publish(self.accounting)
        self._commit(extra=extra)
        return True

    @contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """The whole parameters (with ``params=sharded``: all-gathered inside the node, metered)."""
        with self.shards.unsharded() as model:
            yield model

    def _memory(self) -> dict[str, int]:
        """Bytes of the optimizer state this worker holds (momentum and Adam moments of its shard)."""
        opt_state = sum(
            t.numel() * t.element_size()
            for st in self.optimizer.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        return {"optimizer_state": opt_state}

    # ------------------------------------------------------------------ checkpoints that reshard
    @property
    def replica(self) -> int:
        """This worker's node (each node keeps its own decoupled momentum)."""
        return self.transport.group_rank("replicate")

    @staticmethod
    def join_rule(key: str) -> replicas.JoinRule:
        """A joining node's δ starts empty; its parameters (the same on every node) and base-optimizer state
        are the saved nodes' (their mean where they differ)."""
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
        state = shard_state(self.shards, self.module, self.optimizer, replicas.prefix(self.replica))
        return {**state, **base_lrs_state(self.round.lr.base_lrs)}

    def _logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        self._replica_load = replicas.ReplicaLoad(
            saved, self.replica, lambda keys: shard_targets(self.shards, self.module, self.optimizer, keys),
            self.join_rule)
        return {**self._replica_load.targets, **base_lrs_target(self.round.lr.base_lrs, saved)}

    def _load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        load_shards(self.shards, self.module, self.optimizer, self._replica_load.merged(filled))
        self.round.lr.base_lrs = [float(x) for x in filled["optim.base_lrs"]]
