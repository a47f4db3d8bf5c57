"""Gradient clipping in the strategy contract: every strategy clips the gradient it commits by that gradient's
global norm (``max_grad_norm``), and reports the pre-clip norm in ``StepMetrics.extra["grad_norm"]``.

* ddp / zero1 / fsdp ≡ one process on the concatenated batch with ``torch.nn.utils.clip_grad_norm_`` (the
  oracle of DESIGN.md);
* acco / dpu / wp ≡ the papers' recurrences (``reference_recurrences``) whose optimizer clips the gradient of
  every step it takes;
* localsgd / diloco / demo / flexdemo clip the *local* (or node-averaged) gradient: a run with clipping equals
  a run without, fed each micro-batch loss times the clip factor a test-side reference computes from that
  gradient (the gradient is linear in the losses);
* cdp ≡ the paper's recurrence (``reference_cdp``) with each stage's gradient clipped by its own norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import quietsync
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model
from tests.strategies.helpers.overlap_common import det_count, flat, reference

OPT = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
SGD = {"lr": 5e-2, "momentum": 0.9}
MAX_NORM = 0.15  # the tiny model's averaged gradients have norms of 0.3-1: every step clips


# --------------------------------------------------------------------------- ddp / zero1 / fsdp: the oracle
def oracle(world: int, accumulation: int, steps: int, max_norm: float) -> tuple[list[torch.Tensor], list[float]]:
    """One process, plain torch: the mean gradient of every worker's micro-batches, clip_grad_norm_, AdamW."""
    model = tiny_model()
    opt = torch.optim.AdamW(param_groups(model), **OPT)
    thetas, norms = [], []
    for s in range(steps):
        opt.zero_grad()
        total = sum(loss_fn(model, micro_batch(s, r, a)) for r in range(world) for a in range(accumulation))
        (total / (world * accumulation)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        thetas.append(flat_params(model))
    return thetas, norms


def synchronous(rank: int, world: int, name: str, accumulation: int, steps: int, max_norm: float | None):
    model = tiny_model()
    strategy = quietsync.make_strategy(name, model, torch.optim.AdamW, param_groups=param_groups(model),
                                       config={"accumulation": accumulation}, max_grad_norm=max_norm, **OPT)
    thetas, extras = [], []
    for s in range(steps):
        for a in range(accumulation):
            strategy.forward_backward(micro_batch(s, rank, a), loss_fn)
            assert strategy.step() == (a == accumulation - 1)
        extras.append(dict(strategy.last_step_metrics().extra))
        with strategy.committed_params() as m:
            thetas.append(flat_params(m))
    strategy.close()
    return thetas, extras


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "world", "nodes"), [("ddp", 2, None), ("zero1", 2, None), ("fsdp", 4, 2)])
def test_synchronous_strategies_equal_one_process_with_clip_grad_norm(name, world, nodes):
    steps, accumulation = 4, 2
    want, norms = oracle(world, accumulation, steps, MAX_NORM)
    assert all(n > 2 * MAX_NORM for n in norms)  # the norm really clips, every step
    unclipped, _ = oracle(world, accumulation, steps, 1e9)
    assert (want[-1] - unclipped[-1]).abs().max() > 1e-3  # and clipping changes the trajectory
    for rank, (thetas, extras) in enumerate(run_ranks(synchronous, world, name, accumulation, steps, MAX_NORM,
                                                      nodes=nodes, timeout=200)):
        for s, (got, expected, extra, norm) in enumerate(zip(thetas, want, extras, norms)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"{name} rank {rank} step {s}")
            assert extra["grad_norm"] == pytest.approx(norm, rel=1e-5)
            assert extra["clipped"] is True


def test_without_clipping_nothing_is_measured_or_sent():
    thetas, extras = synchronous(0, 1, "zero1", 1, 2, None)
    assert extras == [{}, {}]


def test_bad_max_grad_norm_is_refused_at_construction():
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match=r"max_grad_norm must be a number > 0 \(inf: measure"):
            quietsync.make_strategy("ddp", tiny_model(), max_grad_norm=bad)


def test_an_infinite_max_grad_norm_measures_without_clipping():
    clipped, extras = synchronous(0, 1, "zero1", 1, 2, float("inf"))
    plain, _ = synchronous(0, 1, "zero1", 1, 2, None)
    want, norms = oracle(1, 1, 2, float("inf"))
    assert [e["grad_norm"] for e in extras] == pytest.approx(norms, rel=1e-5)
    assert [e["clipped"] for e in extras] == [False, False]
    assert torch.equal(clipped[-1], plain[-1])


# --------------------------------------------------------------------------- acco / dpu / wp: recurrences
@dataclass
class ClippedRef:
    """A pure reference optimizer whose every step first clips its gradient by its global norm."""

    inner: Any
    max_norm: float

    def init(self, params):
        return self.inner.init(params)

    def step(self, params, grad, state, lr):
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grad))
        coef = min(1.0, self.max_norm / (norm + 1e-6))
        return self.inner.step(params, [g * coef for g in grad], state, lr)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["acco", "dpu", "wp"])
def test_overlapped_strategies_clip_every_optimizer_step_of_their_recurrence(name):
    world, steps, max_norm = 2, 5, 0.05
    runs = [("adamw", {}), ("sgd", {})]
    results = run_ranks(run_many_clipped, world, name, runs, steps, max_norm, timeout=250)
    for i, (opt, _) in enumerate(runs):
        want = reference(name, world, opt, steps, wrap=lambda o: ClippedRef(o, max_norm))
        unclipped = reference(name, world, opt, steps)
        assert (flat(want.committed[-1]) - flat(unclipped.committed[-1])).abs().max() > 1e-3
        for rank, out in enumerate(results):
            assert out[i]["steps"] == steps
            torch.testing.assert_close(out[i]["theta"], flat(want.committed[-1]), rtol=1e-5, atol=1e-6,
                                       msg=f"{name} {opt} rank {rank}")
            assert all(e["clipped"] and e["grad_norm"] > max_norm for e in out[i]["extras"])


def run_many_clipped(rank: int, world: int, name: str, runs, steps: int, max_norm: float):
    from tests.strategies.helpers.overlap_common import run_deterministic

    return [run_deterministic(rank, world, name, opt, steps, extra, {"max_grad_norm": max_norm})
            for opt, extra in runs]


def test_dpu_reports_the_norm_of_the_gradient_it_applies():
    # one worker, no warm-up: step t applies the gradient computed at θ⁽ᵗ⁻¹⁾ (θ⁽⁰⁾ for the first two)
    out = run_many_clipped(0, 1, "dpu", [("sgd", {})], 3, 1e9)[0]
    want = reference("dpu", 1, "sgd", 3)
    model = tiny_model()
    names = [n for n, _ in model.named_parameters()]
    for k, extra in enumerate(out["extras"]):
        params = want.compute_params[k]
        grads = [torch.zeros_like(p) for p in params]
        for j in range(det_count(0)):
            leaves = [p.clone().requires_grad_() for p in params]
            call = lambda x, leaves=leaves: torch.func.functional_call(model, dict(zip(names, leaves)), (x,))  # noqa: E731
            g = torch.autograd.grad(loss_fn(call, micro_batch(0, 0, k * det_count(0) + j)), leaves)
            grads = [a + b for a, b in zip(grads, g)]
        norm = math.sqrt(sum(float((g / det_count(0)).pow(2).sum()) for g in grads))
        assert extra["grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert extra["clipped"] is False


# --------------------------------------------------------------------------- local and decoupled strategies
LOCAL_CASES = {
    # name: (world, nodes, config, which gradient is clipped)
    "localsgd": (2, None, {"sync_every": 2, "accumulation": 2}, "local"),
    "diloco": (2, None, {"sync_every": 2, "accumulation": 2}, "local"),
    "diloco_zero1": (4, 2, {"sync_every": 2, "inner": "zero1"}, "node"),
    # the random replicator picks positions by a shared seed, not by magnitude, so the update is linear in the
    # gradient (DCT top-k could pick another coefficient on a rounding-level tie)
    "demo": (2, None, {"accumulation": 2, "replicator": "random", "compression": 0.5, "sign": False}, "local"),
    "flexdemo": (4, 2, {"replicator": "random", "compression": 0.5, "sign": False, "params": "replicated"}, "node"),
    "flexdemo_fsdp2": (4, 2, {"replicator": "random", "compression": 0.5, "sign": False, "params": "sharded"},
                       "node"),
}


def _current(strategy, name: str) -> list[torch.Tensor]:
    """This worker's parameters as its next gradient sees them (whole)."""
    if name.startswith("flexdemo"):
        with strategy.committed_params() as m:  # whole (FSDP2: gathered inside the node)
            return [p.detach().clone() for p in m.parameters()]
    return [p.detach().clone() for p in strategy.module.parameters()]


def _reference_norm(params: list[torch.Tensor], ranks: list[int], step: int, accumulation: int) -> float:
    """‖mean over ``ranks`` and their micro-batches of ∇loss‖ at ``params`` (plain autograd)."""
    model = tiny_model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    total = sum(loss_fn(model, micro_batch(step, r, a)) for r in ranks for a in range(accumulation))
    grads = torch.autograd.grad(total / (len(ranks) * accumulation), list(model.parameters()))
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))


def local_run(rank: int, world: int, case: str, steps: int, max_norm: float, clip: bool):
    _, nodes, config, kind = LOCAL_CASES[case]
    name = case.split("_")[0]
    nodes = nodes or world
    per_node = world // nodes
    ranks = [rank] if kind == "local" else list(range(rank - rank % per_node, rank - rank % per_node + per_node))
    accumulation = config.get("accumulation", 1)
    model = tiny_model()
    strategy = quietsync.make_strategy(name, model, torch.optim.SGD, config=dict(config),
                                       max_grad_norm=max_norm if clip else None, **SGD)
    out: dict[str, list] = {"theta": [], "norm": [], "coef": []}
    for s in range(steps):
        if clip:
            coef = 1.0
        else:
            norm = _reference_norm(_current(strategy, case), ranks, s, accumulation)
            coef = min(1.0, max_norm / (norm + 1e-6))
            out["norm"].append(norm)
            out["coef"].append(coef)
        for a in range(accumulation):
            strategy.forward_backward(micro_batch(s, rank, a), lambda m, b, c=coef: c * loss_fn(m, b))
            assert strategy.step() == (a == accumulation - 1)
        if clip:
            out["norm"].append(strategy.last_step_metrics().extra["grad_norm"])
        out["theta"].append(torch.cat([p.reshape(-1) for p in _current(strategy, case)]))
    strategy.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(LOCAL_CASES))
def test_local_and_decoupled_strategies_clip_the_gradient_they_commit(case):
    world, nodes = LOCAL_CASES[case][:2]
    steps, max_norm = 4, 0.3
    clipped = run_ranks(local_run, world, case, steps, max_norm, True, nodes=nodes, timeout=250)
    scaled = run_ranks(local_run, world, case, steps, max_norm, False, nodes=nodes, timeout=250)
    assert any(c < 0.9 for out in scaled for c in out["coef"])  # clipping happens
    for rank, (a, b) in enumerate(zip(clipped, scaled)):
        for s in range(steps):
            assert a["norm"][s] == pytest.approx(b["norm"][s], rel=1e-5), f"{case} rank {rank} step {s}"
            torch.testing.assert_close(a["theta"][s], b["theta"][s], rtol=1e-5, atol=1e-6,
                                       msg=f"{case} rank {rank} step {s}")


# --------------------------------------------------------------------------- cdp: per-stage norms
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_cdp_clips_each_stage_by_its_own_norm(n, opt):
    from tests.strategies.cdp.test_cdp import OPTIMIZERS, data, mlp
    from tests.strategies.cdp.test_cdp import loss_fn as cdp_loss
    from tests.strategies.helpers.reference_cdp import reference_cdp

    steps, max_norm = 4, 0.05
    cls, kw = OPTIMIZERS[opt]
    model = mlp(n)
    stage_of = {name: int(name.split(".")[0]) + 1 for name, _ in model.named_parameters()}
    want = reference_cdp(model, cls(model.parameters(), **kw), stage_of, "v2", n, steps, data, cdp_loss,
                         stage_max_norm=max_norm)
    model = mlp(n)
    free = reference_cdp(model, cls(model.parameters(), **kw), stage_of, "v2", n, steps, data, cdp_loss)
    assert max((want[-1][k] - free[-1][k]).abs().max().item() for k in want[-1]) > 1e-3
    s = quietsync.make_strategy("cdp", mlp(n), cls, config={"rule": "v2", "stages": n}, max_grad_norm=max_norm,
                                **kw)
    got, k = [], 0
    while s.steps < steps:
        s.forward_backward(data(*divmod(k, n)), cdp_loss)
        k += 1
        if s.step():
            extra = s.last_step_metrics().extra
            assert len(extra["grad_norm_per_stage"]) == n
            assert all(x > max_norm for x in extra["grad_norm_per_stage"])
            assert extra["grad_norm"] == pytest.approx(math.sqrt(sum(x * x for x in extra["grad_norm_per_stage"])))
            with s.committed_params() as m:
                got.append(torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()]))
    s.close()
    for a, th in zip(got, want):
        torch.testing.assert_close(a, torch.cat([th[k].reshape(-1) for k in th]), atol=1e-6, rtol=1e-5)
