"""diloco --adapt: the decision follows the cost model (a link that drops picks a larger H); a run that adapts to the
knob it has is the static run bit for bit; a change of H keeps the DiLoCo recurrence (an independent reference
with the changed sync steps), resumes exactly from a checkpoint taken after it, and finishes without a spurious
sync; bad knobs are refused in one line."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import quietsync
from quietsync.cost.workload import Workload
from quietsync.strategies.local.adapt import pick_sync_every
from quietsync.strategies.local.diloco import DiLoCoConfig
from quietsync.topology import Topology
from tests.distributed import run_ranks
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model
from tests.strategies.helpers.local_common import ADAMW
from tests.strategies.helpers.probe_fakes import FakeTransport
from tests.strategies.helpers.reference_local import _group_order, _inner_step, _replicas

PSI = 174  # parameters of the tiny model


# ---------------------------------------------------------------------------------------------- the decision
def _expected_h(candidates, bandwidth, step_s, overhead):
    """By hand: DiLoCo with one fragment all-reduces its fp32 pseudo-gradient (4·Ψ bytes) once per H inner
    steps; on 2 workers a ring all-reduce sends B, so the sync takes 4Ψ/β and adds 4Ψ/(β·H·step) to the compute.
    The pick: the smallest H at or under the overhead, else the largest."""
    fits = [h for h in candidates if 4 * PSI / bandwidth / (h * step_s) <= overhead]
    return fits[0] if fits else candidates[-1]


def test_a_link_that_drops_picks_a_larger_h_and_one_that_recovers_a_smaller_one():
    model = tiny_model()
    workload = Workload.from_model(model, tokens_per_micro_batch=1, param_groups=param_groups(model))
    topo = Topology(0, 2, 2)
    cfg = DiLoCoConfig(sync_every=8, adapt=True, adapt_sync_every="2,4,8,16,32,64,128")
    assert DiLoCoConfig(sync_every=8, adapt=True).adapt_candidates(8, 1, 0) == (8, 16, 32, 64, 128)  # the default
    candidates = cfg.adapt_candidates(8, 1, 0)
    assert candidates == (2, 4, 8, 16, 32, 64, 128)
    step_s = 1e-3
    picks = {}
    for mbit in (100, 10, 1, 0.01):
        bw = mbit * 1e6 / 8
        d = pick_sync_every(workload, topo, cfg, candidates, 8, step_s, bw, 0.1, "world")
        assert d.new == _expected_h(candidates, bw, step_s, 0.1), mbit
        assert d.share == pytest.approx(4 * PSI / bw / (d.new * step_s), rel=1e-9)
        picks[mbit] = d.new
    assert picks[100] < picks[10] < picks[1]  # the slower the link, the larger H
    assert picks[0.01] == 128 and "no H keeps the sync under 10%" in d.why  # nothing fits: the largest
    # back up from 1 Mbit/s to 100 Mbit/s: back down to the small H
    up = pick_sync_every(workload, topo, cfg, candidates, picks[1], step_s, 100e6 / 8, 0.1, "world")
    assert (up.old, up.new) == (picks[1], picks[100])


def test_overlap_hides_the_sync_so_a_smaller_h_fits():
    """With τ > 0 the exchange runs behind τ inner steps (the cost model's Exposed term): only what sticks out
    counts, so the same link allows a smaller H than without overlap."""
    model = tiny_model()
    workload = Workload.from_model(model, tokens_per_micro_batch=1, param_groups=param_groups(model))
    topo = Topology(0, 2, 2)
    bw, step_s = 1e6 / 8, 1e-3  # 1 Mbit/s: a sync takes 5.6 ms, 5.6 inner steps
    blocking = DiLoCoConfig(sync_every=8, adapt=True)
    overlapped = DiLoCoConfig(sync_every=8, overlap_delay=4, adapt=True)
    h0 = pick_sync_every(workload, topo, blocking, (4, 8, 16, 32, 64, 128), 8, step_s, bw, 0.1, "world").new
    h1 = pick_sync_every(workload, topo, overlapped, (4, 8, 16, 32, 64, 128), 8, step_s, bw, 0.1, "world").new
    assert h0 == _expected_h((4, 8, 16, 32, 64, 128), bw, step_s, 0.1) == 64
    exposed = 4 * PSI / bw - 4 * step_s  # what sticks out of the 4 overlapped steps
    assert h1 == next(h for h in (4, 8, 16, 32, 64, 128) if exposed / (h * step_s) <= 0.1) == 16


def test_the_controller_measures_the_link_and_the_step_and_follows_a_drop():
    """The controller's measurements (bytes/s of the syncs from the meter, the median step) drive the pick; a
    link that drops 10x makes H grow at the next decision, its recovery brings H back; step-time noise within the
    threshold re-picks nothing."""
    from quietsync.strategies.local.adapt import SyncPeriod

    model = tiny_model()
    cfg = DiLoCoConfig(sync_every=8, adapt=True, adapt_window=8, adapt_sync_every="2,4,8,16,32,64,128")
    transport = FakeTransport()
    ctrl = SyncPeriod(transport, "world", cfg, model, param_groups(model))
    sync_bytes = 4 * PSI  # what a sync sends on 2 workers (ring all-reduce of the fp32 pseudo-gradient)
    step_s = 1e-3
    step = 0

    def round_at(bandwidth: float, steps_s: list[float]) -> object:
        nonlocal step
        decision = None
        for c in steps_s:
            step += 1
            synced = step % ctrl.sync_every == 0
            if synced:  # the sync's bytes and seconds, as the transport meters them
                transport.meter.sent += sync_bytes
                transport.meter.seconds += sync_bytes / bandwidth
            decision = ctrl.after_inner_step(step, synced, c) or decision
        return decision

    fast, slow = 100e6 / 8, 10e6 / 8
    d = round_at(fast, [step_s] * 8)  # the first decision: picks for the measured link
    assert d is not None and d.new == _expected_h(ctrl.candidates, fast, step_s, 0.1) == 2
    assert d.bandwidth == pytest.approx(fast) and d.step_s == pytest.approx(step_s)
    # noise: one step 50x slower in the window, the median does not move; no re-pick
    assert round_at(fast, [step_s, 50 * step_s]) is None
    # the link drops 10x: the next decision picks a larger H
    d = round_at(slow, [step_s] * 2)
    assert d is not None and (d.old, d.new) == (2, _expected_h(ctrl.candidates, slow, step_s, 0.1)) == (2, 8)
    assert cfg.sync_every == 8 and ctrl.schedule.H == 8 and ctrl.changed_at == step
    # steps 25% slower: within the threshold (1.5x), H stays
    assert round_at(slow, [1.25 * step_s] * 8) is None and ctrl.sync_every == 8
    # the link recovers: back down
    d = round_at(fast, [step_s] * 8)
    assert d is not None and (d.old, d.new) == (8, 2)
    assert [x["new"] for x in ctrl.decisions] == [2, 8, 2]
    # a checkpoint holds H and the last pick's ratio (the hysteresis' reference): a restored controller decides as
    # this one
    plain = SyncPeriod(transport, "world", copy.deepcopy(cfg), model, param_groups(model))
    plain.load_state_dict(ctrl.state_dict())
    logical = SyncPeriod(transport, "world", copy.deepcopy(cfg), model, param_groups(model))
    saved = ctrl.logical_state()
    logical.load_logical({k: saved[k].clone() for k in logical.logical_targets({k: None for k in saved})})
    three = (ctrl, plain, logical)
    assert all((c.sync_every, c.cadence.ratio) == (2, ctrl.cadence.ratio) for c in three)
    before = [len(c.decisions) for c in three]
    for bandwidth in [1.2 * fast] * 2 + [slow]:  # within the threshold of the last pick, then a drop
        for _ in range(2):
            step += 1
            if step % 2 == 0:
                transport.meter.sent += sync_bytes
                transport.meter.seconds += sync_bytes / bandwidth
            for c in three:
                c.after_inner_step(step, step % 2 == 0, step_s)
    assert [len(c.decisions) - b for c, b in zip(three, before)] == [1, 1, 1]  # the drop's decision only
    assert plain.sync_every == logical.sync_every == ctrl.sync_every == 8


@pytest.mark.parametrize("knobs,match", [
    ({"sync_every": 8, "adapt": True, "fragments": 2}, "adapt changes its knobs only with fragments 1"),
    ({"sync_every": 8, "adapt": True, "adapt_sync_every": "8,12"}, "each dividing the next"),
    ({"sync_every": 8, "adapt": True, "adapt_sync_every": "4,x"}, "adapt_sync_every must be whole numbers"),
    ({"sync_every": 8, "adapt": True, "adapt_sync_every": "16,32"}, "must include sync_every"),
    ({"sync_every": 8, "adapt": True, "overlap_delay": 4, "adapt_sync_every": "2,4,8"}, ">= overlap_delay"),
    ({"sync_every": 8, "adapt_every": 0}, "adapt_every must be an integer >= 1"),
    ({"sync_every": 8, "adapt_overhead": 0.0}, "adapt_overhead must be > 0"),
])
def test_bad_adapt_knobs(knobs, match):
    with pytest.raises(ValueError, match=match):
        DiLoCoConfig(**knobs)


# ---------------------------------------------------------------------------------------------- real processes
def _build(config: dict) -> quietsync.Strategy:
    model = tiny_model()
    return quietsync.make_strategy("diloco", model, torch.optim.AdamW, param_groups=param_groups(model),
                                   config=config, **ADAMW)


class _Stream:
    """The data position a logical checkpoint carries (these tests feed their own micro-batches)."""

    def logical_position(self) -> tuple[int, int]:
        return 0, 0

    def continue_from(self, epoch: int, consumed: int) -> None:
        pass


def _run(rank: int, config: dict, steps: int, change: tuple[int, int] | None = None, resume_at: int | None = None,
         finish: bool = False, logical: str | None = None) -> dict:
    """``steps`` inner steps; ``change = (s, H)``: H set right after step s (as a decision there would);
    ``resume_at``: checkpoint after that step and go on in a fresh strategy built with the original config (the
    rank's ``state_dict``, or with ``logical`` the world-size-independent checkpoint written there)."""
    from quietsync.train.logical_checkpoint import load_logical, save_logical

    s = _build(config)
    trace = []
    for t in range(1, steps + 1):
        s.forward_backward(micro_batch(t - 1, rank, 0), loss_fn)
        assert s.step()
        m = s.last_step_metrics()
        if change is not None and change[0] == t:
            s.adapter.set_sync_every(change[1], t)
        trace.append({"synced": m.extra["synced"], "adapt": m.extra.get("adapt"), "params": flat_params(s.module)})
        if resume_at == t and logical is not None:
            save_logical(logical, s, _Stream(), 0)
            s.close()
            s = _build(config)
            load_logical(logical, s, _Stream())
        elif resume_at == t:
            buf = io.BytesIO()
            torch.save(s.state_dict(), buf)
            s.close()
            s = _build(config)
            buf.seek(0)
            s.load_state_dict(torch.load(buf, weights_only=False))
    if finish:
        s.finish()
    with s.committed_params():
        committed = flat_params(s.module)
    out = {"trace": trace, "committed": committed, "params": flat_params(s.module),
           "sync_every": s.config.sync_every, "decisions": list(s.adapter.decisions) if s.adapter else []}
    s.close()
    return out


def _jobs(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    return [_run(rank, **job) for job in jobs]


def _reference(sync_steps: set[int], steps: int, finish: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
    """DiLoCo on 2 replicas from the paper's equations, syncing after exactly the steps in ``sync_steps``:
    Δ = mean_k(θ_g − θ_k); b ← μb + Δ (b = Δ the first time); θ_g ← θ_g − lr(Δ + μb) (Nesterov); θ_k ← θ_g.
    ``finish``: one more sync if steps were taken since the last one, then every replica takes θ_g."""
    lr, mu = 0.7, 0.9
    models, opts = _replicas(2, lambda g: torch.optim.AdamW(g, **ADAMW))
    order = _group_order(models[0])
    theta_g = [p.detach().clone() for p in models[0].parameters()]
    buf: dict[int, torch.Tensor] = {}

    def sync() -> None:
        with torch.no_grad():
            for i in order:
                delta = torch.stack([theta_g[i] - list(m.parameters())[i] for m in models]).mean(0)
                buf[i] = delta.clone() if i not in buf else mu * buf[i] + delta
                theta_g[i] = theta_g[i] - lr * (delta + mu * buf[i])
            for m in models:
                for p, g in zip(m.parameters(), theta_g):
                    p.copy_(g)

    last = 0
    for s in range(1, steps + 1):
        for k in range(2):
            _inner_step(models[k], opts[k], s - 1, range(k, k + 1), 1)
        if s in sync_steps:
            sync()
            last = s
    if finish and last < steps:
        sync()
    return [flat_params(m) for m in models], torch.cat([g.reshape(-1) for g in theta_g])


@pytest.mark.timeout(240)
def test_adapt_knob_changes_follow_diloco_and_resume_exactly(tmp_path):
    static = {"sync_every": 2}
    keep = {"sync_every": 2, "adapt": True, "adapt_sync_every": "2,4,8,16", "adapt_overhead": 1e9,
            "adapt_threshold": 0.0}
    forced = {**keep, "adapt_every": 1000}  # no decision of its own in these runs: H changes where the test says
    jobs = [
        {"config": static, "steps": 8},
        # decides after every sync; no emulated link, any H fits the budget: it keeps the smallest, H = 2
        {"config": keep, "steps": 8},
        # H 2 -> 8 right after step 6 (not a multiple of 8): a short round to step 8, then every 8 steps
        {"config": forced, "steps": 17, "change": (6, 8)},
        # the same, checkpointed after step 7 (after the change, mid-round) and resumed in a fresh strategy
        {"config": forced, "steps": 17, "change": (6, 8), "resume_at": 7},
        # the same through the logical (world-size-independent) checkpoint
        {"config": forced, "steps": 17, "change": (6, 8), "resume_at": 7, "logical": str(tmp_path / "logical")},
        # finish right where H changed: no second sync of an empty round
        {"config": forced, "steps": 6, "change": (6, 8), "finish": True},
        {"config": static, "steps": 6, "finish": True},
        # H 8 -> 2 right after step 8; finish mid-round (step 11): one more sync
        {"config": {"sync_every": 8, "adapt": True, "adapt_sync_every": "2,8", "adapt_every": 1000}, "steps": 11,
         "change": (8, 2), "finish": True},
    ]
    results = run_ranks(_jobs, 2, jobs, timeout=220)
    for rank, res in enumerate(results):
        st, kept, changed, resumed, resumed_logical, fin_changed, fin_static, down = res
        # adapt to the same knob = the static run, bit for bit, and it did decide (every sync)
        assert len(kept["decisions"]) == 4 and all(d["new"] == 2 for d in kept["decisions"])
        for a, b in zip(st["trace"], kept["trace"]):
            assert torch.equal(a["params"], b["params"])
        # the changed schedule: syncs after 2, 4, 6, then 8 (short round), 16
        assert [t + 1 for t, x in enumerate(changed["trace"]) if x["synced"]] == [2, 4, 6, 8, 16]
        assert changed["sync_every"] == 8
        ref, _ = _reference({2, 4, 6, 8, 16}, 17)
        assert torch.allclose(changed["params"], ref[rank], atol=1e-6), (changed["params"] - ref[rank]).abs().max()
        # resumed after the change = uninterrupted, bit for bit (H = 8 came back from the checkpoint)
        for again in (resumed, resumed_logical):
            assert again["sync_every"] == 8
            for a, b in zip(changed["trace"], again["trace"]):
                assert a["synced"] == b["synced"] and torch.equal(a["params"], b["params"])
        # finishing right at the change step adds no sync: the same as the static run finishing there
        assert torch.equal(fin_changed["committed"], fin_static["committed"])
        # 8 -> 2 after step 8: syncs at 8, 10, and the final one on the partial round (step 11)
        assert [t + 1 for t, x in enumerate(down["trace"]) if x["synced"]] == [8, 10]
        ref_down, ref_g = _reference({8, 10}, 11, finish=True)
        assert torch.allclose(down["committed"], ref_g, atol=1e-6)
        assert torch.allclose(down["params"], ref_down[rank], atol=1e-6)
