"""``Strategy.level``: workers of acco, dpu and wp that drifted apart are brought to one committed step with nothing
in flight -- the round in flight committed -- and training goes on from there: what a front door needs before a
checkpoint or an evaluation between two steps (``QuietTrainer``)."""

from __future__ import annotations

import time

import pytest
import torch

from quietsync.link import LinkModel
from quietsync.topology import Topology
from quietsync.transport import Transport
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn
from tests.strategies.helpers.overlap_common import batch, make


def _feed(strategy, rank: int, world: int, first: int, count: int) -> None:
    for index in range(first, first + count):
        loss = loss_fn(strategy.model, batch(rank, index))
        time.sleep(0.12 if rank == world - 1 else 0.03)  # the last worker 4x slower: the workers drift apart
        strategy.backward(loss)
        strategy.step()


def _level_then_go_on(rank: int, world: int, name: str, before: int, after: int) -> dict:
    transport = Transport(Topology.from_env(), links={"inter": LinkModel(bandwidth=1e9, latency=0.001)})
    strategy = make(name, "adamw", {}, transport=transport)
    strategy.loop_collectives = True  # level() is a collective between steps (what QuietTrainer declares)
    _feed(strategy, rank, world, 0, before)
    out = {"stages_before": strategy.overlap.hand_overs}
    out["added"] = strategy.level()
    out.update(steps=strategy.steps, in_flight=strategy.steps_in_flight, idle=strategy.overlap.job is None,
               handed_over=sum(sum(counts) for counts in strategy.overlap.stage_history))
    with strategy.committed_params() as model:
        out["levelled"] = flat_params(model)
    _feed(strategy, rank, world, before, after)
    strategy.finish()
    out.update(final=flat_params(strategy.module), final_steps=strategy.steps)
    strategy.close()
    transport.close()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["acco", "dpu", "wp"])
def test_level_brings_drifted_workers_to_one_committed_step_and_training_goes_on(name):
    results = run_ranks(_level_then_go_on, 2, name, 9, 9, timeout=150)
    first = results[0]
    for r in results:
        assert r["steps"] == first["steps"] >= 1 and r["in_flight"] == 0 and r["idle"], (name, r["steps"])
        # the round in flight was committed, not dropped (acco: a stage 1 ends as a straggler's does)
        assert r["added"] >= 1, (name, r["added"])  # (one more on a worker that caught up with a commit)
        if name != "acco":  # dpu/wp: the stage in progress went into one more update -- every micro-batch fed before
            assert r["handed_over"] == 2 * 9, (name, r["handed_over"])  # level() is in an update now
        torch.testing.assert_close(r["levelled"], first["levelled"], rtol=0, atol=0)  # the same committed θ
        assert r["final_steps"] == first["final_steps"] > first["steps"], name  # it trained on after level()
        torch.testing.assert_close(r["final"], first["final"], rtol=0, atol=0)


def test_level_is_nothing_to_a_strategy_in_lockstep_and_refused_where_the_loop_did_not_declare_it():
    strategy = make("zero1", "adamw", {})
    strategy.backward(loss_fn(strategy.model, batch(0, 0)))
    assert strategy.step() and strategy.level() == 0 and strategy.steps == 1
    strategy.close()
    drifting = make("acco", "adamw", {})
    with pytest.raises(RuntimeError, match=r"^level\(\) is a collective between two steps: set loop_collectives"):
        drifting.level()
    drifting.close()
