"""DPU: ≡ the paper's delayed recurrence (with and without non-delayed warm-up steps), overlaps under a
slow link, resumes exactly, rejects bad knobs."""

from __future__ import annotations

import pytest
import torch

import quietsync
from quietsync.link import LinkModel
from quietsync.topology import Topology
from quietsync.transport import Transport
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, tiny_model
from tests.strategies.helpers.overlap_common import batch, det_count, flat, make, reference, run_many, train

RTOL, ATOL = 1e-5, 1e-6
STEPS = 6


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("world", "runs"), [
    (2, [("adamw", 0), ("sgd", 0), ("adamw", 2)]),
    (4, [("adamw", 0), ("sgd", 0), ("sgd", 3)]),
])
def test_dpu_equals_reference_recurrence(world, runs):
    results = run_ranks(run_many, world, "dpu", [(opt, {"sync_warmup_steps": w}) for opt, w in runs], STEPS)
    for i, (opt, warmup) in enumerate(runs):
        expected = reference("dpu", world, opt, STEPS, warmup=warmup)
        # the delay matters: the same data without delay ends elsewhere, far beyond tolerance
        sync = reference("sync", world, opt, STEPS)
        assert (flat(expected.committed[-1]) - flat(sync.committed[-1])).abs().max() > 1e2 * ATOL
        for rank, out in enumerate(results):
            assert out[i]["steps"] == STEPS
            torch.testing.assert_close(out[i]["theta"], flat(expected.committed[-1]), rtol=RTOL, atol=ATOL,
                                       msg=f"{opt}, warm-up {warmup}, rank {rank}")


def test_world_of_one_every_step_and_warmup_is_not_delayed():
    warmup = 2
    expected = reference("dpu", 1, "adamw", 5, warmup=warmup)
    sync = reference("sync", 1, "adamw", 5)
    strategy = make("dpu", "adamw", {"deterministic_accumulation": 1, "sync_warmup_steps": warmup})
    index, commits = 0, 0
    while strategy.steps < 5:
        strategy.backward(loss_fn(strategy.model, batch(0, index)))
        index += 1
        committed = strategy.step()
        if committed:
            commits += 1
            theta = flat_params(strategy.module)
            torch.testing.assert_close(theta, flat(expected.committed[commits - 1]), rtol=RTOL, atol=ATOL)
            if commits <= warmup + 1:  # warm-up steps and the pipeline's first step are not delayed
                torch.testing.assert_close(theta, flat(sync.committed[commits - 1]), rtol=RTOL, atol=ATOL)
            with strategy.committed_params() as model:  # DPU's model always holds θ: nothing to gather
                assert model is strategy.model
                torch.testing.assert_close(flat_params(model), theta, rtol=0, atol=0)
            assert strategy.phase == ("warmup" if commits < warmup else "fill" if commits == warmup else "overlap")
    # warm-up: 1 micro-batch per step; then the pipeline fill holds one more before the first delayed commit
    assert index == warmup + 1 + (5 - warmup)
    strategy.close()


def _overlap(rank: int, world: int) -> dict:
    # a sync of 100 ms against 2-ms micro-batches: a loaded machine's slower micro-batches still fit inside it whole
    # (at 30 ms a suite run under load once fitted 2 of 3 inside)
    transport = Transport(Topology.from_env(), links={"inter": LinkModel(bandwidth=1e9, latency=0.1)})
    strategy = make("dpu", "adamw", {"sync_warmup_steps": 1}, transport=transport)
    train(strategy, rank, 5, base_s=0.002)
    rec = transport.recorder
    out = {"history": list(strategy.overlap.stage_history),
           "idle": [s.name for s in rec.spans("idle")],
           "inside": sum(1 for c in rec.spans("compute") if c.name == "micro_batch"
                         for m in rec.spans("comm") if m.t0 <= c.t0 and c.t1 <= m.t1)}
    strategy.close()
    transport.close()
    return out


@pytest.mark.timeout(120)
def test_dpu_overlaps_after_warmup_under_a_slow_link():
    for rank, out in enumerate(run_ranks(_overlap, 2)):
        overlapped = [c[rank] for c in out["history"][2:]]  # after the warm-up step and the pipeline fill
        assert sum(overlapped) > 2 * len(overlapped), overlapped
        assert out["inside"] >= len(overlapped)
        assert out["idle"] == ["sync_update"]  # only the blocking warm-up step waited


def _resume(rank: int, world: int, opt: str, warmup: int) -> tuple[torch.Tensor, torch.Tensor]:
    config = {"deterministic_accumulation": det_count(rank), "sync_warmup_steps": warmup}
    straight = make("dpu", opt, config)
    train(straight, rank, STEPS)
    expected = flat_params(straight.module)
    straight.close()
    first = make("dpu", opt, config)
    stop = train(first, rank, STEPS, stop_after=5 * det_count(rank) - 1)
    state = first.state_dict()
    first.close()
    resumed = make("dpu", opt, config)
    resumed.load_state_dict(state)
    train(resumed, rank, STEPS, start_index=stop)
    got = flat_params(resumed.module)
    resumed.close()
    return expected, got


@pytest.mark.timeout(120)
def test_resume_from_state_dict_continues_exactly():
    for expected, got in run_ranks(_resume, 2, "sgd", 2):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("config", "message"), [
    ({"sync_warmup_steps": -1}, "sync_warmup_steps must be an integer >= 0"),
    ({"sync_warmup_steps": 1.5}, "sync_warmup_steps must be an integer >= 0"),
    ({"min_accumulation": 4, "max_accumulation": 2}, "max_accumulation must be >= min_accumulation"),
])
def test_bad_knobs_fail_clearly(config, message):
    with pytest.raises(ValueError, match=message):
        quietsync.make_strategy("dpu", tiny_model(), config=config)


def test_cli_flag_for_warmup_does_not_clash_with_the_lr_warmup():
    from quietsync.train.args import parse_train_args

    cfg, strategy_config, _ = parse_train_args(["--strategy", "dpu", "--sync-warmup-steps", "40",
                                                "--warmup-steps", "5"])
    assert strategy_config.sync_warmup_steps == 40 and cfg.warmup_steps == 5
