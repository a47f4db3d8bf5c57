"""Refactors keep numerics: every strategy reproduces, bit for bit, the parameter trajectory recorded
before the strategy-house refactor (see ``golden.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.strategies.helpers.golden import CASES, GOLDEN_DIR, PORTABLE, STEPS, run_case


@pytest.mark.skipif(not PORTABLE, reason="recorded with MKL on x86-64; other processors' kernels round differently")
@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", sorted(CASES))
def test_trajectory_is_bit_identical_to_the_recorded_one(case):
    golden = torch.load(GOLDEN_DIR / f"{case}.pt", weights_only=True)
    assert golden["steps"] == STEPS
    got = run_case(case)
    assert len(got) == len(golden["by_rank"])
    per_step = 2 if CASES[case].get("local_too") else 1
    for rank, (mine, theirs) in enumerate(zip(got, golden["by_rank"])):
        assert len(mine) == len(theirs) == STEPS * per_step
        for k, (a, b) in enumerate(zip(mine, theirs)):
            step = k // per_step + 1
            assert torch.equal(a, b), (
                f"{case}: rank {rank} step {step} differs by {(a - b).abs().max().item():.3e}")


def test_the_golden_check_can_fail():
    # Different cases give different trajectories, so equality above is not vacuous.
    a = torch.load(GOLDEN_DIR / "acco.pt", weights_only=True)["by_rank"][0][-1]
    b = torch.load(GOLDEN_DIR / "dpu.pt", weights_only=True)["by_rank"][0][-1]
    assert not torch.equal(a, b)
