"""CDP against the paper's recurrences (tests/strategies/helpers/reference_cdp.py), one process and N workers; replicas
identical after every step; bytes per time step equal the hand count; point-to-point only; activation memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quietsync
from quietsync.strategies.cdp.cdp import CDPConfig
from quietsync.strategies.cdp.schedule import Schedule
from tests.distributed import run_ranks
from tests.strategies.helpers.reference_cdp import reference_cdp, uses_new

OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})}


def mlp(n: int, d: int = 5) -> nn.Sequential:
    """``n`` segments of equal width; segment k is stage k+1 when cut into n."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n)])


def data(t: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * t + 31 * i)
    return torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)


def loss_fn(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def reference(n: int, rule: str, opt: str, steps: int) -> list[torch.Tensor]:
    model = mlp(n)
    cls, kw = OPTIMIZERS[opt]
    stage_of = {name: int(name.split(".")[0]) + 1 for name, _ in model.named_parameters()}
    thetas = reference_cdp(model, cls(model.parameters(), **kw), stage_of, rule, n, steps, data, loss_fn)
    return [torch.cat([th[k].reshape(-1) for k in th]) for th in thetas]


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def run_single(n: int, rule: str, opt: str, steps: int) -> list[torch.Tensor]:
    cls, kw = OPTIMIZERS[opt]
    s = quietsync.make_strategy("cdp", mlp(n), cls, config={"rule": rule, "stages": n}, **kw)
    out, k = [], 0
    while s.steps < steps:
        s.forward_backward(data(*divmod(k, n)), loss_fn)
        k += 1
        if s.step():
            with s.committed_params() as m:
                out.append(flat(m))
    s.close()
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("rule", ["dp", "v1", "v2"])
def test_one_process_matches_the_paper_recurrence(n, opt, rule):
    got, want = run_single(n, rule, opt, 4), reference(n, rule, opt, 4)
    assert len(got) == 4
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_the_rules_differ_so_the_oracle_can_fail():
    n = 3
    finals = {rule: reference(n, rule, "sgd", 4)[-1] for rule in ("dp", "v1", "v2")}
    assert (finals["dp"] - finals["v1"]).abs().max() > 1e-4
    assert (finals["dp"] - finals["v2"]).abs().max() > 1e-4
    assert (finals["v1"] - finals["v2"]).abs().max() > 1e-4
    # the other reading of the v2 index (j >= N - i instead of N - i + 1) is a different trajectory too
    assert uses_new("v2", 1, 3, 3) and not uses_new("v2", 1, 2, 3)
    got = run_single(n, "v2", "sgd", 4)[-1]
    assert (got - finals["v1"]).abs().max() > 1e-4 and (got - finals["dp"]).abs().max() > 1e-4


def test_v2_indexing_matches_the_timeline():
    s = Schedule(4, 1, "v2")
    for i in range(4):
        for j in range(4):
            # version c is available at the forward iff the stage's update of cycle c-1 ended before it
            update_end = s.reduce_times(0, j)[-1]
            assert (s.fwd(1, i, j) > update_end) == (s.version(1, i, j) == 1)
            assert (s.version(1, i, j) == 1) == uses_new("v2", i + 1, j + 1, 4)


def test_backward_uses_the_forward_version_when_the_stage_is_updated_in_between():
    # i + j <= N (1-based): forward before the update of the previous cycle, backward after it
    s = Schedule(3, 1, "v2")
    i, j = 0, 1  # slot 1, stage 2: 1 + 2 <= 3
    update = s.reduce_times(0, j)[-1]
    assert s.fwd(1, i, j) < update < s.bwd(1, i, j)
    # and the executor still matches the reference (test above), which takes every gradient at its forward's
    # tensors; an in-place update under a pending backward would make autograd raise or the values drift


def test_first_step_is_a_dp_step():
    for rule in ("v1", "v2"):
        torch.testing.assert_close(run_single(3, rule, "sgd", 1)[0], reference(3, "dp", "sgd", 1)[0], atol=1e-6,
                                   rtol=0)


def test_forward_backward_returns_losses_as_the_pipeline_drains():
    s = quietsync.make_strategy("cdp", mlp(3), torch.optim.SGD, config={"stages": 3}, lr=0.1)
    got = [s.forward_backward(data(0, k), loss_fn) for k in range(5)]
    assert got[:2] == [None, None] and all(g is not None for g in got[2:])
    assert got[2].item() == pytest.approx(loss_fn(mlp(3), data(0, 0)).item())
    s.close()


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="rule must be one of"):
        CDPConfig(rule="v3")
    with pytest.raises(ValueError, match="stages must be an integer >= 1"):
        CDPConfig(stages=0)
    with pytest.raises(ValueError, match="manual_stages must name"):
        CDPConfig(partition="manual")
    assert CDPConfig(rule="cdp-v1").rule == "v1"
    with pytest.raises(ValueError, match="stages must be <= the 2 segments"):
        quietsync.make_strategy("cdp", mlp(2), torch.optim.SGD, config={"stages": 3}, lr=0.1)
    with pytest.raises(TypeError, match="cannot cut"):
        quietsync.make_strategy("cdp", nn.Linear(2, 2), torch.optim.SGD, lr=0.1)


# ---------------------------------------------------------------------------------------------- activation memory
@pytest.mark.parametrize("n", [2, 4])
def test_cdp_peak_activation_memory_is_about_n_plus_1_over_2n_of_dp(n):
    peaks = {}
    for rule in ("dp", "v2"):
        s = quietsync.make_strategy("cdp", mlp(n, d=64), torch.optim.SGD,
                                    config={"rule": rule, "stages": n, "measure_activations": True}, lr=0.01)
        for k in range(6 * n):
            g = torch.Generator().manual_seed(k)
            s.forward_backward((torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)), loss_fn)
            s.step()
        peaks[rule] = max(x.peak for x in s.activation_timeline())
        s.close()
    ratio = peaks["v2"] / peaks["dp"]
    assert ratio == pytest.approx((n + 1) / (2 * n), abs=0.05), (peaks, ratio)


# ---------------------------------------------------------------------------------------------- N workers
def _hand_count(n: int, stage_bytes: list[int], w: int, cycles: int, rule: str) -> dict[int, int]:
    """CDP with one worker per slot: worker r < N-1 sends stage j's partial sum right after its backward of j, at
    2Nc + 2r + 2N - 1 - j; the root (N-1) sends the mean gradient after its own, at T = 2Nc + 4N - 3 - j, to the
    first of the chain — v2: [N-1-j .. N-2] + [0 .. N-2-j] (0-based j: who reads the new version first), v1:
    [0 .. N-2] — each of which but the last relays it one step later."""
    out: dict[int, int] = {}
    for c in range(cycles):
        for j in range(n):
            if w < n - 1:
                t = 2 * n * c + 2 * w + 2 * n - 1 - j
                out[t] = out.get(t, 0) + stage_bytes[j]
            chain = list(range(n - 1 - j, n - 1)) + list(range(0, n - 1 - j)) if rule == "v2" else list(range(n - 1))
            senders = [n - 1] + chain[:-1]
            for k, sender in enumerate(senders):
                if sender == w:
                    t = 2 * n * c + 4 * n - 3 - j + k
                    out[t] = out.get(t, 0) + stage_bytes[j]
    return out


def _workers(rank: int, world: int, rule: str, steps: int) -> dict:
    out = {}
    for opt in ("sgd", "adamw"):
        cls, kw = OPTIMIZERS[opt]
        s = quietsync.make_strategy("cdp", mlp(world), cls, config={"rule": rule, "stages": world}, **kw)
        thetas, c = [], 0
        while s.steps < steps:  # the trainer's loop: workers stop at different time steps
            s.forward_backward(data(c, rank), loss_fn)
            c += 1
            if s.step():
                with s.committed_params() as m:
                    thetas.append(flat(m))
        out[opt] = {"thetas": thetas, "t": s.t, "sent": dict(s.mailbox.sent_per_step), "stage_bytes": s.stage_bytes,
                    "kinds": s.transport.meter.by_kind(), "meter_sent": s.transport.meter.sent,
                    "completed": s.mailbox.sent_completed}
        s.close()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n,rule", [(2, "v2"), (3, "v2"), (4, "v2"), (3, "v1")])
def test_workers_match_the_recurrence_stay_identical_and_send_the_hand_count(n, rule):
    results = run_ranks(_workers, n, rule, 3, timeout=200)
    for opt in ("sgd", "adamw"):
        want = reference(n, rule, opt, 3)
        per_rank = [r[opt] for r in results]
        for step in range(3):
            for r in per_rank:
                assert torch.equal(r["thetas"][step], per_rank[0]["thetas"][step])  # replicas identical
            torch.testing.assert_close(per_rank[0]["thetas"][step], want[step], atol=1e-6, rtol=0)
        horizon = min(r["t"] for r in per_rank)
        for w, r in enumerate(per_rank):
            hand = _hand_count(n, r["stage_bytes"], w, 8, rule)
            assert {t: b for t, b in r["sent"].items() if t < horizon} == {t: b for t, b in hand.items() if t < horizon}
            assert set(r["kinds"]) <= {"world/send", "world/recv"}, r["kinds"]  # no collective at all
            init = sum(r["stage_bytes"]) if w < n - 1 else 0  # the initial parameter chain
            assert r["meter_sent"] == r["completed"] + init


def test_schedule_needs_no_wait_for_cdp_rules():
    for n in (2, 3, 4, 8):
        for rule in ("v1", "v2"):
            assert Schedule(n, n, rule).period == 2 * n
        assert Schedule(n, 1, "dp").period == 2 * n
    assert Schedule(4, 4, "dp").period > 8  # lock-step DP over a point-to-point chain needs a barrier


def _loop_then_close(rank, world, rule, steps, collective_between_calls):
    s = quietsync.make_strategy("cdp", mlp(world), torch.optim.SGD, config={"rule": rule, "stages": world}, lr=0.1)
    c, commits = 0, []
    while s.steps < steps:  # stop as soon as the target is committed
        s.forward_backward(data(c, rank), loss_fn)
        c += 1
        if s.step():
            commits.append(c)
        if collective_between_calls:  # a data loader's broadcast, a budget agreement, a Trainer's logging
            s.transport.barrier()
    stopped_at = s.t
    s.close()
    return {"stopped_at": stopped_at, "commits": commits}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n,rule,steps,collective", [(4, "v2", 5, True), (3, "v1", 7, False), (2, "v2", 3, True)])
def test_every_worker_commits_in_the_same_call_so_loops_stop_together(n, rule, steps, collective):
    """Every call of every worker covers the same window of time steps, and a step is reported once the last
    worker applied it: so every worker commits in the same call, a loop that stops on a committed step stops at
    the same time step everywhere (nothing left for a peer to wait on at close), and a collective between two
    calls (which a staggered window would deadlock) passes."""
    results = run_ranks(_loop_then_close, n, rule, steps, collective, timeout=200)
    assert len({r["stopped_at"] for r in results}) == 1
    assert len({tuple(r["commits"]) for r in results}) == 1 and len(results[0]["commits"]) == steps
