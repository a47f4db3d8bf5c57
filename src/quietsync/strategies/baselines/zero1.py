"""``zero1``: ZeRO-1 on flat buffers (its state, a
:class:`~quietsync.strategies.substrates.sharded_state.ShardedState`, is the substrate ACCO, DPU and WP
build on).

Each worker keeps optimizer state for only its ``1/n`` of the parameters. A step is:

1. accumulate ``accumulation`` micro-batches into the flat gradient buffer (local, no communication);
2. **reduce-scatter** the buffer: each worker receives the summed gradient of its shard, divided by the
   global micro-batch count;
3. the optimizer (any torch optimizer, original parameter groups kept) steps the fp32 master shard;
4. **all-gather** the updated shards into the flat parameter buffer the model's parameters view.

With ``max_grad_norm`` (or fp16 loss scaling) the reduced shard is clipped between 2 and 3 by the global norm
of the averaged gradient: each worker sums its shard's squares, one scalar all-reduce adds them.

Under torchft (``--fault-tolerance torchft``) the group is each replica group, and the replicas present average
each worker's gradient shard between 2 and 3 with one more all-reduce, which the quorum commits
(:mod:`~quietsync.strategies.parts.across_replicas`): ZeRO-1 inside a replica group.

Everything is blocking here (the main thread idles during 2–4); ACCO overlaps the same jobs with
computation. Equal to DDP with the same optimizer up to float rounding (tested), with the communication
of a ring all-reduce split into its two halves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ...flat import nbytes, parse_dtype
from ..base import Strategy
from ..checkpoint.logical import SavedTensors, load_module, module_state, module_targets
from ..parts.accumulation import AccumulationConfig, Accumulator
from ..parts.across_replicas import average_across, split_groups
from ..registry import register
from ..substrates.sharded_state import ShardedState
from . import facts


@dataclass
class Zero1Config(AccumulationConfig):
    """Knobs of the ``zero1`` strategy."""

    reduce_dtype: str = "float32"
    """dtype of gradients on the wire: float32, bfloat16 or float16."""

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_dtype(self.reduce_dtype, "reduce_dtype")


@register("zero1", Zero1Config, facts=facts.ZERO1)
class Zero1(Strategy):
    """Blocking ZeRO-1; see the module docstring.

    ``group`` is the group that shards the optimizer and averages gradients: ``world`` (default), or ``shard``
    when another strategy (hierarchical DiLoCo) runs ZeRO-1 inside each node.
    """

    prepares_gradient = True  # it unscales and clips the gradient it commits (docs/contract.md)

    discards_rounds = True
    reshard_refusal = None  # the optimizer shard is a slice of one logical flat state (see ShardedState)

    config: Zero1Config

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, *, group: str = "world",
                 **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.group, self.across = split_groups(self.transport, group)  # torchft: per replica group, then across
        group = self.group
        self.sharded = self.hold("sharded", ShardedState(self.param_groups, optimizer, self.optimizer_kwargs,
                                                         self.transport, group, self.config.reduce_dtype))
        self.flat = self.sharded.flat
        self.optimizer = self.sharded.optimizer
        self.grads = self.flat.new_grad_buffer()
        self.flat.attach_grads(self.grads)
        self.round = self.hold("round", Accumulator(self.config.accumulation))

    def _backward(self, loss: torch.Tensor) -> None:
        self.flat.require_grads_attached(self.grads)
        loss.backward()
        self.round.add()

    def _step(self) -> bool:
        if not self.round.full:
            return False
        n = self.transport.group_size(self.group)
        with self.accounting.idle("reduce_scatter"):
            self.sharded.reduce_scatter_grads(self.grads, n * self.config.accumulation)
        if self.across is not None:  # torchft: the replicas present average each gradient shard
            with self.accounting.idle("all_reduce/replicas"):
                average_across(self.transport, [self.sharded.shard.grad], self.across, "all_reduce/replicas")
        # the averaged gradient's shard: its squares summed over the group (one scalar all-reduce)
        extra = self._prepare_commit([self.sharded.shard.grad], norm_group=self.group,
                                     shared=self.group == "world")
        if extra is None:  # fp16 overflow: the round is dropped on every worker
            self.discard_round()
            return False
        t0 = time.perf_counter()
        self.sharded.step(self._lr_scale(self.steps))
        self.accounting.add_compute(time.perf_counter() - t0)
        with self.accounting.idle("all_gather"):
            self.sharded.all_gather_params()
        self.grads.zero_()
        self.round.reset()
        self._commit(extra or None)
        return True


    def parameters_overwritten(self) -> None:
        """The fp32 master shard follows the overwritten parameters (else the next all-gather restores it)."""
        shard = self.sharded.shard
        with torch.no_grad():
            shard.master.copy_(self.flat.data[shard.lo:shard.hi])

    def _memory(self) -> dict[str, int]:
        return {"grads": nbytes(self.grads)}

    def _state(self) -> dict[str, Any]:
        return {"grads": self.grads.clone()}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.grads.copy_(state["grads"])

    def _logical_state(self) -> dict[str, torch.Tensor]:
        return {**module_state(self.module), **self.sharded.logical_state_dict()}

    def _logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        return {**module_targets(self.module), **self.sharded.logical_targets(saved)}

    def _load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        load_module(self.module, filled)  # the flat parameters (the model's parameters view them)
        self.sharded.load_logical(filled)
        self.grads.zero_()
