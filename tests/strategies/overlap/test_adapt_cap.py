"""acco (dpu, wp) --adapt: the cap on micro-batches per stage follows the strategy's own cost (the smallest cap whose
stage hides the job: a link that drops raises it, one that recovers lowers it, bounded by the user's limit); a run
that adapts to the cap it has is the static run bit for bit; a change takes effect at a stage boundary only, is
logged, keeps ACCO's recurrence (the run equals the reference replayed with its recorded counts), and a run resumed
right after it equals the unbroken one; bad knobs are refused in one line naming the flag."""

from __future__ import annotations

import io
import math

import pytest
import torch

from quietsync.cost.workload import Workload
from quietsync.link import LinkModel
from quietsync.strategies.overlap import cost
from quietsync.strategies.overlap.acco import ACCOConfig
from quietsync.strategies.overlap.adapt_cap import CapController, CapDecision, pick_cap
from quietsync.topology import Topology
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, param_groups, tiny_model
from tests.strategies.helpers.overlap_common import batch, flat, make, reference
from tests.strategies.helpers.probe_fakes import FakeTransport

RTOL, ATOL = 1e-5, 1e-6


# ---------------------------------------------------------------------------------------------- the decision
def _job_s(params: int, bandwidth: float) -> float:
    """By hand, one ACCO job on 2 workers (ring collectives, α = 0): the count all-reduce of 2 float64 per worker
    (each worker sends 2·(n-1)/n of its 32 bytes), the reduce-scatter of the fp32 gradients and the all-gather of the
    fp32 parameters of the flat buffer padded to a multiple of 2 (each sends half of it)."""
    padded = -(-params // 2) * 2
    return (32 + 2 * (padded * 4 // 2)) / bandwidth


def _expected_cap(candidates, params, bandwidth, micro_batch_s, overhead):
    """A stage capped at c ends when the job J does, or after c micro-batches (waiting for J): the communication
    exposed per micro-batch-time is max(0, J - c·m) / (c·m) at the cap, 0 below it. The pick: the smallest c whose
    exposed share is at most the overhead, i.e. c·m·(1 + overhead) >= J; none: the largest."""
    job = _job_s(params, bandwidth)
    fits = [c for c in candidates if c * micro_batch_s * (1 + overhead) >= job]
    return fits[0] if fits else candidates[-1]


def test_a_link_that_drops_raises_the_cap_and_one_that_recovers_lowers_it():
    model = tiny_model()
    workload = Workload.from_model(model, tokens_per_micro_batch=1, param_groups=param_groups(model))
    topo = Topology(0, 2, 2)
    cfg = ACCOConfig(max_accumulation=2, adapt=True)
    candidates = cfg.cap_candidates()
    assert candidates == tuple(range(1, 17))  # the default bound: 8 x the cap it starts from
    m = 1e-3
    picks = {}
    for mbit in (1000, 10, 3, 1, 0.5, 0.001):
        bw = mbit * 1e6 / 8
        d = pick_cap(cost.acco, workload, topo, cfg, candidates, 2, m, bw, 0.1, "world")
        assert d.new == _expected_cap(candidates, workload.params, bw, m, 0.1), mbit
        picks[mbit] = d.new
    assert picks[1000] == 1 < picks[3] < picks[1] < picks[0.5] < 16  # the slower the link, the larger the cap
    assert picks[0.001] == 16 and "no cap up to 16 hides the job" in d.why  # nothing hides it: the user's bound
    down = pick_cap(cost.acco, workload, topo, cfg, candidates, 16, m, 1e9 / 8, 0.1, "world")
    assert (down.old, down.new) == (16, 1)  # the link back: one micro-batch per stage hides the job again


class _Overlap:
    """The machinery's cap as the controller sees it (the real one is exercised by the runs below)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.group, self.stage_count = cap, "world", 0

    def set_cap(self, cap: int) -> None:
        self.cap = cap


def test_the_controller_decides_every_adapt_every_rounds_from_the_agreed_link_and_micro_batch():
    """The controller's own measurements (bytes/s of the transfers from the meter, the median micro-batch) are
    what a commit job agrees; a link that drops 10x raises the cap at the next decision, its recovery lowers it;
    noise within the threshold re-picks nothing; a round whose job carried no probe does not count."""
    model = tiny_model()
    params = Workload.from_model(model, tokens_per_micro_batch=1, param_groups=param_groups(model)).params
    cfg = ACCOConfig(max_accumulation=2, adapt=True, adapt_every=2, adapt_window=4)
    transport, overlap = FakeTransport(), _Overlap(2)
    ctrl = CapController(transport, overlap, cfg, model, param_groups(model), cost.acco)
    m, step = 1e-3, 0

    def rounds_at(bandwidth: float, mb: list[float], n: int = 2) -> CapDecision | None:
        nonlocal step
        decision = None
        for _ in range(n):
            step += 1
            for s in mb:
                ctrl.micro_batch(s)
            transport.meter.sent += 1e4  # what the round's jobs sent, over the link's time for it
            transport.meter.seconds += 1e4 / bandwidth
            decision = ctrl.after_round(step, ctrl.measure()) or decision  # one worker: the agreed pair is its own
        return decision

    fast, slow = 1e9 / 8, 0.5e6 / 8
    assert rounds_at(fast, [m] * 2, n=1) is None and ctrl.rounds == 1  # one round: no decision yet
    d = rounds_at(fast, [m] * 2, n=1)  # the first decision: one micro-batch hides the job on this link
    assert d is not None and (d.old, d.new) == (2, 1) == (2, _expected_cap(ctrl.candidates, params, fast, m, 0.1))
    d = rounds_at(slow, [m] * 4)  # the link drops: a larger cap at the next decision
    assert d is not None and d.new == _expected_cap(ctrl.candidates, params, slow, m, 0.1) > 1
    assert overlap.cap == d.new and ctrl.changed_at == step and d.bandwidth == pytest.approx(slow)
    assert rounds_at(slow, [m, 50 * m, m, m]) is None  # one slow micro-batch: the median does not move
    assert rounds_at(slow, [1.25 * m] * 4) is None and overlap.cap == d.new  # within the threshold (1.5x)
    d = rounds_at(fast, [m] * 4)  # the link recovers: back down
    assert d is not None and d.new == 1 and overlap.cap == 1
    assert ctrl.after_round(step + 1, None) is None and ctrl.rounds == 0  # no probe carried: not counted
    # a checkpoint holds the cap, the rounds and the hysteresis' reference: a restored controller decides as this one
    ctrl.after_round(step + 1, (fast, m))  # one round towards the next decision
    plain = CapController(transport, _Overlap(2), cfg, model, param_groups(model), cost.acco)
    plain.load_state_dict(ctrl.state_dict())
    logical = CapController(transport, _Overlap(2), cfg, model, param_groups(model), cost.acco)
    saved = ctrl.logical_state()
    targets = logical.logical_targets({k: (tuple(v.shape), v.dtype) for k, v in saved.items()})
    logical.load_logical({k: saved[k].clone() for k in targets})
    assert all((c.cap, c.rounds, c.changed_at) == (1, 1, ctrl.changed_at) for c in (plain, logical))
    seen: dict[int, list] = {id(c): [] for c in (ctrl, plain, logical)}
    for i, pair in enumerate([(1.2 * fast, m), (1.2 * fast, m), (slow, m), (slow, m)]):
        for c in (ctrl, plain, logical):  # a 20% faster link: within the threshold of the last pick; then a drop
            d = c.after_round(step + 2 + i, pair)
            seen[id(c)].append(None if d is None else (d.old, d.new))
    assert seen[id(plain)] == seen[id(logical)] == seen[id(ctrl)]
    assert [x is None for x in seen[id(ctrl)]] == [True, True, False, True]  # adapt_every 2: decisions at 0 and 2
    # the decision at 0 was held by the restored reference (moved too little: not even taken); a controller without
    # it would have taken it (and logged a keep)
    assert len(plain.decisions) == len(logical.decisions) == 1


@pytest.mark.parametrize("knobs,match", [
    ({"adapt": True}, r"max_accumulation must be given when adapt is on"),
    ({"adapt": True, "max_accumulation": 2, "deterministic_accumulation": 2},
     r"deterministic_accumulation must not be given when adapt is on"),
    ({"adapt": True, "max_accumulation": 4, "adapt_max_accumulation": 2},
     r"adapt_max_accumulation must be >= max_accumulation \(4\), got 2"),
    ({"adapt_max_accumulation": 0}, r"adapt_max_accumulation must be an integer >= 1"),
    ({"adapt_knobs": "topk"}, r"adapt_knobs must be cap \(acco, dpu and wp"),
    ({"adapt_every": 0}, r"adapt_every must be an integer >= 1"),
    ({"adapt_overhead": 0.0}, r"adapt_overhead must be > 0"),
])
def test_bad_adapt_knobs(knobs, match):
    with pytest.raises(ValueError, match=match) as info:
        ACCOConfig(**knobs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("argv,expect", [
    (["--strategy", "acco", "--adapt"], "--max-accumulation must be given when adapt is on (--adapt"),
    (["--strategy", "acco", "--adapt", "--max-accumulation", "2", "--deterministic-accumulation", "2"],
     "--deterministic-accumulation must not be given when adapt is on (it fixes"),
    (["--strategy", "acco", "--adapt", "--max-accumulation", "4", "--adapt-max-accumulation", "2"],
     "--adapt-max-accumulation must be >= --max-accumulation (4), got 2"),
    (["--strategy", "acco", "--adapt-max-accumulation", "8"], "--adapt-max-accumulation needs --adapt"),
    (["--strategy", "wp", "--adapt", "--max-accumulation", "2", "--adapt-knobs", "topk"],
     "--adapt-knobs must be cap (acco, dpu and wp re-pick their cap on micro-batches per stage, "
     "--max-accumulation, only), got 'topk'"),
    (["--strategy", "cdp", "--adapt"], "--adapt is not a flag of strategy cdp (it belongs to acco, demo, diloco, dpu"),
])
def test_the_cli_refuses_bad_adapt_flags_in_one_line(argv, expect, capsys):
    from quietsync.train.args import parse_train_args

    with pytest.raises(SystemExit) as e:
        parse_train_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and expect in err, err


# ---------------------------------------------------------------------------------------------- real processes
STEPS = 4
SLOW = (1e9, 0.05)
"""The link (bytes/s, seconds per message) of the runs that change the cap: each job waits 4 messages x 50 ms, far
longer than 3 micro-batches of the tiny model, so a capped stage always reaches its cap (its count is the cap, not
a race with the job)."""
FAST = (1e9, 0.001)


class _Stream:
    """The data position a logical checkpoint carries (these tests feed their own micro-batches)."""

    def logical_position(self) -> tuple[int, int]:
        return 0, 0

    def continue_from(self, epoch: int, consumed: int) -> None:
        pass


def _run(rank: int, config: dict, link: tuple[float, float], resume_at: int | None = None, logical: str | None = None,
         name: str = "acco") -> dict:
    """``STEPS`` committed steps of ``name`` on ``link``; ``resume_at``: checkpoint right after that step and go on in a
    fresh strategy built with the same config (the rank's ``state_dict``, or with ``logical`` the
    world-size-independent checkpoint written there)."""
    from quietsync.train.logical_checkpoint import load_logical, save_logical
    from quietsync.transport import Transport

    transport = Transport(Topology.from_env(), links={"inter": LinkModel(*link)})
    s = make(name, "adamw", config, transport=transport)
    index, trace, refused = 0, [], None
    while s.steps < STEPS:
        s.backward(loss_fn(s.model, batch(rank, index)))
        index += 1
        if s.adapter is not None and refused is None and s.overlap.stage_count == 1:
            try:  # a stage is open: the cap does not change half-way through it
                s.adapter.set_cap(s.overlap.cap, s.steps)
            except RuntimeError as e:
                refused = str(e)
        if not s.step():
            continue
        # the model's parameters: θ (acco right after a commit, dpu), wp's prediction (its committed θ is gathered
        # at the end only: a gather now would wait for the update just submitted and shorten the next stage)
        trace.append({"theta": flat_params(s.module), "cap": s.overlap.cap,
                      "adapt": s.last_step_metrics().extra.get("adapt")})
        if resume_at == s.steps:
            if logical is not None:
                save_logical(logical, s, _Stream(), 0)
            else:
                buf = io.BytesIO()
                torch.save(s.state_dict(), buf)
            s.close()
            s = make(name, "adamw", config, transport=transport)
            if logical is not None:
                load_logical(logical, s, _Stream())
            else:
                buf.seek(0)
                s.load_state_dict(torch.load(buf, weights_only=False))
    with s.committed_params() as model:
        final = flat_params(model)
    out = {"trace": trace, "final": final, "history": list(s.overlap.stage_history), "refused": refused,
           "decisions": list(s.adapter.decisions) if s.adapter is not None else []}
    s.close()
    transport.close()
    return out


def _jobs(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    return [_run(rank, **job) for job in jobs]


@pytest.mark.timeout(120)
def test_a_cap_change_is_exact_logged_at_a_stage_boundary_and_resumes_exactly(tmp_path):
    # min = max = 2: every stage holds exactly 2 micro-batches, whatever the timing
    static = {"min_accumulation": 2, "max_accumulation": 2}
    # decides every round; any cap fits so large a budget: it keeps the smallest, 2
    keep = {**static, "adapt": True, "adapt_max_accumulation": 3, "adapt_every": 1, "adapt_overhead": 1e9,
            "adapt_threshold": 0.0}
    # starts capped at 3 (on the slow link every stage reaches it); its first decision, after step 2, takes the
    # smallest cap, 2 (= min_accumulation: stages after it, also right after a resume, hold exactly 2)
    change = {**static, "max_accumulation": 3, "adapt": True, "adapt_every": 2, "adapt_overhead": 1e9}
    jobs = [
        {"config": static, "link": FAST},
        {"config": keep, "link": FAST},
        {"config": change, "link": SLOW},
        {"config": change, "link": SLOW, "resume_at": 2},  # checkpointed right after the change
        {"config": change, "link": SLOW, "resume_at": 2, "logical": str(tmp_path / "logical")},
    ]
    results = run_ranks(_jobs, 2, jobs, timeout=110)
    for st, kept, changed, resumed, resumed_logical in results:
        # adapt to the same knob = the static run, bit for bit, and it did decide (every round)
        assert [d["new"] for d in kept["decisions"]] == [2] * STEPS
        assert all(t["adapt"] is None for t in kept["trace"])  # no change, nothing logged in the step records
        for a, b in zip(st["trace"], kept["trace"], strict=True):
            assert torch.equal(a["theta"], b["theta"])
        # the change: logged on the step it was taken (the keys the plot reads), in force from the next stage
        logged = [t["adapt"] for t in changed["trace"] if t["adapt"] is not None]
        assert len(logged) == 1 and {k: logged[0][k] for k in ("step", "knob", "old", "new")} == {
            "step": 2, "knob": "cap", "old": 3, "new": 2}
        assert set(logged[0]) == {"step", "knob", "old", "new", "bandwidth_mbit", "step_s", "share", "why"}
        assert [t["cap"] for t in changed["trace"]] == [3, 2, 2, 2]
        # stages handed over: the initial one (min_accumulation), then the 4 up to step 2's commit at cap 3, the
        # rest at cap 2 -- the stage open at the change was the first under the new cap, none was cut
        counts = [c[0] for c in changed["history"]]
        assert counts[:5] == [2, 3, 3, 3, 3] and set(counts[5:]) == {2}, counts
        assert "only at a stage boundary" in changed["refused"]
        # ACCO's recurrence with the counts the run had: the change kept it exact
        expected = reference("acco", 2, "adamw", STEPS, counts=changed["history"]).committed
        for t, theta in zip(changed["trace"], expected, strict=True):
            torch.testing.assert_close(t["theta"], flat(theta), rtol=RTOL, atol=ATOL)
        # resumed right after the change = unbroken, bit for bit (the cap 2 came back from the checkpoint)
        for again in (resumed, resumed_logical):
            assert [t["cap"] for t in again["trace"]] == [3, 2, 2, 2]
            for a, b in zip(changed["trace"], again["trace"], strict=True):
                assert torch.equal(a["theta"], b["theta"])


@pytest.mark.timeout(120)
def test_dpu_and_wp_adapt_their_cap_the_same_way(tmp_path):
    """The same machinery under DPU's and WP's one stage per step: the first update job carries no probe (the fill
    stage's), so the first decision is at step 2; the run equals the DPU/WP recurrence replayed with its counts,
    and resumed right after the change (logical checkpoint: the drained update job keeps its probe) it equals the
    unbroken run."""
    static = {"min_accumulation": 2, "max_accumulation": 2}
    keep = {**static, "adapt": True, "adapt_max_accumulation": 3, "adapt_overhead": 1e9, "adapt_threshold": 0.0}
    change = {**static, "max_accumulation": 3, "adapt": True, "adapt_overhead": 1e9}
    jobs = []
    for name in ("dpu", "wp"):
        jobs += [{"config": static, "link": FAST, "name": name}, {"config": keep, "link": FAST, "name": name},
                 {"config": change, "link": SLOW, "name": name},
                 {"config": change, "link": SLOW, "name": name, "resume_at": 2,
                  "logical": str(tmp_path / f"logical_{name}")}]
    results = run_ranks(_jobs, 2, jobs, timeout=110)
    for res in results:
        for name, (st, kept, changed, resumed) in zip(("dpu", "wp"), (res[:4], res[4:])):
            assert [d["new"] for d in kept["decisions"]] == [2] * (STEPS - 1), name  # every update but the fill's
            for a, b in zip(st["trace"], kept["trace"], strict=True):
                assert torch.equal(a["theta"], b["theta"]), name
            logged = [t["adapt"] for t in changed["trace"] if t["adapt"] is not None]
            assert [(x["step"], x["knob"], x["old"], x["new"]) for x in logged] == [(2, "cap", 3, 2)]
            assert [t["cap"] for t in changed["trace"]] == [3, 2, 2, 2], name
            counts = [c[0] for c in changed["history"]]
            assert counts[:3] == [2, 3, 3] and set(counts[3:]) == {2}, (name, counts)
            assert "only at a stage boundary" in changed["refused"]
            expected = reference(name, 2, "adamw", STEPS, counts=changed["history"]).committed
            torch.testing.assert_close(changed["final"], flat(expected[-1]), rtol=RTOL, atol=ATOL, msg=name)
            if name == "dpu":  # its model holds θ after every step (wp's: the prediction)
                for t, theta in zip(changed["trace"], expected, strict=True):
                    torch.testing.assert_close(t["theta"], flat(theta), rtol=RTOL, atol=ATOL, msg=name)
            assert [t["cap"] for t in resumed["trace"]] == [3, 2, 2, 2], name
            for a, b in zip(changed["trace"], resumed["trace"], strict=True):
                assert torch.equal(a["theta"], b["theta"]), name


def test_the_planner_costs_adapt_at_the_cap_its_controller_picks_on_each_link():
    """``cost.acco`` of an adapt config is the step at the cap the controller's rule picks on that link (the hand
    rule above), and its commit job's count all-reduce carries the two agreed floats per worker."""
    from quietsync.cost.compute import ComputeProfile
    from quietsync.cost.costmodel import Ctx, Links

    model = tiny_model()
    workload = Workload.from_model(model, tokens_per_micro_batch=1, param_groups=param_groups(model))
    topo = Topology(0, 2, 2)
    m = 1e-3
    compute = ComputeProfile(forward_s=m, backward_s=0.0, optimizer_s_per_element=0.0, elements=workload.params)
    cfg = ACCOConfig(max_accumulation=2, adapt=True)
    schedule = cost.acco(workload, topo, cfg)
    assert schedule.label.endswith(" adapt")
    static = cost.acco(workload, topo, ACCOConfig(max_accumulation=2))
    assert sum(c.nbytes for c in schedule.comms) - sum(c.nbytes for c in static.comms) == 16 * 2
    picked = set()
    for mbit in (1000, 3, 1, 0.001):
        bw = mbit * 1e6 / 8
        ctx = Ctx(compute, Links(model={"inter": LinkModel(bw, 0.0)}), topo)
        c = _expected_cap(cfg.cap_candidates(), workload.params, bw, m, 0.1)
        fixed = cost.acco(workload, topo, ACCOConfig(max_accumulation=c)).step.cost(ctx)
        got = schedule.step.cost(ctx)
        assert got.time == pytest.approx(fixed.time) and got.compute == pytest.approx(fixed.compute)
        assert math.isclose(got.exposed_comm, fixed.exposed_comm, abs_tol=1e-12)
        picked.add(c)
    assert len(picked) == 4  # four links, four different caps
