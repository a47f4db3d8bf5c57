"""World-size-independent ("logical") state of dim-0 parameter shards: what ``fsdp`` and ``flexdemo``
checkpoints that reshard hold (see :mod:`~quietsync.strategies.checkpoint.logical` for the idea and the
``ddp``/``zero1`` forms).

Both substrates of these strategies — FSDP2 (:class:`~quietsync.strategies.substrates.fsdp_shards.FsdpShards`)
and the flat dim-0 one (:class:`~quietsync.strategies.substrates.dim0_shards.FlatDimZeroShards`) — give worker
``i`` of the shard group rows ``[i*c, min((i+1)*c, rows))`` of every parameter, ``c = ceil(rows / n)``:
exactly torch's ``Shard(0)`` chunks (the flat substrate pads the last shard with zero rows, cut here). So each
worker's piece of a parameter, and of every per-element optimizer state, is the local tensor of a DTensor
``Shard(0)`` of the whole parameter over a 1-D mesh of the shard group, and ``torch.distributed.checkpoint``
writes each piece once and reads, on any other cut (another number of workers per node), the rows each new
piece overlaps. Nothing is gathered: a checkpoint needs no more memory than training does.

Keys, under a ``prefix`` the strategy chooses (``""`` for ``fsdp``, whose replicas across nodes agree;
``replica.<node>.`` for ``flexdemo``, whose nodes each keep their own decoupled momentum):

* ``model.<name>`` — each parameter (sharded) and each persistent buffer (whole);
* ``optim.<name>.<key>`` — the optimizer's per-parameter state: per-element tensors sharded like the parameter,
  scalars (AdamW's ``step``) whole;
* ``optim.<name>.delta`` — a decoupled optimizer's momentum, **spatial** (its DCT-domain form depends on how
  the shard is cut into blocks, so it is converted on saving and back into the new layout's domain on loading);
* ``optim.decoupled.step`` and ``optim.replicator.<key>`` — a decoupled optimizer's counters.

Saving at one world and loading at another is exact for everything above (the tests check it); what follows
differs from an uninterrupted run only where the computation depends on the cut itself (DCT blocks and top-k
of a shard, random positions drawn per shard), as it would for a run started on the new layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .logical import ReshardError, SavedTensors, local_part

_SPATIAL_DOMAIN = "spatial"


@dataclass(frozen=True)
class ShardPiece:
    """One parameter as a worker holds it."""

    name: str
    """The parameter's name in the model (a tied parameter under its first name)."""
    local: torch.Tensor
    """The tensor the optimizer updates: this worker's rows (the flat substrate adds zero padding rows; an
    unsharded 0-dim parameter stays 0-dim and counts as one row)."""
    rows: int
    """How many leading rows of :attr:`local` are the parameter's (the rest is padding)."""
    shape: torch.Size
    """The whole parameter's shape."""


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``t`` (a 0-dim tensor as one row)."""
    return t.view(1)[:rows] if t.dim() == 0 else t[:rows]


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)  # as torch does: a size-0 dim leaves the outer strides nonzero
    return tuple(reversed(stride))


def _sharded(local: torch.Tensor, shape: torch.Size, mesh: Any) -> torch.Tensor:
    """``local`` as the ``Shard(0)`` piece of a tensor of ``shape`` over ``mesh`` (itself when there is no
    mesh)."""
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(torch.Size(shape)))


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers that its ``state_dict`` holds, by name."""
    out = {}
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{name}" if module_name else name] = buf
    return out


def _momentum_to_spatial(
    optimizer: torch.optim.Optimizer, delta: torch.Tensor, shape: torch.Size
) -> torch.Tensor:
    from ...wire.replicators import REPLICATORS, convert_momentum

    domain = optimizer.replicator.momentum_domain  # type: ignore[attr-defined]
    if domain == _SPATIAL_DOMAIN:
        return delta.detach()
    return convert_momentum(delta.detach(), shape, domain, REPLICATORS["full"]())


def _is_decoupled(optimizer: torch.optim.Optimizer) -> bool:
    return hasattr(optimizer, "replicator") and hasattr(optimizer, "decoupled_step")


def _by_local(pieces: list[ShardPiece], optimizer: torch.optim.Optimizer) -> list[ShardPiece]:
    """The pieces in the optimizer's parameter order (every optimizer parameter must be a piece's tensor)."""
    owner = {id(p.local): p for p in pieces}
    out = []
    for group in optimizer.param_groups:
        for t in group["params"]:
            if id(t) not in owner:
                raise ReshardError("the optimizer holds a tensor that is not a parameter shard of the model")
            out.append(owner[id(t)])
    return out


def shard_state(shards: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                prefix: str = "") -> dict[str, torch.Tensor]:
    """This worker's part of the logical state (see the module docstring), for ``dcp.save``. ``shards`` is the
    substrate (``logical_pieces()``, ``mesh``)."""
    pieces, mesh = shards.logical_pieces(), shards.mesh
    out: dict[str, torch.Tensor] = {}
    for p in pieces:
        out[f"{prefix}model.{p.name}"] = _sharded(_rows(p.local.detach(), p.rows), p.shape, mesh)
    out.update({f"{prefix}model.{n}": b.detach() for n, b in persistent_buffers(model).items()})
    for p in _by_local(pieces, optimizer):
        for key, value in optimizer.state.get(p.local, {}).items():
            if not isinstance(value, torch.Tensor):
                raise ReshardError(
                    f"optimizer state {key!r} of {p.name} is a {type(value).__name__}, not a tensor"
                )
            if key == "delta" and _is_decoupled(optimizer):
                value = _momentum_to_spatial(optimizer, value, p.local.shape)
            name = f"{prefix}optim.{p.name}.{key}"
            if value.dim() == 0:
                out[name] = value.detach()
            elif value.shape == p.local.shape:
                out[name] = _sharded(value.detach()[: p.rows], p.shape, mesh)
            else:
                raise ReshardError(
                    f"optimizer state {key!r} of {p.name} has shape {tuple(value.shape)}, neither "
                    f"a scalar nor the shard's {tuple(p.local.shape)}"
                )
    if _is_decoupled(optimizer):
        out[f"{prefix}optim.decoupled.step"] = torch.tensor(optimizer.decoupled_step, dtype=torch.int64)
        for key, value in optimizer.replicator.state_dict().items():  # type: ignore[attr-defined]
            if not isinstance(value, int):
                raise ReshardError(f"replicator state {key!r} is a {type(value).__name__}, not an integer")
            out[f"{prefix}optim.replicator.{key}"] = torch.tensor(value, dtype=torch.int64)
    return out


def shard_targets(shards: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: SavedTensors,
                  prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensors of this worker's layout to read :func:`shard_state` of any world size into (checks the
    shapes)."""
    pieces, mesh = shards.logical_pieces(), shards.mesh
    out: dict[str, torch.Tensor] = {}

    def piece_target(key: str, p: ShardPiece, dtype: torch.dtype) -> torch.Tensor:
        local = torch.zeros((p.rows, *p.shape[1:]), dtype=dtype, device=p.local.device)
        return _sharded(local, p.shape, mesh)

    for p in pieces:
        key = f"{prefix}model.{p.name}"
        shape = saved.get(key, (None, None))[0]
        # a key the checkpoint lacks is reported by the caller, with the others missing
        if shape is not None and tuple(shape) != tuple(p.shape):
            raise ReshardError(
                f"the checkpoint's {key} has shape {tuple(shape)}, this model's {tuple(p.shape)} "
                "(another model?)"
            )
        out[key] = piece_target(key, p, p.local.dtype)
    out.update({f"{prefix}model.{n}": torch.empty_like(b) for n, b in persistent_buffers(model).items()})
    for p in _by_local(pieces, optimizer):
        head = f"{prefix}optim.{p.name}."
        for key, (shape, dtype) in saved.items():
            if not key.startswith(head) or "." in key[len(head):]:
                continue
            if len(shape) == 0:
                out[key] = torch.zeros((), dtype=dtype)
            elif tuple(shape) == tuple(p.shape):
                out[key] = piece_target(key, p, dtype)
            else:
                raise ReshardError(
                    f"the checkpoint's {key} has shape {tuple(shape)}, the parameter {tuple(p.shape)}"
                )
    if _is_decoupled(optimizer):
        counters = f"{prefix}optim.decoupled.step", f"{prefix}optim.replicator."
        for key in saved:
            if key == counters[0] or key.startswith(counters[1]):
                out[key] = torch.zeros((), dtype=torch.int64)
        if counters[0] not in out:
            raise ReshardError(f"the checkpoint holds no decoupled optimizer state ({counters[0]})")
    return out


def load_shards(shards: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                filled: Mapping[str, torch.Tensor], prefix: str = "") -> None:
    """Take the state :func:`shard_targets` was filled with: the parameter pieces (padding rows zeroed), the
    buffers, and the optimizer's state through its own ``load_state_dict`` (a decoupled momentum as spatial,
    which the optimizer converts into its replicator's domain for the new cut); then the substrate spreads the
    pieces (``after_logical_load()``: a collective for the flat substrate)."""
    pieces = shards.logical_pieces()
    with torch.no_grad():
        for p in pieces:
            p.local.zero_()
            _rows(p.local, p.rows).copy_(local_part(filled[f"{prefix}model.{p.name}"]))
        for n, b in persistent_buffers(model).items():
            b.copy_(filled[f"{prefix}model.{n}"])
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, p in enumerate(_by_local(pieces, optimizer)):
        head = f"{prefix}optim.{p.name}."
        entry = {}
        for key, value in filled.items():
            if key.startswith(head) and "." not in key[len(head):]:
                value = local_part(value)
                if value.dim():
                    # the checkpoint holds the real rows only; the optimizer's state has the shard's padded shape
                    whole = torch.zeros(p.local.shape, dtype=value.dtype, device=p.local.device)
                    whole[: p.rows].copy_(value)
                    value = whole
                entry[key[len(head):]] = value
        if entry:
            state[i] = entry
    current = optimizer.state_dict()
    loaded: dict[str, Any] = {"state": state, "param_groups": current["param_groups"]}
    if _is_decoupled(optimizer):
        replicator = {k[len(f"{prefix}optim.replicator."):]: int(v) for k, v in filled.items()
                      if k.startswith(f"{prefix}optim.replicator.")}
        loaded["decoupled"] = {"step": int(filled[f"{prefix}optim.decoupled.step"]), "replicator": replicator,
                               "momentum_domain": _SPATIAL_DOMAIN}
    optimizer.load_state_dict(loaded)
    shards.after_logical_load()
