"""Mixed precision in the strategy contract (``precision="fp32"|"bf16"|"fp16"``).

* bf16/fp16: every strategy runs the forward under autocast and keeps fp32 parameters, master weights and
  optimizer state;
* fp16: dynamic loss scaling whose skip decision every worker shares — an overflow on one worker drops that
  round on every worker (the same steps, the same scale, identical replicas), the scale halves and later grows;
  a run with an overflowing round equals the run in which that round was never fed;
* cdp refuses fp16 (its stages commit at different time steps); bad values are refused at construction.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import quietsync
from quietsync.strategies.parts.precision import Precision
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, tiny_model

OPT = {"lr": 1e-2, "weight_decay": 0.1}
ALL = ["ddp", "zero1", "fsdp", "acco", "dpu", "wp", "demo", "flexdemo", "localsgd", "diloco", "cdp"]
CONFIG: dict[str, dict[str, Any]] = {
    "ddp": {"accumulation": 2}, "zero1": {"accumulation": 2}, "fsdp": {"accumulation": 2},
    "acco": {"deterministic_accumulation": 1}, "dpu": {"deterministic_accumulation": 1},
    "wp": {"deterministic_accumulation": 1}, "demo": {"accumulation": 2, "chunk": 4},
    "flexdemo": {"chunk": 4}, "localsgd": {"sync_every": 2}, "diloco": {"sync_every": 2},
    "diloco_zero1": {"sync_every": 2, "inner": "zero1"}, "cdp": {"stages": 2},
}


class Probe(nn.Module):
    """Records whether its forward ran under autocast, and in which dtype its input came."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((torch.is_autocast_enabled("cpu"), x.dtype))
        return x


def probed_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), Probe(), nn.Tanh(), nn.Linear(13, 5))


def _fp32_state(strategy) -> list[torch.dtype]:
    dtypes = [p.dtype for p in strategy.module.parameters()]
    opt = strategy.optimizer
    for st in opt.state.values():
        dtypes += [v.dtype for v in st.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    for name in ("sharded", "overlap"):
        part = getattr(strategy, name, None)
        sharded = getattr(part, "sharded", part)
        if sharded is not None and hasattr(sharded, "shard"):
            dtypes.append(sharded.shard.master.dtype)
    return dtypes


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ALL)
def test_forward_runs_under_autocast_and_the_state_stays_fp32(name, precision):
    if name == "cdp" and precision == "fp16":
        pytest.skip("cdp refuses fp16 (tested below)")
    model = probed_model()
    probe = model[1]
    want = torch.bfloat16 if precision == "bf16" else torch.float16
    s = quietsync.make_strategy(name, model, torch.optim.AdamW, config=dict(CONFIG[name]), precision=precision,
                                **OPT)
    assert s.precision.name == precision
    k = 0
    while s.steps < 3:
        s.forward_backward(micro_batch(0, 0, k), loss_fn)
        k += 1
        s.step()
    assert probe.seen and all(on and dtype == want for on, dtype in probe.seen), probe.seen
    assert set(_fp32_state(s)) == {torch.float32}
    with s.committed_params() as m:
        assert all(torch.isfinite(p).all() for p in m.parameters())
    s.close()


def test_fp32_runs_no_autocast_and_scales_nothing():
    model = probed_model()
    s = quietsync.make_strategy("zero1", model, **OPT)
    s.forward_backward(micro_batch(0, 0, 0), loss_fn)
    assert s.step()
    assert model[1].seen == [(False, torch.float32)]
    assert s.scaler is None and s.last_step_metrics().extra == {}
    s.close()


def test_autocast_wraps_a_forward_the_loop_runs_itself():
    model = probed_model()
    s = quietsync.make_strategy("ddp", model, precision="bf16", **OPT)
    with s.autocast():
        loss = loss_fn(s.model, micro_batch(0, 0, 0))
    s.backward(loss)
    assert s.step()
    assert model[1].seen == [(True, torch.bfloat16)]
    s.close()


def test_bad_precision_and_low_precision_models_are_refused():
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, fp16, got 'fp8'"):
        quietsync.make_strategy("zero1", tiny_model(), precision="fp8")
    with pytest.raises(ValueError, match="precision bf16 autocasts an fp32 model.*bfloat16"):
        quietsync.make_strategy("ddp", tiny_model().to(torch.bfloat16), precision="bf16")
    with pytest.raises(ValueError, match="precision fp16 is not supported by strategy cdp: each stage is updated"):
        quietsync.make_strategy("cdp", tiny_model(), precision="fp16")


def test_loss_scale_grows_after_growth_interval_and_is_checkpointed():
    policy = Precision("fp16", init_scale=8.0, growth_interval=2)
    s = quietsync.make_strategy("zero1", tiny_model(), precision=policy, **OPT)
    scales = []
    for k in range(5):
        s.forward_backward(micro_batch(0, 0, k), loss_fn)
        assert s.step()
        scales.append(s.last_step_metrics().extra["loss_scale"])
    assert scales == [8.0, 8.0, 16.0, 16.0, 32.0]
    state = s.state_dict()
    assert state["parts"]["loss_scale"]["scale"] == 32.0
    s.close()
    fresh = quietsync.make_strategy("zero1", tiny_model(), precision=policy, **OPT)
    fresh.load_state_dict(state)
    assert fresh.scaler.scale == 32.0 and fresh.scaler.good_steps == 1
    fresh.close()


# --------------------------------------------------------------------------- fp16 overflow: a shared skip
POISON_RANK, POISON_ROUND = 1, 2
SCALE0 = 1024.0  # small enough that the tiny model never overflows by itself


def fp16_run(rank: int, world: int, case: str, steps: int, poison: bool) -> dict[str, Any]:
    """``steps`` committed steps in fp16; with ``poison``, rank 1's first micro-batch of round 2 has a loss
    1e10 times too big (its fp16 gradient overflows); without, round 2 is never fed (by any worker)."""
    name = case.split("_")[0]
    per_round = CONFIG[case].get("accumulation", 1)
    model = tiny_model()
    s = quietsync.make_strategy(name, model, torch.optim.AdamW, config=dict(CONFIG[case]),
                                precision=Precision("fp16", init_scale=SCALE0), **OPT)
    extras, k = [], 0
    while s.steps < steps:
        rnd = k // per_round
        if rnd == POISON_ROUND and not poison:
            k += 1
            continue
        bad = poison and rank == POISON_RANK and k == POISON_ROUND * per_round

        def loss(m, b, bad=bad):
            return loss_fn(m, b) * (1e10 if bad else 1.0)

        s.forward_backward(micro_batch(0, rank, k), loss)
        k += 1
        if s.step():
            extras.append(dict(s.last_step_metrics().extra))
    with s.committed_params() as m:
        theta = flat_params(m)
    s.close()
    return {"theta": theta, "extras": extras, "steps": s.steps}


FP16_CASES = {"ddp": (2, None), "zero1": (2, None), "fsdp": (4, 2), "acco": (2, None), "dpu": (2, None),
              "wp": (2, None), "demo": (2, None), "flexdemo": (4, 2), "localsgd": (2, None),
              "diloco": (2, None), "diloco_zero1": (4, 2)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", sorted(FP16_CASES))
def test_an_fp16_overflow_on_one_worker_skips_the_round_on_every_worker(case):
    world, nodes = FP16_CASES[case]
    steps = 4
    poisoned = run_ranks(fp16_run, world, case, steps, True, nodes=nodes, timeout=200)
    skips = [[e["overflow_skips"] for e in out["extras"]] for out in poisoned]
    scales = [[e["loss_scale"] for e in out["extras"]] for out in poisoned]
    assert all(out["steps"] == steps for out in poisoned)
    assert all(sum(x) == 1 for x in skips), skips  # exactly one round dropped, on every worker
    assert len({tuple(x) for x in skips}) == 1 and len({tuple(x) for x in scales}) == 1, (skips, scales)
    assert scales[0][0] == SCALE0 and scales[0][-1] == SCALE0 / 2  # backed off once
    for out in poisoned:
        assert torch.isfinite(out["theta"]).all()
    if case in ("ddp", "zero1", "fsdp", "localsgd", "diloco", "diloco_zero1", "demo"):
        # a dropped round is a round never fed (up to fp16 rounding of the scaled backward)
        clean = run_ranks(fp16_run, world, case, steps, False, nodes=nodes, timeout=200)
        for a, b in zip(poisoned, clean):
            torch.testing.assert_close(a["theta"], b["theta"], rtol=1e-4, atol=1e-5)
    for out in poisoned[1:]:  # the committed parameters are the same on every worker
        torch.testing.assert_close(out["theta"], poisoned[0]["theta"], rtol=0, atol=0)


def test_the_trainer_guard_leaves_fp16_overflows_to_the_loss_scaler():
    from quietsync.train.nonfinite import NonFiniteError, NonFiniteGuard, gradients_finite

    s = quietsync.make_strategy("acco", tiny_model(), precision="fp16", config={"deterministic_accumulation": 1},
                                **OPT)
    guard = NonFiniteGuard("stop", s)
    assert not guard.checks_gradients
    with s.autocast():
        loss = loss_fn(s.model, micro_batch(0, 0, 0))
    s.backward(loss * 1e10)  # scaled by 2**16, in fp16: the gradient overflows
    assert not gradients_finite(s.module)
    guard.see(loss.detach())  # a finite loss: no error, the strategy will skip the round
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        guard.see(torch.tensor(float("inf")))
    s.close()
