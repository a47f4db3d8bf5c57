"""Shared driver of the localsgd / diloco tests: train a strategy on the common tiny model and record, per step,
the metrics extras, the bytes per group and the parameters (so the parent can compare replicas)."""

from __future__ import annotations

import io
from typing import Any

import torch

import quietsync
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model

ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
SGD = {"lr": 0.05, "weight_decay": 0.1}


def _build(strategy: str, config: dict, optimizer: str) -> quietsync.Strategy:
    model = tiny_model()
    cls, kwargs = (torch.optim.AdamW, ADAMW) if optimizer == "adamw" else (torch.optim.SGD, SGD)
    return quietsync.make_strategy(strategy, model, cls, param_groups=param_groups(model), config=config, **kwargs)


def train(rank: int, strategy: str, config: dict, optimizer: str = "adamw", steps: int = 6,
          resume_at: int | None = None) -> dict[str, Any]:
    """``steps`` committed steps of ``accumulation`` micro-batches; optionally checkpoint after step
    ``resume_at`` and continue in a fresh strategy loaded from it."""
    s = _build(strategy, config, optimizer)
    accumulation = config.get("accumulation", 1)
    trace = []
    for t in range(steps):
        for a in range(accumulation):
            s.forward_backward(micro_batch(t, rank, a), loss_fn)
            assert s.step() == (a == accumulation - 1)
        m = s.last_step_metrics()
        trace.append({"extra": m.extra, "bytes": m.bytes_by_group, "params": flat_params(s.module)})
        if resume_at == t + 1:
            buf = io.BytesIO()
            torch.save(s.state_dict(), buf)
            s.close()
            s = _build(strategy, config, optimizer)
            buf.seek(0)
            s.load_state_dict(torch.load(buf, weights_only=False))
    with s.committed_params():
        committed = flat_params(s.module)
    out = {"params": flat_params(s.module), "committed": committed, "trace": trace, "memory": s.memory_report(),
           "steps": s.steps}
    s.close()
    return out


def train_many(rank: int, world: int, jobs: list[dict]) -> list[dict[str, Any]]:
    """Several trainings in one set of processes (process start-up is the expensive part on 2 cores)."""
    return [train(rank, **job) for job in jobs]
