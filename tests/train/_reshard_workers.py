"""Workers of the resharding tests (module level, so spawned processes can import them): a tiny two-group model
trained a few steps by ddp or zero1, its logical checkpoint written or read, and what each worker holds."""

from __future__ import annotations

from typing import Any

import torch

STEPS = 3
"""Steps before the checkpoint."""
MORE = 2
"""Steps after it."""
MBS = 2
"""Windows per micro-batch of the data stream."""


def model(seed: int) -> torch.nn.Module:
    """66 parameters in two groups: ZeRO-1's shards over 2 or 4 workers cut through parameters and groups."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def groups(m: torch.nn.Module) -> list[dict[str, Any]]:
    decay = [p for n, p in m.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in m.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def schedule(step: int) -> float:
    return 1.0 / (1.0 + step)


LR = 0.05


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3, 5, generator=g), torch.randn(3, 3, generator=g)


def loss_fn(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = b
    return ((m(x) - y) ** 2).mean()


def adamw_from(params: dict[str, torch.Tensor], state: dict[str, dict[str, torch.Tensor]],
               new_world: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """The oracle of a resharded continuation: one process running plain ``torch.optim.AdamW`` from ``params``
    and per-parameter ``state`` (by name) for MORE steps on the new world's global batch; returns each step's
    per-worker losses and the parameters after."""
    m = model(0)
    m.load_state_dict(params)
    opt = torch.optim.AdamW(groups(m), lr=LR, betas=(0.9, 0.95))
    for p_name, p in m.named_parameters():
        opt.state[p] = {k: v.clone() for k, v in state[p_name].items()}
    losses = []
    for s in range(STEPS, STEPS + MORE):
        for g in opt.param_groups:
            g["lr"] = LR * schedule(s)
        opt.zero_grad()
        per_rank = [loss_fn(m, batch(s, r)) for r in range(new_world)]
        losses.append([float(x.detach()) for x in per_rank])
        (sum(per_rank) / new_world).backward()
        opt.step()
    return losses, {k: v.detach() for k, v in m.named_parameters()}


def _strategy(name: str, seed: int):
    from quietsync.strategies import make_strategy

    m = model(seed)
    return make_strategy(name, m, torch.optim.AdamW, param_groups=groups(m), lr=LR, lr_schedule=schedule,
                         betas=(0.9, 0.95))


def _stream(rank: int, world: int):
    from quietsync.data.sequences import ShardedSequences

    return ShardedSequences(torch.arange(4000), 8, MBS, rank, world, seed=3)


def _held(strategy) -> dict[str, Any]:
    """What this worker holds: parameters, optimizer state (ddp: by parameter; zero1: its shard's bounds, master
    and per-element state in flat order), steps, base lrs, micro-batch count."""
    out: dict[str, Any] = {"params": {k: v.detach().clone() for k, v in strategy.module.named_parameters()},
                           "steps": strategy.steps, "micro_batches": strategy.micro_batches}
    if strategy.name == "ddp":
        names = {id(p): n for n, p in strategy.module.named_parameters()}
        out["optim"] = {names[id(p)]: {k: v.clone() for k, v in st.items()}
                        for p, st in strategy.optimizer.state.items()}
        out["base_lrs"] = list(strategy.round.lr.base_lrs)
    else:
        shard = strategy.sharded.shard
        views = [g["params"][0] for g in strategy.optimizer.param_groups]
        states = [strategy.optimizer.state[v] for v in views]
        out["bounds"] = (shard.lo, shard.hi)
        out["master"] = shard.master.clone()
        out["exp_avg"] = torch.cat([st["exp_avg"] for st in states])
        out["exp_avg_sq"] = torch.cat([st["exp_avg_sq"] for st in states])
        out["step"] = [float(st["step"]) for st in states]
        out["base_lrs"] = list(strategy.sharded.lr.base_lrs)
    return out


def _train(strategy, stream, first: int, count: int, rank: int) -> list[float]:
    losses = []
    for s in range(first, first + count):
        next(stream)
        losses.append(float(strategy.forward_backward(batch(s, rank), loss_fn)))
        assert strategy.step()
    return losses


def train_and_save(rank: int, world: int, name: str, folder: str) -> dict[str, Any]:
    """STEPS steps, the logical checkpoint, then MORE steps (the uninterrupted continuation)."""
    from quietsync.train.logical_checkpoint import save_logical

    strategy, stream = _strategy(name, seed=0), _stream(rank, world)
    _train(strategy, stream, 0, STEPS, rank)
    save_logical(folder, strategy, stream, tokens_total=100 + rank)
    saved = _held(strategy)
    saved["position"] = stream.logical_position()
    losses = _train(strategy, stream, STEPS, MORE, rank)
    saved["continued"] = {"params": _held(strategy)["params"], "losses": losses}
    strategy.close()
    return saved


def load_and_continue(rank: int, world: int, name: str, folder: str) -> dict[str, Any]:
    """A fresh strategy (other initial weights) loads the logical checkpoint, then trains MORE steps."""
    from quietsync.train.logical_checkpoint import load_logical

    strategy, stream = _strategy(name, seed=1), _stream(rank, world)
    tokens = load_logical(folder, strategy, stream)
    loaded = _held(strategy)
    loaded["tokens"] = tokens
    loaded["position"] = stream.logical_position()
    losses = _train(strategy, stream, STEPS, MORE, rank)
    loaded["continued"] = {"params": _held(strategy)["params"], "losses": losses}
    strategy.close()
    return loaded


def refuse(rank: int, world: int, name: str, folder: str, action: str, config: dict[str, Any] | None = None) -> str:
    """``save`` or ``load`` a logical checkpoint with a strategy that cannot reshard it: return the error."""
    from quietsync.strategies import make_strategy
    from quietsync.strategies.checkpoint.logical import ReshardError
    from quietsync.train.logical_checkpoint import load_logical, save_logical

    m = model(0)
    strategy = make_strategy(name, m, torch.optim.AdamW, lr=LR, config=config)
    try:
        if action == "save":  # refused before anything is fed or written
            save_logical(folder, strategy, _stream(rank, world), 0)
        else:
            load_logical(folder, strategy, _stream(rank, world))
    except ReshardError as e:
        return str(e)
    finally:
        strategy.close()
    raise AssertionError("no error")
