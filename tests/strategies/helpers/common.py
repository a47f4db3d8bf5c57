"""Shared fixtures of strategy tests: a tiny model with awkward sizes and deterministic micro-batches."""

from __future__ import annotations

import torch


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """An MLP whose parameter count (174) is not a multiple of 4, so sharding needs padding."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))


def param_groups(model: torch.nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Weights with weight decay, biases without: two groups, as the trainer builds them."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def micro_batch(step: int, rank: int, index: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``index``-th micro-batch of worker ``rank`` at ``step`` — the same on every process."""
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * rank + index)
    return torch.randn(size, 7, generator=g), torch.randn(size, 5, generator=g)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def reference_run(world: int, accumulation: int, steps: int, optimizer: str = "adamw", **opt_kwargs) -> torch.Tensor:
    """One process, plain torch: each step averages the gradients of all workers' micro-batches."""
    model = tiny_model()
    groups = param_groups(model)
    opt = torch.optim.AdamW(groups, **opt_kwargs) if optimizer == "adamw" else torch.optim.SGD(groups, **opt_kwargs)
    for s in range(steps):
        opt.zero_grad()
        total = sum(loss_fn(model, micro_batch(s, r, a)) for r in range(world) for a in range(accumulation))
        (total / (world * accumulation)).backward()
        opt.step()
    return flat_params(model)
