"""The sharded flat state (a part): flat parameters every worker holds whole, and this worker's ZeRO-1 shard
of the optimizer over one group.

:class:`ShardedState` is what ``zero1`` holds, and what the overlap machinery of ``acco``/``dpu``/``wp``
builds on. It owns

* ``flat`` — the :class:`~quietsync.flat.FlatParams` the model's parameters view (padded to the group size);
* ``shard`` — the :class:`~quietsync.strategies.substrates.sharded_optimizer.ShardedOptimizer`: fp32 master
  shard, its reduced gradient and a
  torch optimizer over it (original parameter groups kept);
* ``lr`` — the :class:`~quietsync.strategies.parts.lr.LRScaler` that applies the lr schedule before each step;

and the three moves of a sharded step: :meth:`reduce_scatter_grads`, :meth:`step`, :meth:`all_gather_params`.
At construction rank 0's parameters are broadcast over the group, so replicas start identical.

Its world-size-independent form (:meth:`logical_state_dict`, for checkpoints that reshard) is the master and
the optimizer's per-element state over the unpadded flat buffer, each a DTensor ``Shard(0)`` over the group;
see :mod:`~quietsync.strategies.checkpoint.logical` for why.
"""

from __future__ import annotations

from typing import Any

import torch

from ...flat import DTypePolicy, FlatParams, nbytes, parse_dtype
from ...transport import Transport
from ..checkpoint.logical import (
    ReshardError,
    SavedTensors,
    base_lrs_state,
    base_lrs_target,
    flat_tensor,
    local_part,
)
from ..parts.broadcast import broadcast_parameters
from ..parts.lr import LRScaler
from ..parts.part import Part
from .sharded_optimizer import ShardedOptimizer

_FLAT = "optim.flat."


class ShardedState(Part):
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
        broadcast_parameters(transport, [self.flat.data], group)  # first: the master shard copies the agreed values
        self.shard = ShardedOptimizer(self.flat, optimizer, optimizer_kwargs, transport.group_rank(group), n)
        self.optimizer = self.shard.optimizer
        self.lr = LRScaler(self.optimizer)

    def reduce_scatter_grads(self, grads: torch.Tensor, divisor: float, name: str = "grads") -> None:
        """``shard.grad`` ← (Σ over workers of ``grads``, this worker's shard) / ``divisor``."""
        policy = self.flat.policy
        grad = self.shard.grad
        wire = grads if grads.dtype == policy.reduce_dtype else grads.to(policy.reduce_dtype)
        # one dtype in and out of the collective: reduce in reduce_dtype, widen into the shard after
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
        return {
            "params": self.flat.data.clone(),
            "shard": self.shard.state_dict(),
            "lr": self.lr.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["params"].numel() != self.flat.data.numel():
            raise ValueError("checkpoint parameters do not match this model's layout")
        with torch.no_grad():
            self.flat.data.copy_(state["params"])
        self.shard.load_state_dict(state["shard"])
        self.lr.load_state_dict(state["lr"])

    # ------------------------------------------------------------------ world-size-independent form
    def _mesh(self) -> Any:
        """A 1-D device mesh over the group (None for a group of one)."""
        return self.transport.device_mesh(self.group)

    def _local_len(self) -> int:
        """Elements of this shard that are not padding (the local length of the ``Shard(0)`` chunk)."""
        return max(0, min(self.shard.hi, self.flat.numel) - self.shard.lo)

    def _views(self) -> list[torch.Tensor]:
        return [g["params"][0] for g in self.optimizer.param_groups]

    def logical_piece(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` (a tensor laid out like this worker's master shard) as its piece of the logical
        unpadded flat tensor: a DTensor ``Shard(0)`` over the group (see the module docstring)."""
        return flat_tensor(shard[:self._local_len()], self.flat.numel, self._mesh())

    def logical_piece_target(self, dtype: torch.dtype) -> torch.Tensor:
        """A zero :meth:`logical_piece` of ``dtype`` to read a checkpoint into."""
        return flat_tensor(torch.zeros(self._local_len(), dtype=dtype, device=self.flat.device), self.flat.numel,
                           self._mesh())

    def load_logical_piece(self, shard: torch.Tensor, filled: torch.Tensor) -> None:
        """``shard`` ← the filled :meth:`logical_piece_target` (its padding zeroed)."""
        length = self._local_len()
        with torch.no_grad():
            shard.zero_()
            shard[:length].copy_(local_part(filled))

    def logical_state_dict(self) -> dict[str, torch.Tensor]:
        """``optim.flat.master``, ``optim.flat.<key>`` (DTensors over the unpadded flat buffer),
        ``optim.group<i>.<key>`` (scalars) and ``optim.base_lrs``."""
        mesh, n, length = self._mesh(), self.flat.numel, self._local_len()
        out = {
            f"{_FLAT}master": flat_tensor(self.shard.master[:length], n, mesh),
            **base_lrs_state(self.lr.base_lrs),
        }
        views = self._views()
        states = [self.optimizer.state.get(v, {}) for v in views]
        keys = sorted({k for st in states for k in st})
        for key in keys:
            values = [st.get(key) for st in states]
            if any(not isinstance(v, torch.Tensor) for v in values):
                raise ReshardError(
                    f"optimizer state {key!r} is missing for a parameter group or not a tensor"
                )
            if all(v.dim() == 0 for v in values):
                out.update({f"optim.group{i}.{key}": v.detach() for i, v in enumerate(values)})
            elif all(v.shape == view.shape for v, view in zip(values, views)):
                # the groups lie end to end in the flat buffer: their views concatenate to the shard's layout
                local = torch.cat([v.detach().reshape(-1) for v in values])[:length]
                out[f"{_FLAT}{key}"] = flat_tensor(local, n, mesh)
            else:
                raise ReshardError(f"optimizer state {key!r} is neither per element nor a scalar per group")
        return out

    def logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        """Tensors of this shard's layout to read :meth:`logical_state_dict` of any world size into."""
        mesh, n, length = self._mesh(), self.flat.numel, self._local_len()
        out = base_lrs_target(self.lr.base_lrs, saved)
        for key, (shape, dtype) in saved.items():
            if key.startswith(_FLAT):
                if tuple(shape) != (n,):
                    raise ReshardError(
                        f"the checkpoint's {key} has shape {tuple(shape)}; this model's flat buffer "
                        f"has {n} elements (another model or parameter groups?)"
                    )
                out[key] = flat_tensor(torch.zeros(length, dtype=dtype, device=self.flat.device), n, mesh)
            elif key.startswith("optim.group"):
                out[key] = torch.zeros(shape, dtype=dtype)
        if f"{_FLAT}master" not in out:
            raise ReshardError("the checkpoint holds no ZeRO-1 master parameters (optim.flat.master)")
        return out

    def load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        """Take the state :meth:`logical_targets` was filled with."""
        length = self._local_len()
        with torch.no_grad():
            self.shard.master.zero_()  # the padding past length stays zero
            self.shard.master[:length].copy_(local_part(filled[f"{_FLAT}master"]))
        views = self._views()
        state: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(len(views))}
        for key, value in filled.items():
            if key.startswith(_FLAT) and key != f"{_FLAT}master":
                whole = torch.zeros(self.shard.master.numel(), dtype=value.dtype, device=self.flat.device)
                whole[:length].copy_(local_part(value))
                for i, (a, b) in enumerate(self.shard.slices):
                    state[i][key[len(_FLAT):]] = whole[a:b].view(views[i].shape).clone()
            elif key.startswith("optim.group"):
                group, name = key[len("optim.group"):].split(".", 1)
                state[int(group)][name] = value
        if any(state.values()):
            self.optimizer.load_state_dict({"state": state,  # group options are this run's: the logical form saves none
                                            "param_groups": self.optimizer.state_dict()["param_groups"]})
        self.lr.base_lrs = [float(x) for x in filled["optim.base_lrs"]]
