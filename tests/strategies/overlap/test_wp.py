"""WP (ACCO-wp): ≡ the paper's weight-prediction recurrence, the prediction never commits optimizer state,
evaluation sees θ (not the prediction), resume is exact."""

from __future__ import annotations

import pytest
import torch

import quietsync
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, tiny_model
from tests.strategies.helpers.overlap_common import batch, det_count, flat, make, reference, run_many, train

RTOL, ATOL = 1e-5, 1e-6
STEPS = 6


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("world", "runs"), [
    (2, [("adamw", 0), ("sgd", 0), ("adamw", 2)]),
    (4, [("adamw", 0), ("sgd", 0)]),
])
def test_wp_equals_reference_recurrence(world, runs):
    # run_deterministic reads θ through committed_params(): with WP that all-gathers the master shards
    results = run_ranks(run_many, world, "wp", [(opt, {"sync_warmup_steps": w}) for opt, w in runs], STEPS)
    for i, (opt, warmup) in enumerate(runs):
        expected = reference("wp", world, opt, STEPS, warmup=warmup)
        dpu = reference("dpu", world, opt, STEPS, warmup=warmup)
        assert (flat(expected.committed[-1]) - flat(dpu.committed[-1])).abs().max() > 1e2 * ATOL  # prediction matters
        for rank, out in enumerate(results):
            torch.testing.assert_close(out[i]["theta"], flat(expected.committed[-1]), rtol=RTOL, atol=ATOL,
                                       msg=f"{opt}, warm-up {warmup}, rank {rank}")


def test_world_of_one_prediction_in_the_model_committed_params_gives_theta():
    expected = reference("wp", 1, "adamw", 5)
    strategy = make("wp", "adamw", {"deterministic_accumulation": 1})
    index, commits = 0, 0
    while strategy.steps < 5:
        strategy.backward(loss_fn(strategy.model, batch(0, index)))
        index += 1
        if not strategy.step():
            continue
        commits += 1
        prediction = flat_params(strategy.module)
        with strategy.committed_params() as model:
            theta = flat_params(model)
        torch.testing.assert_close(theta, flat(expected.committed[commits - 1]), rtol=RTOL, atol=ATOL)
        assert not torch.equal(theta, prediction)
        assert torch.equal(flat_params(strategy.module), prediction)  # restored after the context
        # the gradients of the next round are computed at the prediction, the step counter is the commits'
        if commits + 1 < len(expected.compute_params):
            torch.testing.assert_close(prediction, flat(expected.compute_params[commits + 1]), rtol=RTOL,
                                       atol=ATOL)
        strategy.overlap._drain()
        assert {int(s["step"]) for s in strategy.optimizer.state.values() if s} == {commits + 1}
    strategy.close()


def _resume(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    config = {"deterministic_accumulation": det_count(rank)}
    straight = make("wp", "adamw", config)
    train(straight, rank, STEPS)
    with straight.committed_params() as model:
        expected = flat_params(model)
    straight.close()
    first = make("wp", "adamw", config)
    stop = train(first, rank, STEPS, stop_after=4 * det_count(rank) - 1)
    state = first.state_dict()
    first.close()
    resumed = make("wp", "adamw", config)
    resumed.load_state_dict(state)
    train(resumed, rank, STEPS, start_index=stop)
    with resumed.committed_params() as model:
        got = flat_params(model)
    resumed.close()
    return expected, got


@pytest.mark.timeout(120)
def test_resume_from_state_dict_continues_exactly():
    for expected, got in run_ranks(_resume, 2):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_bad_knobs_fail_clearly():
    with pytest.raises(ValueError, match="sync_warmup_steps must be an integer >= 0"):
        quietsync.make_strategy("wp", tiny_model(), config={"sync_warmup_steps": -3})
    with pytest.raises(ValueError, match="deterministic_accumulation must be an integer >= 1"):
        quietsync.make_strategy("wp", tiny_model(), config={"deterministic_accumulation": -1})
