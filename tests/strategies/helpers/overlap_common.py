"""Helpers of the ACCO / DPU / WP tests: a distributed run in deterministic or adaptive mode, and the
matching single-process reference run (``reference_recurrences``) on the same micro-batches."""

from __future__ import annotations

import time
from typing import Any

import torch

import quietsync
from tests.strategies.helpers import reference_recurrences as ref
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model

WEIGHT_DECAY = 0.1
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": WEIGHT_DECAY}
SGD = {"lr": 5e-2, "momentum": 0.9, "weight_decay": WEIGHT_DECAY}


def lr_schedule(step: int) -> float:
    """A schedule that changes every step, so using the wrong step index shows."""
    return 1.0 / (1.0 + 0.25 * step)


def det_count(rank: int) -> int:
    """Deterministic micro-batches per stage: different per worker, to exercise the count weighting."""
    return 1 + rank % 2


def batch(rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s ``index``-th micro-batch (a running index over the whole run)."""
    return micro_batch(0, rank, index)


def make(name: str, opt: str, config: dict[str, Any], transport=None, **strategy_kwargs: Any
         ) -> quietsync.strategies.Strategy:
    """``strategy_kwargs``: further ``make_strategy`` arguments (``max_grad_norm``, ``precision``)."""
    model = tiny_model()
    factory, kwargs = (torch.optim.AdamW, ADAMW) if opt == "adamw" else (torch.optim.SGD, SGD)
    return quietsync.make_strategy(name, model, factory, param_groups=param_groups(model, WEIGHT_DECAY),
                                   config=config, lr_schedule=lr_schedule, transport=transport,
                                   **strategy_kwargs, **kwargs)


def train(strategy, rank: int, steps: int, start_index: int = 0, sleep_factor: float = 1.0,
          stop_after: int | None = None, base_s: float = 0.0) -> int:
    """Feed micro-batches until ``steps`` committed steps (or ``stop_after`` micro-batches); returns the next
    micro-batch index.

    ``base_s`` adds that many seconds of simulated compute to every micro-batch (a sleep, so timings hold on a
    loaded machine); ``sleep_factor`` > 1 makes this worker slower as in the paper (App. C): it sleeps
    (factor − 1) × the micro-batch's measured compute time. Both sleeps happen before ``backward`` returns, so
    the strategy accounts them as compute, like a slower device.
    """
    index = start_index
    while strategy.steps < steps:
        if stop_after is not None and index >= stop_after:
            break
        t0 = time.perf_counter()
        loss = loss_fn(strategy.model, batch(rank, index))
        if base_s:
            time.sleep(base_s)
        if sleep_factor > 1:
            time.sleep((sleep_factor - 1) * (time.perf_counter() - t0))
        strategy.backward(loss)
        index += 1
        strategy.step()
    return index


def run_deterministic(rank: int, world: int, name: str, opt: str, steps: int, extra: dict | None = None,
                      strategy_kwargs: dict | None = None) -> dict[str, Any]:
    """Worker body: a deterministic-mode run; returns θ after ``steps`` committed steps (and the extras of every
    committed step under ``extras``)."""
    strategy = make(name, opt, {"deterministic_accumulation": det_count(rank), **(extra or {})},
                    **(strategy_kwargs or {}))
    extras = []
    strategy.step = _recording(strategy, extras)  # type: ignore[method-assign]
    train(strategy, rank, steps)
    with strategy.committed_params() as model:
        theta = flat_params(model)
    out = {"theta": theta, "history": list(strategy.overlap.stage_history), "steps": strategy.steps,
           "micro_batches": strategy.micro_batches, "extras": extras}
    strategy.close()
    return out


def _recording(strategy, extras: list):
    """``strategy.step`` that also keeps the extras of every committed step."""
    step = strategy.step

    def recorded() -> bool:
        committed = step()
        if committed:
            extras.append(dict(strategy.last_step_metrics().extra))
        return committed

    return recorded


def run_many(rank: int, world: int, name: str, runs: list[tuple[str, dict]], steps: int) -> list[dict[str, Any]]:
    """Worker body: several deterministic runs ``(optimizer, extra config)`` in one launch of the workers."""
    return [run_deterministic(rank, world, name, opt, steps, extra) for opt, extra in runs]


def reference(kind: str, world: int, opt: str, steps: int, counts=None, wrap=None, **kw) -> ref.Trace:
    """The single-process reference of ``kind`` (acco, dpu, wp, sync) on the same data and optimizer
    (``wrap(optimizer)``, when given, replaces the pure optimizer: e.g. a clipping one)."""
    model = tiny_model()
    names = [n for n, _ in model.named_parameters()]
    params0 = [p.detach().clone() for p in model.parameters()]
    wd = [WEIGHT_DECAY if n.endswith("weight") else 0.0 for n in names]
    if opt == "adamw":
        optimizer = ref.AdamWRef(betas=ADAMW["betas"], weight_decay=wd)
        base_lr = ADAMW["lr"]
    else:
        optimizer = ref.SGDRef(momentum=SGD["momentum"], weight_decay=wd)
        base_lr = SGD["lr"]

    def functional_loss(params, b):
        return loss_fn(lambda x: torch.func.functional_call(model, dict(zip(names, params)), (x,)), b)

    def stream(rank):
        k = 0
        while True:
            yield batch(rank, k)
            k += 1

    if wrap is not None:
        optimizer = wrap(optimizer)
    batches = [stream(r) for r in range(world)]
    counts = counts if counts is not None else det_count
    lr = lambda s: base_lr * lr_schedule(s)  # noqa: E731
    if kind == "acco":
        return ref.acco_reference(params0, functional_loss, batches, optimizer, steps, counts, lr)
    if kind == "sync":
        return ref.synchronous_reference(params0, functional_loss, batches, optimizer, steps, counts, lr)
    return ref.dpu_reference(params0, functional_loss, batches, optimizer, steps, counts, lr,
                             predict=kind == "wp", **kw)


def flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in params])
