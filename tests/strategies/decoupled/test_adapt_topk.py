"""demo --adapt: the decision follows DeMo's cost (a link that drops picks a smaller top-k, one that recovers the
larger one back); a change of k only changes how much of the decoupled momentum the next extraction takes (the run
equals an independent fp64 reference from the DeMo equations whose k changes at the same step); a run that adapts
to the k it has is the static run bit for bit; a run resumed right after a change equals the unbroken one; bad
knobs are refused in one line."""

from __future__ import annotations

import io
import math

import pytest
import torch

import quietsync
from quietsync.cost.workload import Workload
from quietsync.strategies.decoupled.adapt_topk import DeMoConfig, TopkController, pick_topk
from quietsync.topology import Topology
from quietsync.wire.replicators import DCTReplicator
from tests.distributed import run_ranks
from tests.strategies.decoupled.test_demo_oracle import (
    MARGIN,
    MOMENTUM_ATOL,
    OPT_ORDER,
    SGD,
    THETA_ATOL,
    WDS,
    _grads,
    loss_fn,
    micro_batch,
    oracle_model,
)
from tests.strategies.helpers.common import param_groups, tiny_model
from tests.strategies.helpers.probe_fakes import FakeTransport
from tests.strategies.helpers.reference_demo import Base, Blocking, DCTReference, DecoupledGroup


# ---------------------------------------------------------------------------------------------- the decision
def _payload(k: int, shapes: list[tuple[int, ...]], chunk: int = 4) -> int:
    """By hand: DeMo's dct payload of one worker -- every block of every tensor sends min(k, block size) fp32
    values (4 B) and their positions (1 B for blocks of at most 256 coefficients)."""
    total = 0
    for shape in shapes:
        b = Blocking(tuple(shape), chunk)
        total += math.prod(b.grid) * min(k, math.prod(b.block)) * (4 + 1)
    return total


def _expected_k(candidates, shapes, bandwidth, step_s, overhead):
    """On 2 workers the all-gather sends the payload once: the exchange takes P(k)/β, all of it exposed (DeMo's
    exchange blocks), and adds P(k)/(β·step) to the compute. The pick: the largest k at or under the overhead,
    else the smallest."""
    fits = [k for k in candidates if _payload(k, shapes) / bandwidth / step_s <= overhead]
    return fits[0] if fits else candidates[-1]


def test_a_link_that_drops_picks_a_smaller_k_and_one_that_recovers_the_larger_one():
    model = tiny_model()
    shapes = [tuple(p.shape) for p in model.parameters()]
    workload = Workload.from_model(model, tokens_per_micro_batch=1, param_groups=param_groups(model))
    topo = Topology(0, 2, 2)
    cfg = DeMoConfig(chunk=4, topk=16, adapt=True)
    candidates = cfg.topk_candidates()
    assert candidates == (16, 8, 4, 2, 1)  # the default: k, k/2, ... k/16
    step_s = 1e-3
    picks = {}
    for mbit in (1000, 100, 30, 10, 0.01):
        bw = mbit * 1e6 / 8
        d = pick_topk(workload, topo, cfg, candidates, 16, step_s, bw, 0.1, "world")
        assert d.new == _expected_k(candidates, shapes, bw, step_s, 0.1), mbit
        assert d.share == pytest.approx(_payload(d.new, shapes) / bw / step_s, rel=1e-9)
        picks[mbit] = d.new
    assert picks[1000] == 16 > picks[100] > picks[30] > picks[10]  # the slower the link, the fewer coefficients
    assert picks[0.01] == 1 and "no k keeps the exchange under 10%" in d.why  # nothing fits: the smallest
    up = pick_topk(workload, topo, cfg, candidates, picks[10], step_s, 1e9 / 8, 0.1, "world")
    assert (up.old, up.new) == (picks[10], 16)  # the link back: the k the run was given


def test_the_controller_measures_the_link_and_the_step_and_follows_a_drop():
    """The controller's measurements (bytes/s of the exchanges from the meter, the median step) drive the pick; a
    link that drops 20x makes k shrink at the next decision, its recovery brings k back; step-time noise within
    the threshold re-picks nothing; the replicator sends the new k from then on."""
    model = tiny_model()
    shapes = [tuple(p.shape) for p in model.parameters()]
    cfg = DeMoConfig(chunk=4, topk=16, adapt=True, adapt_every=4, adapt_window=8)
    replicator = DCTReplicator(chunk=4, topk=16)
    transport = FakeTransport()
    ctrl = TopkController(transport, "world", cfg, replicator, model, param_groups(model))
    step_s = 2e-3
    step = 0

    def steps_at(bandwidth: float, steps_s: list[float]) -> object:
        nonlocal step
        decision = None
        for c in steps_s:
            step += 1
            payload = _payload(ctrl.topk, shapes)  # what this step's exchange sends at the current k
            transport.meter.sent += payload
            transport.meter.seconds += payload / bandwidth
            decision = ctrl.after_step(step, True, c) or decision
        return decision

    fast, slow = 100e6 / 8, 10e6 / 8
    assert steps_at(fast, [step_s] * 4) is None and ctrl.topk == 16  # the first decision keeps the largest
    assert [d["new"] for d in ctrl.decisions] == [16]
    d = steps_at(slow, [step_s] * 4)  # the link drops: a smaller k at the next decision
    assert d is not None and (d.old, d.new) == (16, _expected_k(ctrl.candidates, shapes, slow, step_s, 0.1))
    assert d.new < 16 and replicator.topk == d.new and ctrl.changed_at == step
    assert d.bandwidth == pytest.approx(slow) and d.step_s == pytest.approx(step_s)
    # noise: one step 50x slower in the window, the median does not move; no re-pick
    assert steps_at(slow, [step_s, 50 * step_s, step_s, step_s]) is None
    # steps 25% slower: within the threshold (1.5x), k stays
    assert steps_at(slow, [1.25 * step_s] * 4) is None and replicator.topk == d.new
    d = steps_at(fast, [step_s] * 4)  # the link recovers: back up
    assert d is not None and d.new == 16 and replicator.topk == 16
    assert [x["new"] for x in ctrl.decisions] == [16, 2, 16]
    # steps that do not replicate (--replicate-every) do not count towards a decision
    assert all(ctrl.after_step(step + i, False, step_s) is None for i in range(1, 9))
    # a checkpoint holds k, the exchanges counted and the last pick's ratio: a restored controller decides as this one
    steps_at(fast, [step_s] * 2)  # two exchanges towards the next decision
    plain = TopkController(transport, "world", cfg, DCTReplicator(chunk=4, topk=16), model, param_groups(model))
    plain.load_state_dict(ctrl.state_dict())
    logical = TopkController(transport, "world", cfg, DCTReplicator(chunk=4, topk=16), model, param_groups(model))
    saved = ctrl.logical_state()
    logical.load_logical({k: saved[k].clone() for k in logical.logical_targets({k: None for k in saved})})
    both = (ctrl, plain, logical)
    assert all((c.topk, c.cadence.count, c.cadence.ratio) == (16, 2, ctrl.cadence.ratio) for c in both)
    before = [len(c.decisions) for c in both]
    for bandwidth in [1.2 * fast] * 6 + [slow] * 4:  # within the threshold of the last pick, then a drop
        payload = _payload(16, shapes)
        transport.meter.sent += payload
        transport.meter.seconds += payload / bandwidth
        step += 1
        for c in both:
            c.after_step(step, True, step_s)
    assert [len(c.decisions) - b for c, b in zip(both, before)] == [1, 1, 1]  # the drop's decision only
    assert plain.decisions[-1]["new"] == logical.decisions[-1]["new"] == ctrl.decisions[-1]["new"] < 16


@pytest.mark.parametrize("knobs,match", [
    ({"adapt": True}, "topk must be given when adapt is on"),
    ({"adapt": True, "topk": 8, "replicator": "random"}, "replicator must be dct when adapt is on"),
    ({"adapt": True, "topk": 8, "chunk": 4, "adapt_topk": "4,8"}, "each once, largest first"),
    ({"adapt": True, "topk": 8, "chunk": 4, "adapt_topk": "32,8"}, r"from 1 to chunk\*\*2 \(16\)"),
    ({"adapt": True, "topk": 8, "chunk": 4, "adapt_topk": "8,x"}, "comma-separated"),
    ({"adapt": True, "topk": 8, "chunk": 4, "adapt_topk": "16,4"}, r"must include topk \(8\)"),
    ({"adapt_knobs": "H"}, "adapt_knobs must be topk"),
    ({"adapt_every": 0}, "adapt_every must be an integer >= 1"),
    ({"adapt_overhead": 0.0}, "adapt_overhead must be > 0"),
])
def test_bad_adapt_knobs(knobs, match):
    with pytest.raises(ValueError, match=match) as info:
        DeMoConfig(**knobs)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------- real processes
STEPS = 6
CHANGE = (2, 1)
"""k 3 -> 1 right after step 2."""
BASE = {"base": "sgd", "replicator": "dct", "chunk": 4, "topk": 3, "beta": 0.9}


def _build(config: dict) -> quietsync.Strategy:
    model = oracle_model()
    return quietsync.make_strategy("demo", model, torch.optim.AdamW, param_groups=param_groups(model),
                                   config=config, **SGD)


class _Stream:
    """The data position a logical checkpoint carries (these tests feed their own micro-batches)."""

    def logical_position(self) -> tuple[int, int]:
        return 0, 0

    def continue_from(self, epoch: int, consumed: int) -> None:
        pass


def _opt_params(strategy) -> list[torch.Tensor]:
    return [p for g in strategy.optimizer.param_groups for p in g["params"]]


def _run(rank: int, config: dict, change: tuple[int, int] | None = None, resume_at: int | None = None,
         logical: str | None = None) -> dict:
    """``STEPS`` steps; ``change = (s, k)``: k set right after step s (as a decision there would); ``resume_at``:
    checkpoint after that step and go on in a fresh strategy built with the original config (the rank's
    ``state_dict``, or with ``logical`` the world-size-independent checkpoint written there)."""
    from quietsync.train.logical_checkpoint import load_logical, save_logical

    s = _build(config)
    trace = []
    for t in range(1, STEPS + 1):
        s.backward(loss_fn(s.model, micro_batch(t - 1, rank)))
        assert s.step()
        m = s.last_step_metrics()
        delta = [s.optimizer.state[p]["delta"].detach().clone() for p in _opt_params(s)]
        if change is not None and change[0] == t:
            s.adapter.set_topk(change[1], t)
            # a change of k leaves the momentum as it is: what was not sent stays owed
            assert all(torch.equal(a, s.optimizer.state[p]["delta"]) for a, p in zip(delta, _opt_params(s)))
        trace.append({"adapt": m.extra.get("adapt"), "sent": m.bytes_by_group.get("world", {}).get("sent", 0),
                      "theta": [p.detach().clone() for p in s.module.parameters()], "delta": delta,
                      "topk": s.optimizer.replicator.topk})
        if resume_at == t:
            if logical is not None:
                save_logical(logical, s, _Stream(), 0)
            else:
                buf = io.BytesIO()
                torch.save(s.state_dict(), buf)
            s.close()
            s = _build(config)
            if logical is not None:
                load_logical(logical, s, _Stream())
            else:
                buf.seek(0)
                s.load_state_dict(torch.load(buf, weights_only=False))
    out = {"trace": trace, "decisions": list(s.adapter.decisions) if s.adapter else [],
           "shapes": [tuple(p.shape) for p in _opt_params(s)]}
    s.close()
    return out


def _jobs(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    return [_run(rank, **job) for job in jobs]


def _reference(change: tuple[int, int] | None) -> tuple[list, list, DecoupledGroup]:
    """DeMo-SGD on 2 workers from the paper's equations in fp64 (``reference_demo.py``), k per block 3, then
    ``change[1]`` from the step after ``change[0]`` -- the momenta carried as they are. Returns θ (model order) and
    every member's momentum (optimizer order) after each step."""
    theta = [p.detach().double() for p in oracle_model().parameters()]
    shapes = [tuple(theta[i].shape) for i in OPT_ORDER]
    group = DecoupledGroup([theta[i] for i in OPT_ORDER], 2, DCTReference(shapes, 4, [3] * len(shapes)),
                           Base("sgd", SGD["lr"], WDS, True), 0.9)
    thetas, momenta = [], []
    for s in range(STEPS):
        grads = [_grads(theta, r, s) for r in range(2)]
        group.step([[g[i] for i in OPT_ORDER] for g in grads])
        for k, i in enumerate(OPT_ORDER):
            theta[i] = group.theta[k].clone()
        thetas.append([t.clone() for t in theta])
        momenta.append([[d.clone() for d in member] for member in group.deltas])
        if change is not None and s + 1 == change[0]:
            group.replicator.ks = [change[1]] * len(shapes)
    return thetas, momenta, group


def _theta_gap(trace: list[dict], thetas: list) -> float:
    return max(float((a.double() - b).abs().max()) for t, ref in zip(trace, thetas) for a, b in zip(t["theta"], ref))


@pytest.mark.timeout(300)
def test_a_change_of_k_follows_demo_keeps_the_momentum_and_resumes_exactly(tmp_path):
    static = dict(BASE)
    # decides after every step; no emulated link, any k fits the budget: it keeps the largest, k = 3
    keep = {**BASE, "adapt": True, "adapt_topk": "3,2,1", "adapt_every": 1, "adapt_overhead": 1e9,
            "adapt_threshold": 0.0}
    forced = {**keep, "adapt_every": 1000}  # no decision of its own in these runs: k changes where the test says
    # a budget nothing fits: the controller's own first decision (after step 2) takes the smallest k
    tight = {**keep, "adapt_every": 2, "adapt_overhead": 1e-12}
    jobs = [
        {"config": static},
        {"config": keep},
        {"config": forced, "change": CHANGE},
        {"config": forced, "change": CHANGE, "resume_at": CHANGE[0]},  # checkpointed right after the change
        {"config": forced, "change": CHANGE, "resume_at": CHANGE[0], "logical": str(tmp_path / "logical")},
        {"config": tight},
    ]
    results = run_ranks(_jobs, 2, jobs, timeout=280)
    thetas, momenta, group = _reference(CHANGE)
    assert group.margins.topk_gap > MARGIN and group.margins.sign > MARGIN, group.margins  # a fair comparison
    static_thetas, _, _ = _reference(None)
    for rank, res in enumerate(results):
        st, kept, changed, resumed, resumed_logical, tight_run = res
        # adapt to the same knob = the static run, bit for bit, and it did decide (every step)
        assert len(kept["decisions"]) == STEPS and all(d["new"] == 3 for d in kept["decisions"])
        for a, b in zip(st["trace"], kept["trace"]):
            assert all(torch.equal(x, y) for x, y in zip(a["theta"], b["theta"]))
        # the change: the run equals the reference whose k changes after step 2, momenta carried
        assert [t["topk"] for t in changed["trace"]] == [3, 1, 1, 1, 1, 1]
        gap = _theta_gap(changed["trace"], thetas)
        assert gap < THETA_ATOL, gap
        for s, t in enumerate(changed["trace"]):
            for i, (lib, ref) in enumerate(zip(t["delta"], momenta[s][rank])):
                ref = Blocking(changed["shapes"][i], 4).encode(ref)
                torch.testing.assert_close(lib.double().reshape(-1), ref.reshape(-1), rtol=0, atol=MOMENTUM_ATOL)
        assert _theta_gap(changed["trace"], static_thetas) > 100 * THETA_ATOL  # the change did change the run
        # fewer coefficients sent from step 3 on: 1/3 of the values and positions of every block
        assert changed["trace"][2]["sent"] * 3 == changed["trace"][1]["sent"] == st["trace"][2]["sent"]
        # resumed right after the change = unbroken, bit for bit (k = 1 came back from the checkpoint)
        for again in (resumed, resumed_logical):
            assert [t["topk"] for t in again["trace"]] == [3, 1, 1, 1, 1, 1]
            for a, b in zip(changed["trace"], again["trace"]):
                assert all(torch.equal(x, y) for x, y in zip(a["theta"], b["theta"]))
        # the controller's own change is logged on the step it was taken, as DiLoCo's are (the plot reads it)
        logged = [t["adapt"] for t in tight_run["trace"] if t["adapt"] is not None]
        assert len(logged) == 1 and {k: logged[0][k] for k in ("step", "knob", "old", "new")} == {
            "step": 2, "knob": "topk", "old": 3, "new": 1}
        assert set(logged[0]) == {"step", "knob", "old", "new", "bandwidth_mbit", "step_s", "share", "why"}
        assert "no k keeps the exchange under" in logged[0]["why"]
        assert _theta_gap(tight_run["trace"], thetas) < THETA_ATOL  # the same run as the forced change at step 2


def test_the_planner_prior_widens_for_the_smallest_k_adapt_may_take():
    """The loss prior of demo --adapt is the chosen k's, its upper end widened by the assumed +3% per halving down
    to the smallest candidate (k/16 by default: 4 halvings)."""
    from quietsync.strategies.decoupled.facts import decoupled_prior

    static = decoupled_prior(DeMoConfig(topk=32), None)
    adapted = decoupled_prior(DeMoConfig(topk=32, adapt=True), None)
    assert adapted.penalty[:2] == static.penalty[:2]
    assert adapted.penalty[2] == pytest.approx(static.penalty[2] + 4 * 0.03)
    short = decoupled_prior(DeMoConfig(topk=32, adapt=True, adapt_topk="32,16"), None)
    assert short.penalty[2] == pytest.approx(static.penalty[2] + 0.03)


def test_the_planner_prior_of_a_given_topk_is_its_density_not_compression():
    """With the dct replicator's topk given, compression is unused: the prior reads topk / chunk**2 (DeMo's 1/85
    shown comparable to AdamW; each halving below it assumed +1%, up to +3%)."""
    from quietsync.strategies.decoupled.facts import decoupled_prior

    dense = decoupled_prior(DeMoConfig(topk=64, chunk=64, compression=1 / 1024), None)  # 1/64: above 1/85
    assert dense.penalty == decoupled_prior(DeMoConfig(compression=1 / 64), None).penalty
    assert dense.penalty[1] == 0.0
    sparse = decoupled_prior(DeMoConfig(topk=4, chunk=64, compression=1 / 16), None)  # 1/1024: 3.59 halvings
    halvings = math.log2(1024 / 85)
    assert sparse.penalty[1:] == pytest.approx((0.01 * halvings, 0.03 * halvings))


def test_the_planner_costs_adapt_at_the_k_its_controller_picks_on_each_link():
    """``cost.demo`` of an adapt config is the step at the k the controller's rule picks on that link (the hand
    rule above), so a varying link's stretches are each costed at their own k."""
    from quietsync.cost.compute import ComputeProfile
    from quietsync.cost.costmodel import Ctx, Links
    from quietsync.link import LinkModel
    from quietsync.strategies.decoupled import cost

    model = tiny_model()
    shapes = [tuple(p.shape) for p in model.parameters()]
    workload = Workload.from_model(model, tokens_per_micro_batch=1, param_groups=param_groups(model))
    topo = Topology(0, 2, 2)
    step_s = 2e-3
    compute = ComputeProfile(forward_s=step_s, backward_s=0.0, optimizer_s_per_element=0.0, elements=174)
    cfg = DeMoConfig(chunk=4, topk=16, adapt=True)
    schedule = cost.demo(workload, topo, cfg)
    assert schedule.label.endswith(" adapt")
    picked = set()
    for mbit in (1000, 30, 10, 0.01):
        bw = mbit * 1e6 / 8
        ctx = Ctx(compute, Links(model={"inter": LinkModel(bw, 0.0)}), topo)
        k = _expected_k(cfg.topk_candidates(), shapes, bw, step_s, 0.1)
        fixed = cost.demo(workload, topo, DeMoConfig(chunk=4, topk=k)).step.cost(ctx)
        got = schedule.step.cost(ctx)
        assert got.exposed_comm == pytest.approx(fixed.exposed_comm) and got.compute == pytest.approx(fixed.compute)
        picked.add(k)
    assert len(picked) == 4  # four links, four different picks


def test_a_decision_is_logged_as_diloco_logs_its_own_and_a_bad_k_is_refused():
    """The log entry has DiLoCo's keys (the run's plot and reports read both the same way); the replicator refuses a
    k outside 1..chunk**2 in one line."""
    from quietsync.strategies.decoupled.adapt_topk import TopkDecision
    from quietsync.strategies.local.adapt import Decision

    ours = TopkDecision(16, 4, 1.25e6, 2e-3, 0.05, "why").record(7)
    theirs = Decision(16, 32, "fp32", "fp32", 1.25e6, 2e-3, 0.05, "why").record(7)
    assert set(ours) == set(theirs) and ours["knob"] == "topk" and (ours["old"], ours["new"]) == (16, 4)
    assert ours["bandwidth_mbit"] == theirs["bandwidth_mbit"] == 10.0
    with pytest.raises(ValueError, match=r"topk must be an integer in \[1, ") as info:
        DCTReplicator(chunk=4, topk=8).set_topk(17)
    assert "\n" not in str(info.value)
