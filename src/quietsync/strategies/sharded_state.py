"""The sharded flat state (a part): flat parameters every worker holds whole, and this worker's ZeRO-1 shard
of the optimizer over one group.

:class:`ShardedState` is what ``zero1`` holds, and what the overlap machinery of ``acco``/``dpu``/``wp``
builds on. It owns

* ``flat`` — the :class:`~quietsync.flat.FlatParams` the model's parameters view (padded to the group size);
* ``shard`` — the :class:`~quietsync.sharded.ShardedOptimizer`: fp32 master shard, its reduced gradient and a
  torch optimizer over it (original parameter groups kept);
* ``lr`` — the :class:`~quietsync.strategies.lr.LRScaler` that applies the lr schedule before each step;

and the three moves of a sharded step: :meth:`reduce_scatter_grads`, :meth:`step`, :meth:`all_gather_params`.
At construction rank 0's parameters are broadcast over the group, so replicas start identical.
"""

from __future__ import annotations

from typing import Any

import torch

from ..flat import DTypePolicy, FlatParams, nbytes, parse_dtype
from ..sharded import ShardedOptimizer
from ..transport import Transport
from .broadcast import broadcast_parameters
from .lr import LRScaler


class ShardedState:
    """Flat parameters + a ZeRO-1 optimizer shard over ``group``; see the module docstring.

    Args:
        param_groups: torch-style parameter groups of the model.
        optimizer: torch optimizer class or factory; ``optimizer_kwargs`` its arguments.
        transport: the transport; ``group``: the group that shards the optimizer (``world`` or ``shard``).
        reduce_dtype: dtype of gradients on the wire (``float32``, ``bfloat16``, ``float16``).
    """

    def __init__(self, param_groups: list[dict[str, Any]], optimizer: Any, optimizer_kwargs: dict[str, Any],
                 transport: Transport, group: str = "world", reduce_dtype: str = "float32") -> None:
        self.transport = transport
        self.group = group
        n = transport.group_size(group)
        policy = DTypePolicy(reduce_dtype=parse_dtype(reduce_dtype, "reduce_dtype"))
        self.flat = FlatParams(param_groups, pad_to=n, policy=policy)
        broadcast_parameters(transport, [self.flat.data], group)
        self.shard = ShardedOptimizer(self.flat, optimizer, optimizer_kwargs, transport.group_rank(group), n)
        self.optimizer = self.shard.optimizer
        self.lr = LRScaler(self.optimizer)

    def reduce_scatter_grads(self, grads: torch.Tensor, divisor: float, name: str = "grads") -> None:
        """``shard.grad`` ← (Σ over workers of ``grads``, this worker's shard) / ``divisor``."""
        policy = self.flat.policy
        grad = self.shard.grad
        wire = grads if grads.dtype == policy.reduce_dtype else grads.to(policy.reduce_dtype)
        out = grad if grad.dtype == policy.reduce_dtype else torch.empty_like(grad, dtype=policy.reduce_dtype)
        self.transport.reduce_scatter(out, wire, self.group, name=f"reduce_scatter/{name}")
        if out is not grad:
            grad.copy_(out)
        grad.div_(divisor)

    def step(self, lr_scale: float) -> None:
        """One optimizer step of the master shard with the gradient in ``shard.grad``, at ``lr_scale``."""
        self.lr.apply(lr_scale)
        self.shard.step()

    def all_gather_params(self, out: torch.Tensor | None = None, source: torch.Tensor | None = None,
                          name: str = "params") -> None:
        """``out`` (default: the flat parameters) ← every worker's ``source`` shard (default: its master)."""
        src = self.shard.master if source is None else source
        send = src.to(self.flat.dtype) if src.dtype != self.flat.dtype else src.clone()
        target = self.flat.data if out is None else out
        self.transport.all_gather(target, send, self.group, name=f"all_gather/{name}")

    def memory_report(self) -> dict[str, int]:
        opt_state = sum(nbytes(v) for st in self.optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor))
        return {"params": nbytes(self.flat.data), "master_shard": nbytes(self.shard.master),
                "grad_shard": nbytes(self.shard.grad), "optimizer_state": opt_state}

    def state_dict(self) -> dict[str, Any]:
        return {"params": self.flat.data.clone(), "shard": self.shard.state_dict(), "lr": self.lr.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["params"].numel() != self.flat.data.numel():
            raise ValueError("checkpoint parameters do not match this model's layout")
        with torch.no_grad():
            self.flat.data.copy_(state["params"])
        self.shard.load_state_dict(state["shard"])
        self.lr.load_state_dict(state["lr"])
