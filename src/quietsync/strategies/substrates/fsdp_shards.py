"""FSDP2 parameter sharding inside a node, through the transport (a part held by ``fsdp`` and by
``flexdemo`` with ``params=sharded``).

:class:`FsdpShards` applies PyTorch FSDP2's ``fully_shard`` to a model over the transport's **shard group**
(a 1-D device mesh built from the transport's own process group): every worker keeps only its dim-0 shard
of each parameter (``reshard_after_forward=True``, ZeRO-3), FSDP all-gathers a unit's parameters just
before its forward and backward and reduce-scatters its gradients during backward. Both collectives run
through :class:`TransportAllGather` / :class:`TransportReduceScatter` (torch 2.13's
``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``), so they are metered on ``shard`` and
link-emulated like every other quietsync collective. Nothing crosses nodes here: what the replicate group
exchanges is the holding strategy's business (an all-reduce of the gradient shards for ``fsdp``, the
decoupled replicator for ``flexdemo``), so those bytes are metered on ``replicate``.

Units: every module held in an ``nn.ModuleList`` (a transformer's blocks) is its own FSDP unit, the root
holds the rest (embeddings, tied head); a model without a ModuleList is one unit.

The optimizer works on :attr:`FsdpShards.local`, plain tensors aliasing each worker's shard storage
(``DTensor.to_local()``), so any torch optimizer — and the decoupled optimizers' DCT/top-k on a shard that
is still a matrix — runs unchanged. With a shard group of one worker (one worker per node, or a world of
one) nothing is sharded and ``local`` aliases the whole parameters.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ...flat import nbytes
from ...models.units import blocks
from ...transport import Transport
from ..checkpoint.logical_shards import ShardPiece
from ..parts.accounting import StepAccounting
from ..parts.broadcast import broadcast_parameters
from ..parts.part import Part

_OPS = {"SUM": "sum", "AVG": "avg"}


def _op_name(op: Any) -> str:
    """The transport's name of FSDP's reduce op (FSDP uses SUM with pre/post division on gloo, AVG on
    NCCL)."""
    text = str(op).rsplit(".", 1)[-1].upper()
    if text not in _OPS:
        raise ValueError(
            f"FSDP asked for reduce op {op!r}; the transport reduce-scatter supports SUM and AVG"
        )
    return _OPS[text]


def _transport_comms(transport: Transport, group: str) -> tuple[Any, Any]:
    """FSDP2 ``AllGather`` and ``ReduceScatter`` objects that run on ``transport``'s ``group``."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class TransportAllGather(AllGather):
        """FSDP's parameter all-gather, metered and link-emulated as ``all_gather/fsdp_params``."""

        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> None:
            # Blocking: FSDP only waits handles that are torch Works, and the wait must include the emulated
            # wire time; returning None tells FSDP the data is there.
            transport.all_gather(output_tensor, input_tensor, group_name, name="all_gather/fsdp_params")

    class TransportReduceScatter(ReduceScatter):
        """FSDP's gradient reduce-scatter, metered and link-emulated as ``reduce_scatter/fsdp_grads``."""

        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> None:
            transport.reduce_scatter(output_tensor, input_tensor, group_name, op=_op_name(op),
                                     name="reduce_scatter/fsdp_grads")

    group_name = group
    return TransportAllGather(), TransportReduceScatter()


class FsdpShards(Part):
    """A model sharded by FSDP2 over ``group``, collectives through ``transport``; see the module docstring.

    Args:
        model: the model (parameters on the transport's device); it is changed in place by ``fully_shard``.
        param_groups: torch-style parameter groups of ``model``'s parameters; :attr:`groups` is the same
            grouping over :attr:`local`.
        transport: the transport; rank 0's parameters are broadcast over ``world`` first, so replicas agree.
        group: the transport group that shards parameters (``shard``: inside a node).
    """

    def __init__(self, model: torch.nn.Module, param_groups: list[dict[str, Any]], transport: Transport,
                 group: str = "shard") -> None:
        self.model = model
        self.transport = transport
        self.group = group
        self.n = transport.group_size(group)
        names = {id(p): n for n, p in model.named_parameters()}
        # by name: fully_shard replaces the parameters, so ids taken now would go stale
        group_names = [[names[id(p)] for p in g["params"]] for g in param_groups]
        # whole, before sharding, and over world: every node's replicas start equal
        broadcast_parameters(transport, [p for p in model.parameters()], "world")
        self.fsdp_modules: list[Any] = []
        if self.n > 1:
            self._shard(model)
        by_name = dict(model.named_parameters())
        self.names = [n for names_ in group_names for n in names_]
        self.params = [by_name[n] for n in self.names]
        """The model's parameters the optimizer updates (DTensors when sharded), in group order."""
        with torch.no_grad():
            self.local = [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in self.params]
        """Plain tensors aliasing this worker's shard of each parameter (what the optimizer updates)."""
        self.model_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [by_name[n] for n in names_]}
            for g, names_ in zip(param_groups, group_names)
        ]
        """``param_groups`` over the model's parameters after sharding (the holder must drop its groups over
        the original whole parameters, or they stay alive: a whole copy of the model)."""
        alias = dict(zip(self.names, self.local))
        self.groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [alias[n] for n in names_]}
                       for g, names_ in zip(param_groups, group_names)]
        """``param_groups`` over :attr:`local`."""
        self.grad_holders = self.local
        """The tensors whose ``.grad`` holds a round's gradient between backward and step (the shards)."""

    def _shard(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.transport.device_mesh(self.group)
        # blocks first, the root last: the root's unit then holds only what no block took
        for unit in [*blocks(model), model]:
            fully_shard(unit, mesh=mesh, reshard_after_forward=True)
            all_gather, reduce_scatter = _transport_comms(self.transport, self.group)
            unit.set_custom_all_gather(all_gather)
            unit.set_custom_reduce_scatter(reduce_scatter)
            self.fsdp_modules.append(unit)

    def before_backward(self, last: bool) -> None:
        """Whether the coming backward closes the round: then it reduce-scatters the gradients inside the
        node; otherwise FSDP accumulates unsharded gradients locally
        (``set_requires_gradient_sync(False)``)."""
        if self.fsdp_modules:  # a shard group of one is plain autograd: nothing to toggle
            self.model.set_requires_gradient_sync(last)

    def local_grads(self) -> list[torch.Tensor | None]:
        """This worker's shard of each parameter's gradient (the node average after a synced backward)."""
        return [None if p.grad is None else (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
                for p in self.params]

    def gather_grads(self, accounting: StepAccounting) -> None:
        """``local[i].grad`` ← this worker's shard of the node-averaged gradient (FSDP reduce-scattered it in
        the last backward; nothing to communicate here)."""
        for t, g in zip(self.local, self.local_grads()):
            t.grad = g

    def publish(self, accounting: StepAccounting) -> None:
        """Nothing to spread: the optimizer updated the shards in place and FSDP all-gathers them in the next
        forward. Drops the gradient shards."""
        self.drop_grads()

    def drop_grads(self) -> None:
        """Drop the gradient shards (the model's and the aliases')."""
        for p, t in zip(self.params, self.local):
            p.grad = None
            t.grad = None

    def discard(self) -> None:
        """Drop the open round's gradients, the unsharded ones FSDP accumulates between synced backwards
        included (see ``Strategy.discard_round``)."""
        self.drop_grads()
        for m in self.fsdp_modules:
            for pg in m._get_fsdp_state()._fsdp_param_groups:
                for fp in pg.fsdp_params:
                    fp.unsharded_accumulated_grad = None
                    if getattr(fp, "_unsharded_param", None) is not None:
                        fp._unsharded_param.grad = None

    @contextmanager
    def unsharded(self) -> Iterator[torch.nn.Module]:
        """Within this context the model's parameters are whole (all-gathered through the transport, once) and
        forwards gather nothing; ``state_dict()`` gives whole tensors. A collective on entry: every worker of
        the shard group must enter it (what happens inside, e.g. an export on one worker, needs no peer)."""
        if not self.fsdp_modules:
            yield self.model
            return
        groups = [pg for m in self.fsdp_modules for pg in m._get_fsdp_state()._fsdp_param_groups]
        for m in self.fsdp_modules:
            m.unshard()
            m.set_reshard_after_forward(False, recurse=False)  # forwards inside (evaluation) gather nothing
        # FSDP2's state_dict pre-hooks would reshard (and hand out sharded DTensors); while the parameters are
        # whole, state_dict() and save_pretrained() must see them whole, on one worker alone too (export).
        for pg in groups:
            for handles in (pg._module_to_pre_save_state_dict_hook_handle,
                            pg._module_to_pre_load_state_dict_hook_handle):
                for handle in handles.values():
                    handle.remove()
                handles.clear()
        try:
            yield self.model
        finally:
            for pg in groups:
                pg._register_state_dict_hooks()
            for m in self.fsdp_modules:
                m.set_reshard_after_forward(True, recurse=False)
                m.reshard()

    def memory_report(self) -> dict[str, int]:
        """Bytes of the parameter and gradient shards this worker holds between steps."""
        grads = sum(nbytes(g) for g in self.local_grads() if g is not None)
        return {"param_shard": sum(nbytes(t) for t in self.local), "grad_shard": grads}

    @property
    def mesh(self) -> Any:
        """The 1-D device mesh of the shard group (None for a group of one)."""
        return self.transport.device_mesh(self.group)

    def logical_pieces(self) -> list[ShardPiece]:
        """Each parameter's shard as a :class:`~quietsync.strategies.checkpoint.logical_shards.ShardPiece`
        (FSDP2's local tensors are its ``Shard(0)`` chunks already, without padding)."""
        return [ShardPiece(n, t, t.shape[0] if t.dim() else 1, p.shape if p.dim() else torch.Size([1]))
                for n, t, p in zip(self.names, self.local, self.params)]

    def after_logical_load(self) -> None:
        """Nothing to spread: the pieces alias FSDP's shards, which the next forward all-gathers."""

    def state_dict(self) -> dict[str, Any]:
        """This worker's parameter shards (sharded state: each worker saves its own)."""
        return {"shards": [t.clone() for t in self.local], "n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["n"] != self.n or any(a.shape != b.shape for a, b in zip(state["shards"], self.local)):
            raise ValueError(
                "checkpoint parameter shards do not match this worker's shards (another node layout?)"
            )
        with torch.no_grad():
            for t, saved in zip(self.local, state["shards"]):
                t.copy_(saved)
