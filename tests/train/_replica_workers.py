"""Workers of the per-replica resharding tests (module level, so spawned processes can import them): a tiny
two-group model trained by localsgd, diloco, demo, flexdemo, acco, dpu or wp, its logical checkpoint written or
read, and what each worker then holds, by name (not by layout), for the tests' oracle."""

from __future__ import annotations

from typing import Any

import torch

from . import _reshard_workers as base

STEPS = 4
"""Steps before the checkpoint (with sync_every 3: one step of drift since the last sync)."""

CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    # case: (strategy, config, nodes of the saving world: hierarchical diloco and flexdemo are saved on 2 x 2)
    "localsgd": ("localsgd", {"sync_every": 3}, 0),
    "diloco": ("diloco", {"sync_every": 3, "pseudo_grad_replicator": "random", "compression": 0.5}, 0),
    "diloco-sparseloco": ("diloco", {"sync_every": 3, "outer": "sparseloco", "pseudo_grad_dtype": "int4"}, 0),
    "diloco-streaming": ("diloco", {"sync_every": 4, "fragments": 2, "overlap_delay": 1}, 0),
    "diloco-zero1": ("diloco", {"sync_every": 3, "inner": "zero1"}, 2),
    "diloco-ddp": ("diloco", {"sync_every": 3, "inner": "ddp"}, 2),
    "demo": ("demo", {"base": "adamw", "replicator": "dct", "chunk": 4, "topk": 3, "sign": False}, 0),
    "flexdemo": ("flexdemo", {"base": "adamw", "replicator": "random", "compression": 0.5, "sign": False,
                              "params": "replicated"}, 2),
    "acco": ("acco", {"deterministic_accumulation": 1}, 0),
    "dpu": ("dpu", {"deterministic_accumulation": 1, "sync_warmup_steps": 1}, 0),
    "wp": ("wp", {"deterministic_accumulation": 1}, 0),
}


def _strategy(case: str, seed: int):
    from quietsync.strategies import make_strategy

    name, config, _ = CASES[case]
    m = base.model(seed)
    return make_strategy(name, m, torch.optim.AdamW, param_groups=base.groups(m), lr=base.LR,
                         lr_schedule=base.schedule, betas=(0.9, 0.95), config=dict(config))


def _step(strategy, s: int, rank: int) -> float:
    """Feed micro-batches of step ``s`` until a step commits; the mean loss fed."""
    losses, k = [], 0
    while True:
        losses.append(float(strategy.forward_backward(base.batch(1000 * s + k, rank), base.loss_fn)))
        k += 1
        if strategy.step():
            return sum(losses) / len(losses)
        assert k < 8, "no commit within 8 micro-batches"


def _named_optimizer_state(strategy) -> dict[str, dict[str, torch.Tensor]]:
    """A whole-parameter optimizer's state by parameter name (localsgd, diloco local, demo)."""
    names = {id(p): n for n, p in strategy.module.named_parameters()}
    return {names[id(p)]: {k: v.detach().clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
            for p, st in strategy.optimizer.state.items() if id(p) in names}


def held(strategy) -> dict[str, Any]:
    """What this worker holds, by name: its parameters, and per strategy what the policy speaks of."""
    out: dict[str, Any] = {"steps": strategy.steps, "rank": strategy.rank,
                           "params": {k: v.detach().clone() for k, v in strategy.module.named_parameters()}}
    name = strategy.name
    names = {id(p): n for n, p in strategy.module.named_parameters()}
    if name == "localsgd":
        out["synced"] = {names[id(p)]: t.clone() for p, t in zip(strategy.params, strategy.synced)}
        out["optim"] = _named_optimizer_state(strategy)
    elif name == "diloco":
        outer = strategy.outer
        outer.quiesce()
        out["globals"] = [g.clone() for g in outer.globals]
        out["outer_momentum"] = [{k: v.clone() for k, v in o.state.get(g, {}).items() if v is not None}
                                 for o, g in zip(outer.optimizers, outer.globals)]
        # a replicator's, SparseLoCo's or low-bit error feedback
        out["residuals"] = [e.residual.clone() for e in outer.exchanges if e.residual is not None]
        out["pending"] = outer.pending_fragment
        out["replica"] = strategy.replica
        out["flat_params"] = torch.cat([p.detach().reshape(-1).float() for p in strategy.params])
        if strategy.inner is None:
            out["optim"] = _named_optimizer_state(strategy)
        elif strategy.inner.name == "ddp":
            out["optim"] = _named_optimizer_state(strategy.inner)
        else:
            sharded = strategy.inner.sharded
            views = [g["params"][0] for g in sharded.optimizer.param_groups]
            out["bounds"] = (sharded.shard.lo, sharded.shard.hi)
            out["exp_avg"] = torch.cat([sharded.optimizer.state[v]["exp_avg"] for v in views])
            out["master"] = sharded.shard.master.clone()
    elif name == "demo":
        opt = strategy.optimizer
        out["optim"] = _named_optimizer_state(strategy)
        out["decoupled_step"] = opt.decoupled_step
        out["replicator"] = dict(opt.replicator.state_dict())
    elif name == "flexdemo":
        out["replica"] = strategy.replica
        out["decoupled_step"] = strategy.optimizer.decoupled_step
        shards = strategy.shards
        pieces = {p.name: p for p in shards.logical_pieces()}
        out["rows"] = {n: (p.rows, tuple(p.shape)) for n, p in pieces.items()}
        out["delta"] = {n: _spatial_delta(strategy, p) for n, p in pieces.items()}
        out["exp_avg"] = {n: strategy.optimizer.state[p.local]["exp_avg"][:p.rows].clone()
                          for n, p in pieces.items() if p.local in strategy.optimizer.state}
    else:  # acco, dpu, wp
        o = strategy.overlap
        o._drain()
        numel = o.sharded.flat.numel
        out["P"] = o.sharded.flat.data[:numel].clone()
        out["B"] = o.comm_buf[:numel].clone()
        out["bounds"] = (o.sharded.shard.lo, min(o.sharded.shard.hi, numel))
        out["master"] = o.sharded.shard.master.clone()
        views = [g["params"][0] for g in o.sharded.optimizer.param_groups]
        out["exp_avg"] = torch.cat([o.sharded.optimizer.state[v]["exp_avg"] for v in views])
        out["exp_avg_sq"] = torch.cat([o.sharded.optimizer.state[v]["exp_avg_sq"] for v in views])
        out["opt_step"] = [float(o.sharded.optimizer.state[v]["step"]) for v in views]
        out["counters"] = (o.hand_overs, o._master_step, o._snapshot_step, o.holds_committed)
        out["job"] = None if o.job is None else dict(o.job.result)
        if name == "acco":
            out["tilde_sum"] = strategy.tilde_sum.clone()
            out["tilde_count"] = strategy._tilde_count
            out["stage"] = strategy.stage
    return out


def _spatial_delta(strategy, piece) -> torch.Tensor:
    from quietsync.strategies.checkpoint.logical_shards import _momentum_to_spatial

    st = strategy.optimizer.state.get(piece.local, {})
    if "delta" not in st:
        return torch.zeros(0)
    return _momentum_to_spatial(strategy.optimizer, st["delta"], piece.local.shape)[:piece.rows].clone()


def train_and_save(rank: int, world: int, case: str, folder: str, more: int) -> dict[str, Any]:
    """STEPS steps, the logical checkpoint, then ``more`` steps (the uninterrupted continuation)."""
    from quietsync.train.logical_checkpoint import save_logical

    strategy, stream = _strategy(case, seed=0), base._stream(rank, world)
    for s in range(STEPS):
        _step(strategy, s, rank)
    save_logical(folder, strategy, stream, tokens_total=100 + rank)
    saved = held(strategy)
    saved["continued"] = _continue(strategy, rank, more)
    strategy.close()
    return saved


def load_and_continue(rank: int, world: int, case: str, folder: str, more: int) -> dict[str, Any]:
    """A fresh strategy (other initial weights) loads the logical checkpoint, then trains ``more`` steps."""
    from quietsync.train.logical_checkpoint import load_logical

    strategy, stream = _strategy(case, seed=1), base._stream(rank, world)
    load_logical(folder, strategy, stream)
    loaded = held(strategy)
    loaded["continued"] = _continue(strategy, rank, more)
    strategy.close()
    return loaded


def _continue(strategy, rank: int, more: int) -> dict[str, Any]:
    """``more`` steps after the checkpoint: the losses, the parameters after the first, what is held at the end."""
    losses, first = [], None
    for s in range(STEPS, STEPS + more):
        losses.append(_step(strategy, s, rank))
        if first is None:
            first = {k: v.detach().clone() for k, v in strategy.module.named_parameters()}
    return {"losses": losses, "first_params": first, "held": held(strategy)}
