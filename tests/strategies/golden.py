"""Golden trajectories: every strategy's parameters after each committed step, for a fixed seed.

Recorded once on the code *before* the strategy-house refactor (issue 7) and kept in ``golden/``; the test
``test_golden.py`` replays the same runs and demands bit-identical parameters, so a refactor that changes
numerics (an operation reordered, a division moved) fails loudly.

Regenerate only when a numerics change is intended and documented::

    python -m tests.strategies.golden          # rewrites tests/strategies/golden/*.pt
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import quietsync
from tests.strategies.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model

GOLDEN_DIR = Path(__file__).with_name("golden")
STEPS = 4

CASES: dict[str, dict[str, Any]] = {
    # name -> world, nodes, strategy, config, optimizer
    "ddp": {"world": 2, "strategy": "ddp", "config": {"accumulation": 2}},
    "zero1": {"world": 2, "strategy": "zero1", "config": {"accumulation": 2}},
    "acco": {"world": 2, "strategy": "acco", "config": {"deterministic_accumulation": 2}},
    "dpu": {"world": 2, "strategy": "dpu", "config": {"deterministic_accumulation": 1, "sync_warmup_steps": 1}},
    "wp": {"world": 2, "strategy": "wp", "config": {"deterministic_accumulation": 2}},
    "demo": {"world": 2, "strategy": "demo", "config": {"accumulation": 2, "chunk": 4, "compression": 0.25}},
    "demo_random_adamw": {"world": 2, "strategy": "demo",
                          "config": {"replicator": "random", "base": "adamw", "compression": 0.5}},
    "flexdemo": {"world": 4, "nodes": 2, "strategy": "flexdemo",
                 "config": {"chunk": 4, "compression": 0.25, "params": "replicated"}},
}
OPT = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


def lr_schedule(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def trajectory(rank: int, world: int, case: str) -> list[torch.Tensor]:
    """Worker body: the committed parameters after each of ``STEPS`` steps (micro-batches fed one by one)."""
    spec = CASES[case]
    model = tiny_model()
    strategy = quietsync.make_strategy(spec["strategy"], model, torch.optim.AdamW, param_groups=param_groups(model),
                                       config=dict(spec["config"]), lr_schedule=lr_schedule, **OPT)
    out: list[torch.Tensor] = []
    index = 0
    while strategy.steps < STEPS:
        strategy.backward(loss_fn(strategy.model, micro_batch(0, rank, index)))
        index += 1
        if strategy.step():
            with strategy.committed_params() as m:
                out.append(flat_params(m))
    strategy.close()
    return out


def run_case(case: str) -> list[list[torch.Tensor]]:
    from tests.distributed import run_ranks

    spec = CASES[case]
    return run_ranks(trajectory, spec["world"], case, nodes=spec.get("nodes"), timeout=120)


def main() -> None:
    GOLDEN_DIR.mkdir(exist_ok=True)
    for case in CASES:
        result = run_case(case)
        torch.save({"torch": str(torch.__version__), "steps": STEPS, "by_rank": result}, GOLDEN_DIR / f"{case}.pt")
        print(f"{case}: {len(result)} ranks x {len(result[0])} steps")


if __name__ == "__main__":
    main()
