"""Workers of the dim-0-shard resharding tests (module level, so spawned processes can import them): the tiny
two-group model of the ddp/zero1 resharding tests trained a few steps by ``fsdp`` or ``flexdemo``, its logical
checkpoint written or read, and what each worker holds — cut out of the substrate here, not through the code
under test."""

from __future__ import annotations

from typing import Any

import torch

from tests.train._reshard_workers import (
    LR,
    MORE,
    STEPS,
    _stream,
    _train,
    batch,
    groups,
    loss_fn,
    model,
    schedule,
)

NAMES = ["0.weight", "2.weight", "0.bias", "2.bias"]
"""The parameters in the optimizer's order (the groups: weights, then biases)."""


def make(name: str, seed: int, config: dict[str, Any]):
    from quietsync.strategies import make_strategy

    m = model(seed)
    return make_strategy(name, m, torch.optim.AdamW, param_groups=groups(m), lr=LR, lr_schedule=schedule,
                         betas=(0.9, 0.95), config=config)


def _rows(strategy, local: torch.Tensor, whole_rows: int) -> torch.Tensor:
    """The rows of ``local`` that are the parameter's: torch's chunk ``i`` of ``ceil(rows / n)`` rows."""
    n, i = strategy.transport.group_size("shard"), strategy.transport.group_rank("shard")
    chunk = -(-whole_rows // n)
    return local[: max(0, min(chunk, whole_rows - i * chunk))]


def _spatial(strategy, delta: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    from quietsync.wire.replicators import REPLICATORS, convert_momentum

    domain = strategy.optimizer.replicator.momentum_domain
    return delta if domain == "spatial" else convert_momentum(delta, shape, domain, REPLICATORS["full"]())


def held(strategy) -> dict[str, Any]:
    """This worker's node and shard index, its rows of every parameter and optimizer state (a decoupled
    momentum as spatial), the counters."""
    shapes = {n: p.shape for n, p in model(0).named_parameters()}
    opt = strategy.optimizer
    locals_ = [t for g in opt.param_groups for t in g["params"]]
    out: dict[str, Any] = {
        "node": strategy.transport.group_rank("replicate"), "index": strategy.transport.group_rank("shard"),
        "steps": strategy.steps, "base_lrs": list(strategy.round.lr.base_lrs), "params": {}, "state": {},
        "decoupled_step": getattr(opt, "decoupled_step", None),
        "replicator": opt.replicator.state_dict() if hasattr(opt, "replicator") else None,
    }
    for name, local in zip(NAMES, locals_):
        out["params"][name] = _rows(strategy, local.detach(), shapes[name][0]).clone()
        st = {}
        for key, value in opt.state.get(local, {}).items():
            if key == "delta":
                value = _spatial(strategy, value, local.shape)
            st[key] = value.clone() if value.dim() == 0 else _rows(strategy, value.detach(), shapes[name][0]).clone()
        out["state"][name] = st
    return out


def _whole(strategy) -> dict[str, torch.Tensor]:
    with strategy.committed_params() as m:
        return {k: v.detach().clone() for k, v in m.named_parameters()}


def train_and_save(rank: int, world: int, name: str, config: dict[str, Any], folder: str) -> dict[str, Any]:
    """STEPS steps, the logical checkpoint, then MORE steps (the uninterrupted continuation)."""
    from quietsync.train.logical_checkpoint import save_logical

    strategy, stream = make(name, 0, config), _stream(rank, world)
    _train(strategy, stream, 0, STEPS, rank)
    save_logical(folder, strategy, stream, tokens_total=100 + rank)
    saved = held(strategy)
    saved["whole"] = _whole(strategy)
    losses = _train(strategy, stream, STEPS, MORE, rank)
    saved["continued"] = {"params": _whole(strategy), "losses": losses}
    strategy.close()
    return saved


def load_and_continue(rank: int, world: int, name: str, config: dict[str, Any], folder: str) -> dict[str, Any]:
    """A fresh strategy (other initial weights) loads the logical checkpoint, then trains MORE steps."""
    from quietsync.train.logical_checkpoint import load_logical

    strategy, stream = make(name, 1, config), _stream(rank, world)
    tokens = load_logical(folder, strategy, stream)
    loaded = held(strategy)
    loaded["tokens"] = tokens
    loaded["whole"] = _whole(strategy)
    losses = _train(strategy, stream, STEPS, MORE, rank)
    loaded["continued"] = {"params": _whole(strategy), "losses": losses}
    strategy.close()
    return loaded


__all__ = ["MORE", "STEPS", "batch", "groups", "loss_fn", "model", "schedule", "LR"]
