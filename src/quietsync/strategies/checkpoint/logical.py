"""World-size-independent ("logical") state of a strategy: what a checkpoint that reshards holds.

A worker's :meth:`~quietsync.strategies.base.Strategy.state_dict` is exact but tied to its world size (flat
buffers padded to the worker count, this worker's optimizer shard). The logical state names everything by
*what* it is, not by *who* holds it, so a job saved on 4 workers can be loaded on 2 (and back):

* ``steps`` — committed optimizer steps (the lr schedule's position);
* ``model.<name>`` — the module's ``state_dict()`` entries (every worker holds the same);
* ``optim.base_lrs`` — each parameter group's base lr (what the schedule scales);
* a **replicated optimizer** (``ddp``: every worker runs the whole optimizer): ``optim.<parameter
  name>.<key>``,
  torch's per-parameter state (``step``, ``exp_avg``, ``exp_avg_sq`` for AdamW) — see :func:`optimizer_state`;
* a **ZeRO-1 optimizer shard** (``zero1``): ``optim.flat.master`` and ``optim.flat.<key>`` — the fp32 master
  copy and each per-element state tensor over the whole flat parameter buffer *without its padding*, as a
  DTensor ``Shard(0)`` over a 1-D mesh of the group; the per-group scalars as ``optim.group<i>.<key>``
  (AdamW's ``step``) — see :class:`~quietsync.strategies.substrates.sharded_state.ShardedState`.

Why a DTensor of the flat buffer for ZeRO-1 rather than gathered per-parameter tensors: each worker keeps
writing only its ``1/n`` (no gather of the optimizer state onto one worker, so a checkpoint needs no more
memory than training does), and the layout is still independent of the world size — the flat order of the
parameters is fixed by the model and its parameter groups, and torch's ``Shard(0)`` chunks of a length-``N``
tensor over ``n`` workers (``ceil(N/n)`` each, the last ones shorter or empty) are exactly ZeRO-1's padded
shards with the padding cut off. ``torch.distributed.checkpoint`` then reads, on any world size, the pieces
each new shard overlaps. Per-parameter shapes are recovered by cutting the flat tensor at the parameter
offsets (the tests' oracle does exactly that).

Values are tensors only (no pickled objects), so loading never runs code. A checkpoint is logical only at a
step boundary: a worker holding an open round (micro-batches not yet committed) refuses to write one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

SavedTensors = Mapping[str, tuple[torch.Size, torch.dtype]]
"""What a logical checkpoint holds: ``{key: (global shape, dtype)}``, read from its metadata."""

Reader = Callable[[dict[str, torch.Tensor]], None]
"""``read(targets)`` fills every tensor of ``targets`` in place from the checkpoint (a collective call)."""


class ReshardError(ValueError):
    """The state cannot be written or read in world-size-independent form (the message says why)."""


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.<name>``: the module's state-dict tensors (detached, not copied)."""
    return {f"model.{k}": v.detach() for k, v in module.state_dict().items()}


def module_targets(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like :func:`module_state`, to read a checkpoint into."""
    return {f"model.{k}": torch.empty_like(v) for k, v in module.state_dict().items()}


def load_module(module: torch.nn.Module, filled: Mapping[str, torch.Tensor]) -> None:
    """Copy the ``model.*`` entries of ``filled`` into ``module`` (strict: every key must be there)."""
    module.load_state_dict({k[len("model."):]: v for k, v in filled.items() if k.startswith("model.")})


def base_lrs_state(base_lrs: list[float]) -> dict[str, torch.Tensor]:
    return {"optim.base_lrs": torch.tensor(base_lrs, dtype=torch.float64)}


def base_lrs_target(base_lrs: list[float], saved: SavedTensors) -> dict[str, torch.Tensor]:
    shape = saved.get("optim.base_lrs", (None, None))[0]
    if shape is None or tuple(shape) != (len(base_lrs),):
        raise ReshardError(
            f"the checkpoint's optimizer has {None if shape is None else tuple(shape)} parameter "
            f"group learning rates, this one {len(base_lrs)} groups"
        )
    return {"optim.base_lrs": torch.zeros(len(base_lrs), dtype=torch.float64)}


def parameter_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` (a tied parameter under its first name)."""
    return {id(p): name for name, p in module.named_parameters()}


def _indexed_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def optimizer_state(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, torch.Tensor]:
    """``optim.<parameter name>.<key>``: a replicated optimizer's per-parameter tensor state."""
    out = {}
    for p in _indexed_params(optimizer):
        if id(p) not in names:
            raise ReshardError("the optimizer holds a tensor that is not a named parameter of the model")
        for key, value in optimizer.state.get(p, {}).items():
            if not isinstance(value, torch.Tensor):
                raise ReshardError(f"optimizer state {key!r} is a {type(value).__name__}, not a tensor")
            out[f"optim.{names[id(p)]}.{key}"] = value.detach()
    return out


def optimizer_targets(optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                      saved: SavedTensors) -> dict[str, torch.Tensor]:
    """Empty tensors for the saved per-parameter state of ``optimizer``'s parameters (by name)."""
    out = {}
    for p in _indexed_params(optimizer):
        prefix = f"optim.{names[id(p)]}."
        for key, (shape, dtype) in saved.items():
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                out[key] = torch.empty(shape, dtype=dtype)
    return out


def load_optimizer(optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                   filled: Mapping[str, torch.Tensor]) -> None:
    """Set ``optimizer``'s per-parameter state from :func:`optimizer_targets` filled by a checkpoint.

    Goes through ``optimizer.load_state_dict`` (torch casts the state to each parameter's device and dtype).
    """
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, p in enumerate(_indexed_params(optimizer)):
        prefix = f"optim.{names[id(p)]}."
        entry = {
            k[len(prefix) :]: v
            for k, v in filled.items()
            if k.startswith(prefix) and "." not in k[len(prefix) :]
        }
        if entry:
            state[i] = entry
    # the logical form saves no group options: the optimizer keeps its own (base lrs are restored apart)
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


def flat_tensor(local: torch.Tensor, numel: int, mesh: Any) -> torch.Tensor:
    """This worker's piece ``local`` of a length-``numel`` logical tensor as a DTensor ``Shard(0)`` over
    ``mesh`` (the plain tensor when ``mesh`` is None: a one-worker group holds all of it)."""
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Shard

    # global shape given: the last chunks are shorter or empty, which from_local would not infer
    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,)
    )


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (the tensor itself otherwise)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def open_round_problem(name: str, position: Mapping[str, int]) -> str | None:
    """Why the worker at ``position`` cannot write a logical checkpoint (None at a step boundary)."""
    open_counters = {k: v for k, v in position.items() if k != "steps" and v}
    if open_counters:
        counters = ", ".join(f"{k}={v}" for k, v in open_counters.items())
        return (f"strategy {name} holds an open round ({counters}); a checkpoint that reshards is written at "
                "a committed step only (right after step() returned True)")
    return None
