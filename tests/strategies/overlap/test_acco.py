"""ACCO: ≡ the paper's recurrence (deterministic mode), really overlaps under a slow link, weights
heterogeneous workers exactly, never commits the estimate's optimizer state, surfaces worker errors,
resumes exactly, rejects bad knobs."""

from __future__ import annotations

import time

import pytest
import torch

import quietsync
from quietsync.comm_worker import CommWorkerError
from quietsync.link import LinkModel
from quietsync.topology import Topology
from quietsync.transport import Transport
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, tiny_model
from tests.strategies.helpers.overlap_common import (
    batch,
    det_count,
    flat,
    make,
    reference,
    run_many,
    train,
)

RTOL, ATOL = 1e-5, 1e-6
STEPS = 6


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_acco_equals_reference_recurrence(world):
    opts = ["adamw", "sgd"]
    results = run_ranks(run_many, world, "acco", [(opt, {}) for opt in opts], STEPS)
    for i, opt in enumerate(opts):
        expected = reference("acco", world, opt, STEPS)
        # The estimate matters: the same data through a synchronous run ends elsewhere, far beyond tolerance.
        sync = reference("sync", world, opt, STEPS)
        assert (flat(expected.committed[-1]) - flat(sync.committed[-1])).abs().max() > 1e3 * ATOL
        for rank, runs in enumerate(results):
            out = runs[i]
            assert out["steps"] == STEPS
            torch.testing.assert_close(out["theta"], flat(expected.committed[-1]), rtol=RTOL, atol=ATOL,
                                       msg=f"{opt}, rank {rank}")
            # init + (stage 1, stage 2) per committed step but the last stage 2, with every worker's count
            assert out["history"] == [[det_count(r) for r in range(world)]] * (2 * STEPS)


def test_world_of_one_every_step_and_estimate_never_commits_state():
    """Step by step: θ after each commit, θ̃ in the model during stage 2, committed_params() gives θ, and the
    estimate leaves AdamW's moments and step counter untouched (also before the first commit)."""
    expected = reference("acco", 1, "adamw", 4)
    strategy = make("acco", "adamw", {"deterministic_accumulation": det_count(0)})
    index, commits = 0, 0
    while strategy.steps < 4:
        strategy.backward(loss_fn(strategy.model, batch(0, index)))
        index += 1
        committed = strategy.step()
        commits += committed
        if strategy.stage == "stage1":
            # the estimate job of this round is in flight: let it finish, then look at the real state
            strategy.overlap._drain()
            state = [s for s in strategy.optimizer.state.values() if s]
            if commits == 0:
                assert state == []  # even the very first estimate left the optimizer state empty
            else:
                assert {int(s["step"]) for s in state} == {commits}
        if committed:
            torch.testing.assert_close(flat_params(strategy.module), flat(expected.committed[commits - 1]),
                                       rtol=RTOL, atol=ATOL)
            m = strategy.last_step_metrics()
            assert m.step == commits and m.extra["micro_batches_per_worker"] == [2 * det_count(0)]
        elif strategy.stage == "stage2":
            theta_tilde = flat_params(strategy.module)
            with strategy.committed_params() as model:
                theta = flat_params(model)
            if commits:
                torch.testing.assert_close(theta, flat(expected.committed[commits - 1]), rtol=RTOL, atol=ATOL)
            assert not torch.equal(theta, theta_tilde)
            torch.testing.assert_close(flat_params(strategy.module), theta_tilde, rtol=0, atol=0)
    assert strategy.micro_batches == index
    strategy.close()


def _overlap(rank: int, world: int, name: str) -> dict:
    link = LinkModel(bandwidth=1e9, latency=0.004)  # every collective on the path waits 4 ms per message
    transport = Transport(Topology.from_env(), links={"inter": link})
    config = {} if name == "acco" else {"accumulation": 2}
    strategy = make(name, "adamw", config, transport=transport)
    train(strategy, rank, 5, base_s=0.002)
    rec = transport.recorder
    out = {
        "history": list(getattr(getattr(strategy, "overlap", None), "stage_history", [])),
        "compute": [(s.t0, s.t1) for s in rec.spans("compute") if s.name == "micro_batch"],
        "comm": [(s.t0, s.t1, s.name) for s in rec.spans("comm")],
        "idle": [(s.t0, s.t1, s.name) for s in rec.spans("idle")],
        "metrics": strategy.last_step_metrics().to_dict(),
    }
    strategy.close()
    transport.close()
    return out


def _inside(spans, outer) -> int:
    return sum(1 for a, b in spans for c, d, _ in outer if c <= a and b <= d)


@pytest.mark.timeout(180)
def test_acco_overlaps_computation_with_collectives_under_a_slow_link():
    for rank, out in enumerate(run_ranks(_overlap, 2, "acco")):
        # Adaptive accumulation: stages hold more than one micro-batch while the network works ...
        per_stage = [c[rank] for c in out["history"][1:]]
        assert min(per_stage) >= 1 and sum(per_stage) > 2 * len(per_stage), per_stage
        # ... which the recorded events show running *during* collectives on the other thread ...
        assert _inside(out["compute"], out["comm"]) >= len(per_stage)
        # ... and the main thread never blocked on communication.
        assert out["idle"] == []
        assert out["metrics"]["idle_s"] == 0.0 and out["metrics"]["extra"]["compute_wait_s"] == 0.0
    # ZeRO-1 on the same link: no micro-batch runs inside a collective, the main thread idles instead.
    for out in run_ranks(_overlap, 2, "zero1"):
        assert _inside(out["compute"], out["comm"]) == 0
        assert len(out["idle"]) > 0


def _slow_worker(rank: int, world: int, steps: int) -> dict:
    # a job takes ~40 ms of link latency; a micro-batch ~4 ms (simulated), ~16 ms on the slow worker
    transport = Transport(Topology.from_env(), links={"inter": LinkModel(bandwidth=1e9, latency=0.010)})
    strategy = make("acco", "adamw", {}, transport=transport)
    train(strategy, rank, steps, base_s=0.004, sleep_factor=4.0 if rank == world - 1 else 1.0)
    out = {"theta": flat_params(strategy.module), "history": list(strategy.overlap.stage_history),
           "metrics": strategy.last_step_metrics().to_dict()}
    strategy.close()
    transport.close()
    return out


@pytest.mark.timeout(180)
def test_slow_worker_contributes_fewer_micro_batches_and_weighting_is_exact():
    steps, world = 4, 2
    results = run_ranks(_slow_worker, world, steps)
    history = results[0]["history"]
    assert all(r["history"] == history for r in results)  # every worker saw the same all-reduced counts
    fast = sum(c[0] for c in history[1:])
    slow = sum(c[1] for c in history[1:])
    assert fast > slow >= len(history) - 1, (fast, slow)
    m = results[0]["metrics"]["extra"]
    assert m["global_micro_batches"] == sum(m["micro_batches_per_worker"])
    # Replaying the recorded per-worker counts through the plain recurrence gives the same θ: gradients
    # were summed over workers and micro-batches and divided by the global count.
    expected = reference("acco", world, "adamw", steps, counts=history)
    for r in results:
        torch.testing.assert_close(r["theta"], flat(expected.committed[-1]), rtol=RTOL, atol=ATOL)


def _straggler(rank: int, world: int, steps: int, factor: float) -> dict:
    # a job takes a few ms (1 ms per message); a micro-batch ~30 ms (simulated), ≥ 300 ms on the slow worker
    transport = Transport(Topology.from_env(), links={"inter": LinkModel(bandwidth=1e9, latency=0.001)})
    strategy = make("acco", "adamw", {"straggler_factor": factor}, transport=transport)
    train(strategy, rank, steps, base_s=0.03, sleep_factor=10.0 if rank == world - 1 else 1.0)
    out = {"theta": flat_params(strategy.module), "history": list(strategy.overlap.stage_history),
           "speeds": strategy.overlap.peer_micro_batch_s}
    strategy.close()
    transport.close()
    return out


@pytest.mark.timeout(180)
def test_a_straggler_leaves_its_estimate_stages_empty_and_the_count_weighting_stays_exact():
    """Paper 003, Algorithm 1 with time-varying counts: a worker whose micro-batch outlasts the commit job by far
    computes nothing at θ̃ (Ñᵢ = 0) instead of holding every worker's stage 2 open; the commit still averages
    Σ(gᵢ + g̃ᵢ) over Σ(Nᵢ + Ñᵢ), which the plain recurrence replayed with the recorded counts reproduces."""
    steps, world = 8, 2
    results = run_ranks(_straggler, world, steps, 2.0)
    history = results[0]["history"]
    assert all(r["history"] == history for r in results)
    speeds = results[0]["speeds"]
    assert speeds[1] > 4 * speeds[0] > 0, speeds  # every worker learned both speeds through the count all-reduce
    # history: init, then (stage 1, stage 2) per round; the estimate job of stage 1 carries the stage-2 counts Ñ
    stage2 = [c for k, c in enumerate(history) if k and k % 2 == 0]
    stage1 = [c for k, c in enumerate(history) if k % 2 == 1]
    assert all(c[1] >= 1 for c in stage1), history  # the straggler's gradients at θ enter every commit
    assert all(c[0] >= 1 for c in stage2), history  # the fastest worker never skips: ΣÑ ≥ 1
    assert sum(c[1] == 0 for c in stage2) >= len(stage2) // 2, history  # once measured, the straggler skips
    expected = reference("acco", world, "adamw", steps, counts=history)
    for r in results:
        torch.testing.assert_close(r["theta"], flat(expected.committed[-1]), rtol=RTOL, atol=ATOL)


def _straggler_in_a_loop_that_gathers(rank: int, world: int, micro_batches: int, every: int) -> dict:
    # as _straggler, but the loop feeds a fixed number of micro-batches and runs a collective of its own every
    # `every` steps on the main thread (the HF Trainer's loss gather at its logging steps)
    transport = Transport(Topology.from_env(), links={"inter": LinkModel(bandwidth=1e9, latency=0.001)})
    strategy = make("acco", "adamw", {"straggler_factor": 2.0}, transport=transport)
    strategy.loop_collectives = True  # what QuietTrainer declares
    for index in range(micro_batches):
        loss = loss_fn(strategy.model, batch(rank, index))
        time.sleep(0.3 if rank == world - 1 else 0.03)
        strategy.backward(loss)
        strategy.step()
        if index % every == every - 1:
            torch.distributed.all_reduce(torch.ones(1))
    # finish() may end a stage short of a peer's with no micro-batch (the loop's end, not the straggler rule)
    before_finish = len(strategy.overlap.stage_history)
    strategy.finish()
    out = {"theta": flat_params(strategy.module), "history": list(strategy.overlap.stage_history),
           "speeds": strategy.overlap.peer_micro_batch_s, "steps": strategy.steps, "during_loop": before_finish}
    strategy.close()
    transport.close()
    return out


@pytest.mark.timeout(180)
def test_under_a_loop_with_collectives_of_its_own_a_straggler_never_waits_inside_a_step():
    """A straggler's empty stage 2 waits for the commit inside ``step()``; a peer that has not yet ended its stage 1
    may meanwhile wait in the loop's own collective for the straggler -- a deadlock. Where the front door declares
    such collectives (``loop_collectives``: the HF Trainer), the straggler rule is off: the run ends, every worker
    computes in both stages, and the count weighting stays exact."""
    world = 2
    results = run_ranks(_straggler_in_a_loop_that_gathers, world, 48, 16, timeout=120)
    history = results[0]["history"]
    assert all(r["history"] == history for r in results) and results[0]["steps"] >= 2, history
    assert results[0]["speeds"][1] > 4 * results[0]["speeds"][0] > 0  # the straggler was measured as one
    assert all(min(c) >= 1 for c in history[: min(r["during_loop"] for r in results)]), history
    expected = reference("acco", world, "adamw", results[0]["steps"], counts=history)
    for r in results:
        torch.testing.assert_close(r["theta"], flat(expected.committed[-1]), rtol=RTOL, atol=ATOL)


@pytest.mark.timeout(180)
def test_without_the_straggler_rule_every_worker_computes_in_both_stages():
    history = run_ranks(_straggler, 2, 4, 0.0)[0]["history"]
    assert all(min(c) >= 1 for c in history), history


def test_an_exception_in_the_communication_worker_surfaces_in_the_loop():
    strategy = make("acco", "adamw", {"deterministic_accumulation": 1})
    calls = {"n": 0}
    real = strategy.transport.reduce_scatter

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("link down")
        return real(*args, **kwargs)

    strategy.transport.reduce_scatter = flaky
    with pytest.raises(CommWorkerError, match="link down"):
        train(strategy, 0, 10)
    assert strategy.steps == 1  # the third job (stage 1 of round 2) failed
    strategy.close()


def _peer_fails(rank: int, world: int) -> int:
    transport = Transport(Topology.from_env(), timeout_s=5.0)
    strategy = make("acco", "adamw", {"deterministic_accumulation": 1}, transport=transport)
    if rank == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("rank 1 lost its link")
        strategy.overlap.estimator.estimate = broken
    try:
        train(strategy, rank, 5)
    finally:
        strategy.close()
    return strategy.steps


@pytest.mark.timeout(120)
def test_a_failed_peer_fails_the_others_instead_of_hanging():
    out = run_ranks(_peer_fails, 2, timeout=60, expect_failure=True)
    assert out[1][0] == "error" and "rank 1 lost its link" in out[1][1]
    assert out[0][0] == "error" and "CommWorkerError" in out[0][1]


def _resume(rank: int, world: int, name: str, opt: str, extra: dict) -> tuple[torch.Tensor, torch.Tensor]:
    config = {"deterministic_accumulation": det_count(rank), **extra}
    straight = make(name, opt, config)
    train(straight, rank, STEPS)
    expected = flat_params(straight.module)
    straight.close()

    first = make(name, opt, config)
    # every worker stops after the same 7 stage ends (plus part of the next stage where it holds 2)
    stop = train(first, rank, STEPS, stop_after=8 * det_count(rank) - 1)
    state = first.state_dict()
    first.close()
    resumed = make(name, opt, config)
    resumed.load_state_dict(state)
    train(resumed, rank, STEPS, start_index=stop)
    got = flat_params(resumed.module)
    resumed.close()
    return expected, got


@pytest.mark.timeout(120)
def test_resume_from_state_dict_continues_exactly():
    for expected, got in run_ranks(_resume, 2, "acco", "adamw", {}):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_state_dict_holds_stage_buffers_and_shard_state():
    strategy = make("acco", "adamw", {"deterministic_accumulation": 2})
    train(strategy, 0, 2, stop_after=7)
    sd = strategy.state_dict()
    st, overlap = sd["state"], sd["parts"]["overlap"]
    assert sd["strategy"] == "acco" and sd["steps"] == strategy.steps
    assert sd["position"] == {"steps": strategy.steps, "stage": 1 + (st["stage"] == "stage2"),
                              "hand_overs": overlap["hand_overs"]}
    assert st["stage"] in ("stage1", "stage2") and overlap["pending_job"] is not None
    for key in ("tilde_sum", "tilde_count"):
        assert key in st
    for key in ("grads", "comm_buf", "sharded", "stage_count", "hand_overs"):
        assert key in overlap
    assert overlap["sharded"]["params"].numel() == strategy.overlap.sharded.flat.padded_numel
    assert overlap["sharded"]["shard"]["optimizer"]["state"]  # AdamW moments of the shard
    strategy.close()
    other = make("dpu", "adamw", {})
    with pytest.raises(ValueError, match="checkpoint is for strategy 'acco'"):
        other.load_state_dict(sd)
    other.close()


def test_memory_report_lists_every_buffer():
    strategy = make("acco", "adamw", {"deterministic_accumulation": 1})
    train(strategy, 0, 2)
    mem = strategy.memory_report()
    psi = strategy.overlap.sharded.flat.padded_numel * 4
    assert mem["params"] == mem["grads"] == mem["comm_buffer"] == psi
    assert mem["master_shard"] == mem["grad_shard"] == mem["tilde_grad_shard"] == mem["committed_snapshot"] == psi
    assert mem["optimizer_state"] >= 2 * psi  # exp_avg, exp_avg_sq (+ step)
    assert mem["estimate_scratch"] >= mem["master_shard"] + 2 * psi
    strategy.close()


@pytest.mark.parametrize(("config", "message"), [
    ({"min_accumulation": 0}, "min_accumulation must be an integer >= 1"),
    ({"min_accumulation": 3, "max_accumulation": 2}, "max_accumulation must be >= min_accumulation"),
    ({"deterministic_accumulation": 0}, "deterministic_accumulation must be an integer >= 1 or None"),
    ({"min_accumulation": 2, "deterministic_accumulation": 1}, "deterministic_accumulation must lie in"),
    ({"max_accumulation": 2, "deterministic_accumulation": 3}, "deterministic_accumulation must lie in"),
    ({"max_accumulation": 1.5}, "max_accumulation must be an integer"),
    ({"reduce_dtype": "int8"}, "reduce_dtype must be one of"),
    ({"straggler_factor": 0.5}, "straggler_factor must be 0 \\(off\\) or a number >= 1"),
    ({"straggler_factor": float("nan")}, "straggler_factor must be 0"),
])
def test_bad_knobs_fail_clearly(config, message):
    with pytest.raises(ValueError, match=message):
        quietsync.make_strategy("acco", tiny_model(), config=config)


def test_cli_flags_come_from_the_config():
    from quietsync.train.args import train_parser

    parser, _, fields = train_parser("acco")
    assert {"min_accumulation", "max_accumulation", "deterministic_accumulation", "straggler_factor"} <= set(fields)
    help_text = parser.format_help()
    assert "--deterministic-accumulation" in help_text and "--max-accumulation" in help_text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(120)
def test_acco_on_cuda_side_stream_equals_reference():
    expected = reference("acco", 1, "adamw", 4)
    model = tiny_model().cuda()
    from tests.strategies.helpers.common import param_groups
    from tests.strategies.helpers.overlap_common import ADAMW, WEIGHT_DECAY, lr_schedule

    strategy = quietsync.make_strategy("acco", model, torch.optim.AdamW,
                                       param_groups=param_groups(model, WEIGHT_DECAY),
                                       config={"deterministic_accumulation": 1}, lr_schedule=lr_schedule,
                                       **ADAMW)
    assert strategy.overlap.worker.stream is not None
    index = 0
    while strategy.steps < 4:
        x, y = batch(0, index)
        strategy.backward(torch.nn.functional.mse_loss(strategy.model(x.cuda()), y.cuda()))
        index += 1
        strategy.step()
    torch.testing.assert_close(flat_params(strategy.module).cpu(), flat(expected.committed[-1]),
                               rtol=1e-4, atol=1e-5)
    strategy.close()
