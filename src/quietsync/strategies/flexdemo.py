"""``flexdemo``: FlexDeMo -- hybrid sharding inside a node, decoupled momentum across nodes (paper 001).

Workers of one node form the **shard group**; workers with the same local index on different nodes
form the **replicate group**. A step (Algorithm 1 of paper 001):

1. accumulate ``accumulation`` micro-batches locally (no communication during backward);
2. **reduce-scatter** the gradients inside the node (one collective on ``shard``, fast link):
   every worker receives the node-averaged gradient of its shard. Each parameter is sharded along
   dim 0 (rows padded to a multiple of the node size), as FSDP2 does, so a shard of a matrix is
   still a matrix and DeMo's 2-D DCT blocks keep their meaning;
3. the decoupled optimizer runs on the shard only -- momentum, Adam moments and the fp32 master
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

Substrate: per-parameter dim-0 sharding built on the transport (not PyTorch FSDP2) so that every
byte -- intra-node reduce-scatter and all-gather included -- is metered and link-emulated like
every other strategy; see ``docs/flexdemo.md``. Parameters themselves stay whole on every worker
(ZeRO-2 memory, not ZeRO-3).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..flat import nbytes
from .base import Strategy
from .broadcast import broadcast_parameters
from .decoupled import DecoupledConfig, DecoupledRound, build_decoupled_optimizer
from .registry import register


class DimZeroShards:
    """Dim-0 sharding of a list of tensors over ``n`` workers, packed so one collective moves all.

    The packed buffer is ``(n, S)``: row ``i`` is shard ``i`` of every tensor, end to end, where
    tensor ``t`` of shape ``(rows, *rest)`` contributes ``ceil(rows / n) * prod(rest)`` elements.
    """

    def __init__(self, shapes: list[torch.Size], n: int) -> None:
        self.n = n
        self.shapes = [tuple(s) if len(s) else (1,) for s in shapes]
        self.rows = [s[0] for s in self.shapes]
        self.rest = [math.prod(s[1:]) for s in self.shapes]
        self.shard_rows = [-(-r // n) for r in self.rows]
        self.shard_shapes = [(sr, *s[1:]) for sr, s in zip(self.shard_rows, self.shapes)]
        self.widths = [sr * rest for sr, rest in zip(self.shard_rows, self.rest)]
        self.width = sum(self.widths)

    def pack(self, tensors: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
        """``(n * S)`` flat buffer of ``tensors`` (None = zeros), shard-major."""
        parts = []
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
        for t, rows, rest, sr, w in zip(tensors, self.rows, self.rest, self.shard_rows, self.widths):
            if t is None:
                parts.append(torch.zeros(self.n, w, dtype=dtype, device=device))
                continue
            m = t.detach().reshape(rows, rest).to(dtype)
            if sr * self.n != rows:
                m = F.pad(m, (0, 0, 0, sr * self.n - rows))
            parts.append(m.reshape(self.n, w))
        return torch.cat(parts, dim=1).reshape(-1)

    def unpack_into(self, buf: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Copy a packed ``(n * S)`` buffer back into whole ``tensors``."""
        full = buf.view(self.n, self.width)
        at = 0
        for t, rows, rest, sr, w in zip(tensors, self.rows, self.rest, self.shard_rows, self.widths):
            block = full[:, at : at + w].reshape(self.n * sr, rest)[:rows]
            t.copy_(block.reshape(t.shape))
            at += w

    def views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Per-tensor shard views of one worker's ``(S,)`` buffer."""
        out, at = [], 0
        for shape, w in zip(self.shard_shapes, self.widths):
            out.append(shard[at : at + w].view(shape))
            at += w
        return out


@register("flexdemo", DecoupledConfig)
class FlexDeMo(Strategy):
    """Hybrid-sharded decoupled momentum; see the module docstring."""

    reshard_refusal = (
        "each worker's decoupled momentum δ is its own (only a compressed part of it ever crosses the "
        "network), sharded over the node, so there is no one state to split over another number of workers"
    )

    discards_rounds = True

    config: DecoupledConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.n = self.transport.group_size("shard")
        self.index = self.transport.group_rank("shard")
        broadcast_parameters(self.transport, self.params, "world")
        self.shards = DimZeroShards([p.shape for p in self.params], self.n)
        packed = self.shards.pack(list(self.params), torch.float32)
        self.master = packed.view(self.n, -1)[self.index].clone()
        self.grad = torch.zeros_like(self.master)
        self.master_views = self.shards.views(self.master)
        self.grad_views = self.shards.views(self.grad)
        owner = {id(p): v for p, v in zip(self.params, self.master_views)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [owner[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        self.optimizer = build_decoupled_optimizer(
            self.config, self.optimizer_factory, groups, self.optimizer_kwargs, self.transport, "replicate")
        self.round = self.hold("round", DecoupledRound(self.optimizer, self.config.accumulation, list(model.parameters())),
                               takes_micro_batches=True)
        self.accounting.reset()  # the initial broadcast is set-up, not step 1's traffic

    def _step(self) -> bool:
        if not self.round.full:
            return False
        # 1. reduce-scatter inside the node: this worker's shard of the node-averaged gradient
        with self.accounting.idle("reduce_scatter"):
            packed = self.shards.pack([p.grad for p in self.params], torch.float32)
            self.transport.reduce_scatter(self.grad, packed, "shard", op="avg", name="reduce_scatter/grads")
        for p, master, grad in zip(self.params, self.master_views, self.grad_views):
            master.grad = None if p.grad is None else grad
        # 2. the decoupled optimizer on the shard; replication across nodes happens inside
        extra = self.round.step(self._lr_scale(self.steps), self.accounting)
        # 3. all-gather the updated shards inside the node into the model's parameters
        with self.accounting.idle("all_gather"):
            gathered = self.master.new_empty(self.n * self.master.numel())
            self.transport.all_gather(gathered, self.master, "shard", name="all_gather/params")
            with torch.no_grad():
                self.shards.unpack_into(gathered, self.params)
        for p in self.params:
            p.grad = None
        self._commit(extra=extra)
        return True


    def _memory(self) -> dict[str, int]:
        """Bytes of the sharded state this worker holds (master shard, grad shard, optimizer state)."""
        opt_state = sum(nbytes(v) for st in self.optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"master_shard": nbytes(self.master), "grad_shard": nbytes(self.grad), "optimizer_state": opt_state}

    def _state(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "master": self.master.clone()}

    def _load_state(self, state: dict[str, Any]) -> None:
        if state["master"].shape != self.master.shape:
            raise ValueError("checkpoint shard does not match this worker's shard (another node layout?)")
        self.module.load_state_dict(state["model"])
        with torch.no_grad():
            self.master.copy_(state["master"])
