"""``Strategy.finish()``: the one call that ends a run, the same for every strategy.

After it every worker's model equals the committed parameters and holds every step's update, checked against
the single-process recurrences (written from the papers, in ``reference_*.py``): localsgd/diloco sync their
last partial round (or, with ``sync=False``, drop it), dpu/wp apply the update in flight (one more committed
step), acco drops the estimate stage's gradients (or commits a commit job already running), cdp drops its
micro-batches in flight. Accelerate's ``LocalSGD`` ends the same way when its context exits.
"""

from __future__ import annotations

import os

import pytest
import torch

import quietsync
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, reference_run, tiny_model
from tests.strategies.helpers.local_common import ADAMW
from tests.strategies.helpers.overlap_common import batch, det_count, flat, make, reference
from tests.strategies.helpers.reference_local import reference_diloco, reference_localsgd

RTOL, ATOL = 1e-5, 1e-6


def _adamw(groups):
    return torch.optim.AdamW(groups, **ADAMW)


def _ended(s: quietsync.Strategy, sync: bool = True) -> dict:
    """finish(); what the parent compares: the model, the committed parameters, the steps."""
    added = s.finish(sync=sync)
    model = flat_params(s.module)
    with s.committed_params() as m:
        committed = flat_params(m)
    assert s.finish() == 0  # a second call does nothing
    with pytest.raises(RuntimeError, match="has finished"):
        s.step()
    out = {"model": model, "committed": committed, "steps": s.steps, "added": added}
    s.close()
    return out


def _local(rank: int, name: str, config: dict, steps: int, sync: bool) -> dict:
    """``steps`` inner steps of one micro-batch each (the data of reference_local), then finish."""
    model = tiny_model()
    s = quietsync.make_strategy(name, model, torch.optim.AdamW, param_groups=param_groups(model), config=config,
                                **ADAMW)
    for t in range(steps):
        s.forward_backward(micro_batch(t, rank, 0), loss_fn)
        assert s.step()
    assert s.steps_in_flight == 0
    return _ended(s, sync)


def _local_worker(rank: int, world: int, *args) -> dict:
    return _local(rank, *args)


def _overlap(rank: int, name: str, steps: int, more_micro_batches: int = 0) -> dict:
    """Deterministic acco/dpu/wp until ``steps`` committed steps (a budget-aware loop would stop earlier, see
    steps_in_flight), then ``more_micro_batches`` micro-batches without a commit, then finish."""
    s = make(name, "adamw", {"deterministic_accumulation": det_count(rank)})
    index = 0
    while s.steps < steps:
        s.forward_backward(batch(rank, index), loss_fn)
        index += 1
        s.step()
    in_flight = [s.steps_in_flight]
    for _ in range(more_micro_batches):
        s.forward_backward(batch(rank, index), loss_fn)
        index += 1
        assert not s.step()
        in_flight.append(s.steps_in_flight)
    return {**_ended(s), "in_flight": in_flight}


def _cdp(rank: int, world: int, steps: int) -> dict:
    model = tiny_model()
    s = quietsync.make_strategy("cdp", model, torch.optim.AdamW, param_groups=param_groups(model), **ADAMW)
    index = 0
    while s.steps < steps:
        s.forward_backward(micro_batch(0, rank, index), loss_fn)
        index += 1
        s.step()
    with s.committed_params() as m:
        before = flat_params(m)
    return {**_ended(s), "before": before}


def _workers(rank: int, world: int) -> dict:
    """Every case in one launch of the workers (process start-up is the expensive part on 2 cores)."""
    return {
        "localsgd": _local(rank, "localsgd", {"sync_every": 3}, 5, True),
        "localsgd_nosync": _local(rank, "localsgd", {"sync_every": 3}, 5, False),
        "localsgd_aligned": _local(rank, "localsgd", {"sync_every": 3}, 6, True),
        "diloco": _local(rank, "diloco", {"sync_every": 3}, 5, True),
        "diloco_nosync": _local(rank, "diloco", {"sync_every": 3}, 5, False),
        "diloco_streaming": _local(rank, "diloco", {"sync_every": 4, "fragments": 2, "overlap_delay": 1}, 7, True),
        "diloco_in_flight": _local(rank, "diloco", {"sync_every": 4, "fragments": 2, "overlap_delay": 1}, 6, True),
        "zero1": _local(rank, "zero1", {}, 3, True),
        "dpu": _overlap(rank, "dpu", 3),
        "wp": _overlap(rank, "wp", 3),
        "acco": _overlap(rank, "acco", 3),
        # stage 2 of round 3 begins after the stage-1 micro-batches (det_count(rank)) of that round
        "acco_stage2": _overlap(rank, "acco", 3, more_micro_batches=det_count(rank)),
        "cdp": _cdp(rank, world, 3),
    }


def _tiny_indices() -> list[list[int]]:
    """The two fragments diloco cuts the tiny model into (by element count: [w0], [b0, w1, b1] in group order)."""
    return [[0], [1, 2, 3]]


@pytest.mark.timeout(240)
def test_after_finish_every_worker_holds_the_committed_model_with_every_step():
    out = run_ranks(_workers, 2, timeout=230)
    for case in out[0]:
        a, b = out[0][case], out[1][case]
        torch.testing.assert_close(a["model"], b["model"], rtol=0, atol=0, msg=case)  # replicas agree
        for r in (a, b):
            torch.testing.assert_close(r["model"], r["committed"], rtol=0, atol=0, msg=case)

    # localsgd: steps 4-5 averaged once more, as Accelerate's LocalSGD does on exit (the mean of the replicas)
    local = reference_localsgd(2, 3, 5, _adamw)
    torch.testing.assert_close(out[0]["localsgd"]["model"], (local[0] + local[1]) / 2, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(local[0], local[1])  # there was something to average
    # sync=False: the last average (after step 3) is what every worker keeps
    at3 = reference_localsgd(2, 3, 3, _adamw)
    torch.testing.assert_close(out[0]["localsgd_nosync"]["model"], at3[0], rtol=RTOL, atol=ATOL)
    # steps a multiple of K: the last step synced, finish has nothing to add
    torch.testing.assert_close(out[0]["localsgd_aligned"]["model"], reference_localsgd(2, 3, 6, _adamw)[0],
                               rtol=RTOL, atol=ATOL)

    # diloco: one more outer step on the partial round's pseudo-gradient (steps 4-5)
    for case, kw, steps, finish in [
        ("diloco", {"sync_every": 3}, 5, True),
        ("diloco_nosync", {"sync_every": 3}, 5, False),
        ("diloco_streaming", {"sync_every": 4, "fragments": _tiny_indices(), "delay": 1}, 7, True),
        ("diloco_in_flight", {"sync_every": 4, "fragments": _tiny_indices(), "delay": 1}, 6, True),
    ]:
        expected = reference_diloco(2, 2, steps=steps, make_opt=_adamw, finish=finish, **kw)
        torch.testing.assert_close(out[0][case]["model"], expected[0], rtol=RTOL, atol=ATOL, msg=case)
        without = reference_diloco(2, 2, steps=steps, make_opt=_adamw, finish=not finish, **kw)
        assert not torch.allclose(expected[0], without[0], rtol=RTOL, atol=ATOL), case  # the sync mattered

    # zero1: nothing in flight
    torch.testing.assert_close(out[0]["zero1"]["model"], reference_run(2, 1, 3, **ADAMW), rtol=RTOL, atol=ATOL)
    assert out[0]["zero1"]["added"] == 0

    # dpu / wp: the update in flight (the last stage's gradients) is applied: step 4 of the recurrence
    for name in ("dpu", "wp"):
        r = out[0][name]
        assert r["in_flight"] == [1] and r["added"] == 1 and r["steps"] == 4
        expected = reference(name, 2, "adamw", 4).committed[-1]
        torch.testing.assert_close(r["model"], flat(expected), rtol=RTOL, atol=ATOL, msg=name)
    # acco right after a commit: the estimate stage's gradients are dropped, θ⁽³⁾ is final
    r = out[0]["acco"]
    assert r["in_flight"] == [0] and r["added"] == 0 and r["steps"] == 3
    torch.testing.assert_close(r["model"], flat(reference("acco", 2, "adamw", 3).committed[-1]), rtol=RTOL, atol=ATOL)
    # acco in stage 2: the commit job running is committed, θ⁽⁴⁾
    r = out[0]["acco_stage2"]
    assert r["in_flight"][0] == 0 and r["in_flight"][-1] == 1 and r["added"] == 1 and r["steps"] == 4
    torch.testing.assert_close(r["model"], flat(reference("acco", 2, "adamw", 4).committed[-1]), rtol=RTOL,
                               atol=ATOL)

    # cdp: the micro-batches in flight are dropped; the committed model of step 3 is the model
    for r in out:
        assert r["cdp"]["steps"] == 3 and r["cdp"]["added"] == 0
        torch.testing.assert_close(r["cdp"]["model"], r["cdp"]["before"], rtol=0, atol=0)


def _accelerate_exit(rank: int, world: int, sync_every: int, steps: int) -> torch.Tensor:
    """HF Accelerate's own LocalSGD, written the way its docs show; the parameters after its context exits."""
    os.environ["OMP_NUM_THREADS"] = "1"
    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    accelerator = Accelerator(cpu=True)
    model = tiny_model()
    opt = torch.optim.AdamW(param_groups(model), **ADAMW)
    model, opt = accelerator.prepare(model, opt)
    with LocalSGD(accelerator, model, local_sgd_steps=sync_every) as local_sgd:
        for s in range(steps):
            accelerator.backward(loss_fn(model, micro_batch(s, rank, 0)))
            opt.step()
            opt.zero_grad()
            local_sgd.step()
    return flat_params(accelerator.unwrap_model(model))


@pytest.mark.timeout(120)
def test_localsgd_finish_matches_accelerate_local_sgd_exit():
    pytest.importorskip("accelerate")
    theirs = run_ranks(_accelerate_exit, 2, 3, 5)
    ours = run_ranks(_local_worker, 2, "localsgd", {"sync_every": 3}, 5, True)
    for r in range(2):
        torch.testing.assert_close(ours[r]["model"], theirs[r], rtol=0, atol=1e-6)


def _fixed_count(rank: int, world: int, names: list[str], micro_batches: int, sleep_s: float) -> dict:
    """Adaptive acco/dpu: every worker feeds the same number of micro-batches (as a Trainer's max_steps or the end
    of a data loader stops a loop), the last worker slowly, then finish: the fast worker stops a stage short of
    the slow one, whose job then waits for it, so finish first brings it level."""
    import time

    out = {}
    for name in names:
        s = make(name, "adamw", {})
        for index in range(micro_batches):
            s.forward_backward(batch(rank, index), loss_fn)
            if rank == world - 1:
                time.sleep(sleep_s)
            s.step()
        before = s.overlap.hand_overs
        history = s.overlap.stage_history
        out[name] = {**_ended(s), "hand_overs_before": before, "history": list(history)}
    return out


@pytest.mark.timeout(180)
def test_a_loop_stopped_on_a_micro_batch_count_finishes_level_and_exact():
    names = ["dpu", "acco"]
    out = run_ranks(_fixed_count, 2, names, 8, 0.15, timeout=170)
    for name in names:
        a, b = out[0][name], out[1][name]
        assert a["history"] == b["history"], name  # the same all-reduced counts: no stage left unmatched
        torch.testing.assert_close(a["model"], b["model"], rtol=0, atol=0, msg=name)
        expected = reference(name, 2, "adamw", a["steps"], counts=a["history"]).committed[-1]
        for r in (a, b):
            torch.testing.assert_close(r["model"], r["committed"], rtol=0, atol=0, msg=name)
            torch.testing.assert_close(r["model"], flat(expected), rtol=RTOL, atol=ATOL, msg=name)
        # the situation finish had to resolve: the slow worker had ended one more stage than the fast one
        assert b["hand_overs_before"] == a["hand_overs_before"] + 1, (name, a["hand_overs_before"],
                                                                        b["hand_overs_before"])
