"""Dim-0 sharding of whole parameters on quietsync's flat substrate (a part held by ``flexdemo --params
replicated``).

Every worker keeps the **whole** parameters (ZeRO-2 memory, not ZeRO-3) and, for its shard, an fp32 master
copy and a gradient buffer; one reduce-scatter per step (on ``shard``) brings the node-averaged gradient of
the shard, one all-gather (on ``shard``) spreads the updated shards back into the parameters. Each parameter
is sharded along dim 0 with its rows padded to a multiple of the group size, as FSDP2 does, so a shard of a
matrix is still a matrix. Compared with :class:`~quietsync.strategies.substrates.fsdp_shards.FsdpShards` it
moves fewer bytes inside the node (no all-gather in every forward and backward) and holds more memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from ...flat import nbytes
from ...transport import Transport
from ..checkpoint.logical_shards import ShardPiece
from ..parts.accounting import StepAccounting
from ..parts.broadcast import broadcast_parameters
from ..parts.part import Part


class DimZeroShards:
    """Dim-0 sharding of a list of tensors over ``n`` workers, packed so one collective moves all.

    The packed buffer is ``(n, S)``: row ``i`` is shard ``i`` of every tensor, end to end, where
    tensor ``t`` of shape ``(rows, *rest)`` contributes ``ceil(rows / n) * prod(rest)`` elements.
    """

    def __init__(self, shapes: list[torch.Size], n: int) -> None:
        self.n = n
        self.shapes = [tuple(s) if len(s) else (1,) for s in shapes]  # a 0-dim tensor is one row
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


class FlatDimZeroShards(Part):
    """Whole parameters + this worker's fp32 dim-0 master shard over ``group``; see the module docstring.

    Args:
        model: the model; its parameters stay whole on every worker.
        param_groups: torch-style parameter groups; :attr:`groups` is the same grouping over :attr:`local`.
        transport: the transport; rank 0's parameters are broadcast over ``world`` first.
        group: the group that shards (``shard``: inside a node).
    """

    def __init__(self, model: torch.nn.Module, param_groups: list[dict[str, Any]], transport: Transport,
                 group: str = "shard") -> None:
        self.model = model
        self.transport = transport
        self.group = group
        self.params = [p for g in param_groups for p in g["params"]]
        self.n = transport.group_size(group)
        self.index = transport.group_rank(group)
        broadcast_parameters(transport, self.params, "world")  # world: every node's replicas start equal
        self.shards = DimZeroShards([p.shape for p in self.params], self.n)
        packed = self.shards.pack(list(self.params), torch.float32)
        self.master = packed.view(self.n, -1)[self.index].clone()  # a view would keep the whole (n, S) buffer alive
        self.grad = torch.zeros_like(self.master)
        self.local = self.shards.views(self.master)
        """This worker's fp32 master shard of each parameter (what the optimizer updates)."""
        self._grad_views = self.shards.views(self.grad)
        owner = {id(p): v for p, v in zip(self.params, self.local)}
        self.groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [owner[id(p)] for p in g["params"]]}
            for g in param_groups
        ]
        """``param_groups`` over :attr:`local`."""
        self.model_groups = param_groups
        """``param_groups`` over the model's parameters (unchanged: they stay whole)."""
        self.grad_holders = self.params
        """The tensors whose ``.grad`` holds a round's gradient between backward and step (the parameters)."""

    def before_backward(self, last: bool) -> None:
        """Nothing to prepare: gradients accumulate whole in ``p.grad``."""

    def gather_grads(self, accounting: StepAccounting) -> None:
        """Reduce-scatter the gradients inside the node: each ``local[i].grad`` ← the node average of its
        shard."""
        with accounting.idle("reduce_scatter"):
            packed = self.shards.pack([p.grad for p in self.params], torch.float32)
            self.transport.reduce_scatter(
                self.grad, packed, self.group, op="avg", name="reduce_scatter/grads"
            )
        for p, master, grad in zip(self.params, self.local, self._grad_views):
            master.grad = None if p.grad is None else grad

    def publish(self, accounting: StepAccounting) -> None:
        """All-gather the updated shards inside the node into the model's parameters; drop the gradients."""
        with accounting.idle("all_gather"):
            self._spread()
        for p in self.params:
            p.grad = None

    def _spread(self) -> None:
        """All-gather the master shards inside the node into the whole parameters."""
        gathered = self.master.new_empty(self.n * self.master.numel())
        self.transport.all_gather(gathered, self.master, self.group, name="all_gather/params")
        with torch.no_grad():
            self.shards.unpack_into(gathered, self.params)

    @contextmanager
    def unsharded(self) -> Iterator[torch.nn.Module]:
        """The parameters are always whole here."""
        yield self.model

    def memory_report(self) -> dict[str, int]:
        return {"params": sum(nbytes(p) for p in self.params), "master_shard": nbytes(self.master),
                "grad_shard": nbytes(self.grad)}

    @property
    def mesh(self) -> Any:
        """The 1-D device mesh of the shard group (None for a group of one)."""
        return self.transport.device_mesh(self.group)

    def logical_pieces(self) -> list[ShardPiece]:
        """Each parameter's master shard as a
        :class:`~quietsync.strategies.checkpoint.logical_shards.ShardPiece`: the rows of torch's ``Shard(0)``
        chunk, then padding (a 0-dim parameter counts as shape ``(1,)``)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = []
        for p, local, rows, sr in zip(self.params, self.local, self.shards.rows, self.shards.shard_rows):
            mine = max(0, min(sr, rows - self.index * sr))  # the trailing workers hold fewer real rows, or none
            out.append(ShardPiece(names[id(p)], local, mine, torch.Size(p.shape if p.dim() else (1,))))
        return out

    def after_logical_load(self) -> None:
        """All-gather the loaded master shards into the whole parameters (a collective on the shard group)."""
        self._spread()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "master": self.master.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["master"].shape != self.master.shape:
            raise ValueError("checkpoint shard does not match this worker's shard (another node layout?)")
        self.model.load_state_dict(state["model"])
        with torch.no_grad():
            self.master.copy_(state["master"])
