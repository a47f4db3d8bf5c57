"""Adaptive inner steps (localsgd, diloco): a slow worker takes fewer inner steps per round, the outer average weighs
each worker by the tokens behind it — checked against the Async Local-SGD / DyLU equations written below with plain
torch; equal speeds are the synchronous method bit for bit; a resume at a round boundary continues identically;
measured speeds give the slow worker the smaller share; bad knobs are refused in one line."""

from __future__ import annotations

import copy
import io
import time
from typing import Any

import pytest
import torch

import quietsync
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model

ADAMW = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


# ---------------------------------------------------------------------- the reference, from the papers' equations
def reference(world: int, period: int, rounds: int, plan: list[int], method: str, *, outer_lr: float = 0.7,
              outer_momentum: float = 0.9) -> list[torch.Tensor]:
    """Async Local-SGD / DyLU with a fixed plan: in every round worker i takes ``plan[i]`` AdamW steps on its own
    micro-batches (its k-th inner step overall reads ``micro_batch(k, i, 0)``); then, with w_i = plan[i] / Σ plan
    (tokens_i / Σ tokens: every inner step is one micro-batch of the same size),

    * localsgd: θ ← Σ_i w_i θ_i, every worker continues from θ;
    * diloco:   Δ = Σ_i w_i (θ_g − θ_i);  b ← μ·b + Δ (b = Δ the first time);  θ_g ← θ_g − lr·(Δ + μ·b) (Nesterov);
      every worker continues from θ_g.

    Returns every worker's flat parameters at the end."""
    base = tiny_model()
    models = [copy.deepcopy(base) for _ in range(world)]
    opts = [torch.optim.AdamW(param_groups(m), **ADAMW) for m in models]
    glob = [p.detach().clone() for p in base.parameters()]
    momentum: list[torch.Tensor] | None = None
    taken = [0] * world
    w = [h / sum(plan) for h in plan]
    for _ in range(rounds):
        for i in range(world):
            for _ in range(plan[i]):
                opts[i].zero_grad()
                loss_fn(models[i], micro_batch(taken[i], i, 0)).backward()
                opts[i].step()
                taken[i] += 1
        with torch.no_grad():
            params = list(zip(*(m.parameters() for m in models)))
            if method == "localsgd":
                new = [sum(w[i] * ps[i] for i in range(world)) for ps in params]
            else:
                delta = [sum(w[i] * (g - ps[i]) for i in range(world)) for g, ps in zip(glob, params)]
                momentum = delta if momentum is None else [outer_momentum * b + d for b, d in zip(momentum, delta)]
                glob = [g - outer_lr * (d + outer_momentum * b) for g, d, b in zip(glob, delta, momentum)]
                momentum = [b.clone() for b in momentum]
                new = glob
            for ps, v in zip(params, new):
                for p in ps:
                    p.copy_(v)
    return [flat_params(m) for m in models]


# ---------------------------------------------------------------------- the workers
def _build(strategy: str, config: dict) -> quietsync.Strategy:
    model = tiny_model()
    return quietsync.make_strategy(strategy, model, torch.optim.AdamW, param_groups=param_groups(model),
                                   config=config, **ADAMW)


def run_adaptive(rank: int, strategy: str, config: dict, steps: int, resume_at: int | None = None,
                 sleep_s: dict[int, float] | None = None) -> dict[str, Any]:
    """Feed this worker's own micro-batches (its k-th inner step reads ``micro_batch(k, rank, a)``) until ``steps``
    nominal steps are committed; optionally checkpoint when ``resume_at`` is reached and continue in a fresh strategy;
    ``sleep_s``: seconds a worker sleeps after each micro-batch (a slower device, as ``--slow-worker`` emulates)."""
    s = _build(strategy, config)
    accumulation = config.get("accumulation", 1)
    inner, trace = 0, []
    while s.steps < steps:
        for a in range(accumulation):
            s.forward_backward(micro_batch(inner, rank, a), loss_fn)
            if sleep_s and rank in sleep_s:
                time.sleep(sleep_s[rank])
            assert s.step() == (a == accumulation - 1)
        inner += 1
        m = s.last_step_metrics()
        # the speeds the next round's plan is derived from (measured ones: what this machine's timing gave)
        speeds = None if getattr(s, "adaptive", None) is None else list(s.adaptive.speeds)
        trace.append({"step": m.step, "extra": dict(m.extra), "params": flat_params(s.module), "speeds": speeds})
        if resume_at is not None and s.steps == resume_at:
            buf = io.BytesIO()
            torch.save(s.state_dict(), buf)
            s.close()
            s = _build(strategy, config)
            buf.seek(0)
            s.load_state_dict(torch.load(buf, weights_only=False))
    with s.committed_params():
        committed = flat_params(s.module)
    out = {"params": flat_params(s.module), "committed": committed, "trace": trace, "inner": inner}
    s.close()
    return out


def run_jobs(rank: int, world: int, jobs: list[dict]) -> list[dict[str, Any]]:
    return [run_adaptive(rank, **job) for job in jobs]


UNEVEN = {"inner_steps": "adaptive", "worker_speeds": (1.0, 0.5)}   # plan [4, 2] at L = 4
EQUAL = {"inner_steps": "adaptive", "worker_speeds": (1.0, 1.0)}
STREAM = {"sync_every": 4, "fragments": 2, "overlap_delay": 1, "mixing": 0.3, "pseudo_grad_dtype": "fp4"}


@pytest.mark.timeout(300)
def test_token_weighted_outer_average_equal_speeds_resume_and_measured_plan():
    jobs = [
        {"strategy": "localsgd", "config": {"sync_every": 4, **UNEVEN}, "steps": 12},                  # 0
        {"strategy": "diloco", "config": {"sync_every": 4, "inner_steps": "adaptive",
                                          "worker_speeds": (0.25, 1.0)}, "steps": 12},                 # 1 plan [1, 4]
        {"strategy": "localsgd", "config": {"sync_every": 4, **EQUAL}, "steps": 12},                   # 2
        {"strategy": "localsgd", "config": {"sync_every": 4}, "steps": 12},                            # 3
        {"strategy": "diloco", "config": {**STREAM, **EQUAL}, "steps": 12},                            # 4
        {"strategy": "diloco", "config": STREAM, "steps": 12},                                         # 5
        {"strategy": "diloco", "config": {"sync_every": 4, **UNEVEN}, "steps": 12},                    # 6
        {"strategy": "diloco", "config": {"sync_every": 4, **UNEVEN}, "steps": 12, "resume_at": 8},    # 7
        {"strategy": "diloco", "config": {"sync_every": 4, "inner_steps": "adaptive"}, "steps": 8,
         "sleep_s": {1: 0.03}},                                                                        # 8 measured
    ]
    res = run_ranks(run_jobs, 2, jobs, timeout=240)

    # the token-weighted outer average ≡ the reference (localsgd: θ = Σ w_i θ_i; diloco: Nesterov on Σ w_i Δ_i)
    for job, method, plan in ((0, "localsgd", [4, 2]), (1, "diloco", [1, 4]), (6, "diloco", [4, 2])):
        ref = reference(2, 4, 3, plan, method)
        plain = reference(2, 4, 3, [4, 4], method)  # what a synchronous average of the same replicas would miss
        for r in range(2):
            torch.testing.assert_close(res[r][job]["params"], ref[r], rtol=1e-5, atol=1e-6)
            assert res[r][job]["inner"] == 3 * plan[r]
        assert (res[0][job]["params"] - plain[0]).abs().max() > 1e-3
    # the weighting is really there: the same plan averaged 1/2, 1/2 is far from it
    unweighted = _unweighted_localsgd([4, 2])
    assert (res[0][0]["params"] - unweighted).abs().max() > 50 * 1e-6

    # a slow worker's inner steps span L / H_i nominal steps; every worker meets at the round's end
    assert [t["step"] for t in res[1][0]["trace"]][:3] == [2, 4, 6]
    assert [t["step"] for t in res[0][1]["trace"]] == [4, 8, 12]
    assert {t["extra"]["round_inner_steps"] for t in res[0][1]["trace"]} == {1}

    # equal speeds: the synchronous method bit for bit (localsgd; streaming fp4 diloco with a fragment in flight)
    for r in range(2):
        assert torch.equal(res[r][2]["params"], res[r][3]["params"])
        assert torch.equal(res[r][4]["params"], res[r][5]["params"])
        assert torch.equal(res[r][4]["committed"], res[r][5]["committed"])
        # a resume at a round boundary mid-run continues identically (the plan is in the state)
        assert torch.equal(res[r][7]["params"], res[r][6]["params"])

    # measured speeds: the first round is synchronous, then each round's plan is H_i = max(1, round(L·v_i / max v))
    # of the speeds measured so far, the same on both workers; the sleeping worker's measured seconds per inner step
    # hold its sleep. Asserted for whatever speeds this machine measured (a loaded machine can slow either worker)
    def expected_plan(speeds: list[float]) -> list[int]:
        if max(speeds) <= 0:  # nothing measured yet
            return [4] * len(speeds)
        return [max(1, min(4, round(4 * v / max(speeds)))) for v in speeds]

    for r in range(2):
        trace = res[r][8]["trace"]
        shares = [t["extra"]["round_inner_steps"] for t in trace]
        assert shares[:4] == [4] * 4, shares
        for before, now in zip(trace, trace[1:]):
            assert now["extra"]["round_inner_steps"] == expected_plan(before["speeds"])[r], (before, now)
    measured = res[0][8]["trace"][-1]["speeds"]
    assert measured == res[1][8]["trace"][-1]["speeds"] and min(measured) > 0, measured
    assert 1.0 / measured[1] >= 0.03, measured
    assert res[1][8]["trace"][-1]["step"] == 8 and res[0][8]["trace"][-1]["step"] == 8
    torch.testing.assert_close(res[0][8]["committed"], res[1][8]["committed"], rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_three_workers_each_at_its_own_speed():
    """Three speeds, three shares: plan [4, 2, 1] at L = 4; localsgd and diloco ≡ the reference."""
    speeds = {"inner_steps": "adaptive", "worker_speeds": (1.0, 0.5, 0.25), "sync_every": 4}
    jobs = [{"strategy": "localsgd", "config": speeds, "steps": 8},
            {"strategy": "diloco", "config": speeds, "steps": 8}]
    res = run_ranks(run_jobs, 3, jobs, timeout=240)
    for job, method in enumerate(("localsgd", "diloco")):
        ref = reference(3, 4, 2, [4, 2, 1], method)
        for r in range(3):
            torch.testing.assert_close(res[r][job]["params"], ref[r], rtol=1e-5, atol=1e-6)
    assert [t["step"] for t in res[2][1]["trace"]] == [4, 8]


def _unweighted_localsgd(plan: list[int]) -> torch.Tensor:
    """localsgd with the same uneven plan but the plain 1/n average (what weighting by tokens changes)."""
    base = tiny_model()
    models = [copy.deepcopy(base) for _ in range(2)]
    opts = [torch.optim.AdamW(param_groups(m), **ADAMW) for m in models]
    taken = [0, 0]
    for _ in range(3):
        for i in range(2):
            for _ in range(plan[i]):
                opts[i].zero_grad()
                loss_fn(models[i], micro_batch(taken[i], i, 0)).backward()
                opts[i].step()
                taken[i] += 1
        with torch.no_grad():
            for ps in zip(*(m.parameters() for m in models)):
                mean = (ps[0] + ps[1]) / 2
                for p in ps:
                    p.copy_(mean)
    return flat_params(models[0])


def test_plan_from_speeds_is_proportional_and_at_least_one():
    from quietsync.strategies.local.adaptive import plan_from_speeds

    assert plan_from_speeds([3.0, 1.0], 16) == [16, 5]
    assert plan_from_speeds([1.0, 1.0, 1.0], 8) == [8, 8, 8]
    assert plan_from_speeds([100.0, 1.0], 8) == [8, 1]
    assert plan_from_speeds([0.0, 0.0], 8) == [8, 8]  # nothing measured yet: synchronous


@pytest.mark.parametrize("strategy,config,message", [
    ("localsgd", {"inner_steps": "sometimes"}, "inner_steps must be one of fixed, adaptive"),
    ("localsgd", {"worker_speeds": (1.0, 2.0)}, "worker_speeds needs inner_steps adaptive"),
    ("diloco", {"inner_steps": "adaptive", "worker_speeds": (1.0, 0.0)}, "worker_speeds must be finite numbers > 0"),
    ("diloco", {"inner_steps": "adaptive", "inner": "ddp"}, "inner must be local with inner_steps adaptive"),
])
def test_bad_knobs_one_line(strategy, config, message):
    _, config_cls = quietsync.strategies.get(strategy)
    with pytest.raises(ValueError, match=message) as err:
        config_cls(**config)
    assert "\n" not in str(err.value)
