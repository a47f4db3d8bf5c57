"""The new-strategy walkthrough (``examples/custom_strategy.py``, ``docs/contract.md``) is a working strategy: on
3 workers it follows signSGD with majority vote as a plain-torch reference writes it, sends 1 byte per parameter,
and refuses a bad knob at construction."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.strategies.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_strategy.py"
STEPS, ACCUMULATION, LR = 3, 2, 0.05


def _load_example() -> None:
    """Import the example (it registers ``signsgd``), once per process."""
    if "custom_strategy" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location("custom_strategy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_strategy"] = module
    spec.loader.exec_module(module)


def schedule(step: int) -> float:
    return 1.0 / (1.0 + step)


def _run(rank: int, world: int, min_votes: float) -> dict:
    import quietsync

    _load_example()
    model = tiny_model()
    strategy = quietsync.make_strategy("signsgd", model, torch.optim.SGD, param_groups=param_groups(model, 0.0),
                                       config={"accumulation": ACCUMULATION, "min_votes": min_votes},
                                       lr_schedule=schedule, lr=LR)
    index, out, sent = 0, [], []
    while strategy.steps < STEPS:
        strategy.forward_backward(micro_batch(strategy.steps, rank, index % ACCUMULATION), loss_fn)
        index += 1
        if strategy.step():
            out.append(flat_params(strategy.model))
            sent.append(strategy.last_step_metrics().bytes_by_group["world"]["sent"])
    strategy.close()
    return {"params": out, "sent": sent}


def reference(world: int, min_votes: float) -> list[torch.Tensor]:
    """signSGD-MV from its definition: each worker's mean gradient over its micro-batches, sign, summed over the
    workers; θ ← θ − lr·schedule(t)·sign(votes) where |votes| > min_votes·workers, else no move."""
    model = tiny_model()
    out = []
    for step in range(STEPS):
        votes = torch.zeros(sum(p.numel() for p in model.parameters()))
        for rank in range(world):
            model.zero_grad()
            loss = sum(loss_fn(model, micro_batch(step, rank, a)) for a in range(ACCUMULATION)) / ACCUMULATION
            loss.backward()
            votes += torch.cat([p.grad.reshape(-1) for p in model.parameters()]).sign()
        move = torch.where(votes.abs() > min_votes * world, votes.sign(), torch.zeros_like(votes))
        with torch.no_grad():
            at = 0
            for p in model.parameters():
                p -= LR * schedule(step) * move[at : at + p.numel()].view_as(p)
                at += p.numel()
        out.append(flat_params(model))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("min_votes", [0.0, 0.5])
def test_the_example_strategy_is_signsgd_with_majority_vote(min_votes):
    results = run_ranks(_run, 3, min_votes)
    expected = reference(3, min_votes)
    for r in results:
        for got, want in zip(r["params"], expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        n = sum(p.numel() for p in tiny_model().parameters())
        assert r["sent"] == [2 * (3 - 1) * n // 3] * STEPS  # ring all-reduce of n int8 votes
    # the rule matters: with unanimity required, fewer coordinates move than with a simple majority
    loose, strict = reference(3, 0.0)[-1], reference(3, 0.5)[-1]
    assert not torch.equal(loose, strict)


def _refuse(rank: int, world: int) -> str:
    import quietsync

    _load_example()  # in a worker process: the test process's registry keeps the eleven strategies only
    try:
        quietsync.make_strategy("signsgd", tiny_model(), torch.optim.SGD, config={"min_votes": 1.5}, lr=LR)
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.timeout(60)
def test_a_bad_knob_is_refused_at_construction():
    assert "min_votes" in run_ranks(_refuse, 1)[0]
