"""diloco --adapt with adapt_objective time_to_target: the controller picks the knob of least predicted time to the
target, tokens to the target (the plan's, given per knob) × time per token (the sync's exposed seconds over the
compute, by hand); on the link the plan priced it picks what the planner's own cost term picks; it moves to a
larger H only when the wire time it saves outweighs the tokens it costs; a run whose pick is its knob is the static
run bit for bit; bad input is refused in one line."""

from __future__ import annotations

import pytest
import torch

from quietsync.cost.compute import ComputeProfile
from quietsync.cost.costmodel import Ctx, Links
from quietsync.cost.workload import Workload
from quietsync.link import LinkModel
from quietsync.strategies.local import cost
from quietsync.strategies.local.adapt import SyncPeriod, pick_sync_every
from quietsync.strategies.local.diloco import DiLoCoConfig
from quietsync.topology import Topology
from tests.distributed import run_ranks
from tests.strategies.helpers.common import param_groups, tiny_model
from tests.strategies.helpers.probe_fakes import FakeTransport
from tests.strategies.local.test_adapt import PSI, _jobs
from tests.strategies.local.test_adapt_bits import _sync_bytes

HS = (4, 8, 16, 32, 64)


def _expected(tokens: dict, bandwidth: float, step_s: float, dtypes=("fp32",)) -> tuple[int, str]:
    """By hand: a pair (H, dtype) sends its sync's bytes once per H inner steps of ``step_s``; its time per token
    is (1 + bytes/β / (H·step)) times the compute's, its time to target that times its tokens (the product of its
    H's and its dtype's); the least wins, the earlier pair on a tie."""
    best, pick = None, None
    for h in HS:
        for d in dtypes:
            k = tokens.get(str(h), 1.0) * (tokens.get(d, 1.0) if len(dtypes) > 1 else 1.0)
            t = k * (1 + _sync_bytes(d) / bandwidth / (h * step_s))
            if best is None or t < best * (1 - 1e-9):
                best, pick = t, (h, d)
    return pick


def _setup():
    model = tiny_model()
    workload = Workload.from_model(model, tokens_per_micro_batch=1, param_groups=param_groups(model))
    return model, workload, Topology(0, 2, 2)


TOKENS = {"4": 1.0, "8": 1.05, "16": 1.15, "32": 1.4, "64": 2.0}
"""Tokens to the target growing with H (DiLoCo's loss per token grows with H), as a plan's pilots would give."""
TOKENS_TEXT = ",".join(f"{k}:{v}" for k, v in TOKENS.items())


def test_the_pick_is_the_least_predicted_time_to_target():
    _, workload, topo = _setup()
    cfg = DiLoCoConfig(sync_every=4, adapt=True, adapt_sync_every="4,8,16,32,64", adapt_objective="time_to_target",
                       adapt_tokens=TOKENS_TEXT)
    tokens = cfg.token_factors(HS, ("fp32",))
    step_s = 1e-3
    picks = {}
    for mbit in (100, 10, 3, 1, 0.3, 0.01):
        bw = mbit * 1e6 / 8
        d = pick_sync_every(workload, topo, cfg, HS, 4, step_s, bw, 0.1, "world", tokens=tokens)
        assert (d.new, d.new_dtype) == _expected(TOKENS, bw, step_s), mbit
        assert d.share == pytest.approx(4 * PSI / bw / (d.new * step_s), rel=1e-9)
        assert "least predicted time to target" in d.why
        picks[mbit] = d.new
    # the slower the link, the larger H -- but only as far as the tokens it costs are paid back
    assert picks[100] == 4 and picks[100] <= picks[10] <= picks[1] <= picks[0.01]
    assert picks[1] > 4
    # the overhead rule's budget is not what decides: at 1 Mbit/s the rule goes to H = 64 (its sync under 10%), the
    # time to target stops at H = 16, whose sync adds 35% but whose tokens cost less than H = 64's
    bw = 1e6 / 8
    assert picks[1] == 16 and 4 * PSI / bw / (16 * step_s) > 0.3
    assert pick_sync_every(workload, topo, cfg, HS, 4, step_s, bw, 0.1, "world").new == 64  # the overhead rule's
    # tokens that do not grow with H: the link alone decides, the largest H whose sync is the cheapest
    flat = {h: 1.0 for h in TOKENS}
    d = pick_sync_every(workload, topo, cfg, HS, 4, step_s, 1e6 / 8, 0.1, "world",
                        tokens={(h, "fp32"): 1.0 for h in HS})
    assert (d.new, d.new_dtype) == _expected(flat, 1e6 / 8, step_s) == (64, "fp32")


def test_bits_and_h_are_priced_together():
    """With H,bits each pair's tokens are its H's times its dtype's: a dtype that costs few tokens (fp4 here) is
    taken before a longer round; one that costs more (int2) only where the wire makes up for it."""
    _, workload, topo = _setup()
    tokens = {**TOKENS, "fp32": 1.0, "fp4": 1.02, "int2": 1.3}
    cfg = DiLoCoConfig(sync_every=4, adapt=True, adapt_knobs="H,bits", adapt_sync_every="4,8,16,32,64",
                       adapt_pseudo_grad_dtype="fp32,fp4,int2", adapt_objective="time_to_target",
                       adapt_tokens=",".join(f"{k}:{v}" for k, v in tokens.items()))
    dtypes = ("fp32", "fp4", "int2")
    factors = cfg.token_factors(HS, dtypes)
    assert factors[(16, "int2")] == pytest.approx(1.15 * 1.3)
    seen = []
    for mbit in (100, 10, 1, 0.05):
        bw = mbit * 1e6 / 8
        d = pick_sync_every(workload, topo, cfg, HS, 4, 1e-3, bw, 0.1, "world", dtypes, "fp32", factors)
        assert (d.new, d.new_dtype) == _expected(tokens, bw, 1e-3, dtypes), mbit
        seen.append((d.new, d.new_dtype))
    assert seen[0] == (4, "fp32") and seen[1] == (4, "fp4")  # fewer bits before a longer round


def test_the_controller_picks_what_the_planners_cost_term_picks():
    """The planner costs an --adapt row by the H its controller would pick on each stretch of the link
    (cost.AdaptedH); with adapt_objective time_to_target both minimize the same product, so on the same link and
    step they pick the same H, and a link that drops moves both."""
    _, workload, topo = _setup()
    cfg = DiLoCoConfig(sync_every=4, adapt=True, adapt_sync_every="4,8,16,32,64", adapt_objective="time_to_target",
                       adapt_tokens=TOKENS_TEXT)
    term = cost.diloco(workload, topo, cfg).step
    assert isinstance(term, cost.AdaptedH) and term.tokens == tuple(TOKENS[str(h)] for h in HS)
    step_s = 1e-3
    compute = ComputeProfile(forward_s=step_s, backward_s=0.0, optimizer_s_per_element=0.0,
                             elements=workload.params, source="test")
    planned = []
    for mbit in (100, 3, 1, 0.01):
        bw = mbit * 1e6 / 8
        h_plan, _ = term.pick(Ctx(compute, Links(model={"inter": LinkModel(bw, 0.0)}), topo))
        h_run = pick_sync_every(workload, topo, cfg, HS, 4, step_s, bw, 0.1, "world",
                                tokens=cfg.token_factors(HS, ("fp32",))).new
        assert h_plan == h_run, mbit
        planned.append(h_plan)
    assert planned[0] == 4 and planned[-1] > planned[0]


def test_on_a_steady_link_the_controller_keeps_the_plans_pick_and_follows_a_drop():
    """Started at the knob of least predicted time on the steady link (the plan's pick), the controller keeps it at
    every decision; a 30x drop moves H up at the next decision, the recovery brings it back."""
    model = tiny_model()
    cfg = DiLoCoConfig(sync_every=4, adapt=True, adapt_window=4, adapt_sync_every="4,8,16,32,64",
                       adapt_objective="time_to_target", adapt_tokens=TOKENS_TEXT, adapt_threshold=0.0)
    transport = FakeTransport()
    ctrl = SyncPeriod(transport, "world", cfg, model, param_groups(model))
    step_s, step = 1e-3, 0

    def rounds(bandwidth: float, n: int) -> list:
        nonlocal step
        out = []
        for _ in range(n * ctrl.sync_every):
            step += 1
            synced = step % ctrl.sync_every == 0
            if synced:
                transport.meter.sent += 4 * PSI
                transport.meter.seconds += 4 * PSI / bandwidth
            d = ctrl.after_inner_step(step, synced, step_s)
            if d is not None:
                out.append(d)
        return out

    fast, slow = 100e6 / 8, 3e6 / 8
    assert _expected(TOKENS, fast, step_s)[0] == 4
    assert rounds(fast, 5) == [] and ctrl.decisions and all(d["new"] == 4 for d in ctrl.decisions)  # kept H = 4
    changed = rounds(slow, 2)
    assert [(d.old, d.new) for d in changed] == [(4, _expected(TOKENS, slow, step_s)[0])] and ctrl.sync_every > 4
    back = rounds(fast, 2)
    assert [(d.old, d.new) for d in back] == [(ctrl.decisions[-2]["new"], 4)] and ctrl.sync_every == 4


@pytest.mark.parametrize("knobs,match", [
    ({"adapt_objective": "time"}, "adapt_objective must be one of overhead, time_to_target"),
    ({"adapt_objective": "time_to_target"}, "adapt_tokens must give the tokens to the target of every candidate"),
    ({"adapt_objective": "time_to_target", "adapt_tokens": "8:1,16:1.1"}, "missing 32,64,128"),
    ({"adapt_objective": "time_to_target", "adapt_tokens": "8:1,16:0,32:1,64:1,128:1"}, "TOKENS > 0"),
    ({"adapt_objective": "time_to_target", "adapt_tokens": "8:1,8:2"}, "each once"),
    ({"adapt_objective": "time_to_target", "adapt_tokens": "h8:1"}, "KNOB an H"),
    ({"adapt_objective": "time_to_target", "adapt_knobs": "H,bits", "adapt_pseudo_grad_dtype": "fp32,fp4",
      "adapt_tokens": "8:1,16:1,32:1,64:1,128:1,fp32:1"}, "missing fp4"),
])
def test_bad_objective_knobs(knobs, match):
    with pytest.raises(ValueError, match=match):
        DiLoCoConfig(sync_every=8, adapt=True, **knobs)


@pytest.mark.timeout(240)
def test_a_run_whose_pick_is_its_knob_is_the_static_run_bit_for_bit():
    """2 gloo workers, no emulated link: every sync is nearly free, and with tokens that grow steeply with H the
    least time to target is the smallest H -- the one the run has. It decides after every sync and keeps it: the
    static run, bit for bit (the same for the bits: fp32 kept over fp4 that costs tokens here)."""
    static = {"sync_every": 2}
    keep = {"sync_every": 2, "adapt": True, "adapt_sync_every": "2,4,8", "adapt_threshold": 0.0,
            "adapt_objective": "time_to_target", "adapt_tokens": "2:1,4:100,8:1000"}
    # tokens so steep that only a sync 99x the step would move the pick: a loaded machine's metered sync seconds
    # (which hold the wait for the peer) stay far below that
    keep_bits = {**keep, "adapt_knobs": "H,bits", "adapt_pseudo_grad_dtype": "fp32,fp4",
                 "adapt_tokens": "2:1,4:100,8:1000,fp32:1,fp4:100"}
    jobs = [{"config": static, "steps": 8}, {"config": keep, "steps": 8}, {"config": keep_bits, "steps": 8}]
    for st, kept, kept_bits in run_ranks(_jobs, 2, jobs, timeout=220):
        for run in (kept, kept_bits):
            assert len(run["decisions"]) == 4 and all(d["new"] in (2, "2/fp32") for d in run["decisions"])
            for a, b in zip(st["trace"], run["trace"]):
                assert a["synced"] == b["synced"] and torch.equal(a["params"], b["params"])
