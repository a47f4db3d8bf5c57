"""Budgets of `quietsync train` (--max-tokens, --max-time-s, --target-loss besides --max-steps): each stops the
run after the first committed step at which it is reached, every worker stops at the same step, summary.json
says which budget stopped it, bad values are refused before any worker starts, and `quietsync compare`
gives the budgets to every run."""

from __future__ import annotations

import json
import math

import pytest
import torch

import quietsync
from quietsync.train.budgets import Budgets, BudgetWatch
from quietsync.train.metrics import read_jsonl
from quietsync.train.nonfinite import NonFiniteGuard
from tests.distributed import run_ranks

from ._run import refused, small_job, train

pytestmark = pytest.mark.timeout(300)

TOKENS_PER_MICRO_BATCH = 2 * 32
"""small_job: --micro-batch-size 2 x --seq-len 32."""


# ---------------------------------------------------------------------------------------------- the decision
def test_a_budget_is_reached_at_or_past_its_value():
    b = Budgets(max_steps=10, max_tokens=1000, max_time_s=60.0, target_loss=3.5)
    assert b.reached(3, 999, 59.9, 3.6) is None
    assert b.reached(3, 1000, 0.0, None) == "max_tokens"
    assert b.reached(3, 0, 60.0, None) == "max_time_s"
    assert b.reached(3, 0, 0.0, 3.5) == "target_loss"
    assert b.reached(10, 0, 0.0, None) == "max_steps"
    assert b.reached(3, 0, 0.0, math.nan) is None  # a diverged evaluation reaches no target


def test_ties_name_the_first_of_target_tokens_time_steps():
    b = Budgets(max_steps=10, max_tokens=1000, max_time_s=60.0, target_loss=3.5)
    assert b.reached(10, 1000, 60.0, 3.0) == "target_loss"
    assert b.reached(10, 1000, 60.0, None) == "max_tokens"
    assert b.reached(10, 0, 60.0, None) == "max_time_s"


def test_only_max_steps_needs_no_agreement():
    assert not Budgets(max_steps=5).agreed
    assert Budgets(max_steps=5, max_time_s=1.0).agreed
    assert Budgets(5).describe() == "5 steps"
    assert Budgets(5, 1_000_000, 60, 3.5).describe() == (
        "5 steps, 1,000,000 tokens, 60 s or eval loss <= 3.5, whichever comes first")


def _agree(rank: int, world: int, budgets: list[Budgets], mine: list[tuple[int, float, float | None]]) -> list:
    model = torch.nn.Linear(2, 2)
    s = quietsync.make_strategy("ddp", model, torch.optim.SGD, lr=0.1)
    guard = NonFiniteGuard("stop", s)
    try:
        watch = [BudgetWatch(b, s) for b in budgets]
        tokens, time_s, loss = mine[rank]
        return [w.check(tokens, time_s, loss) for w in watch]
    finally:
        guard.close()
        s.close()


def test_workers_with_different_counts_and_clocks_take_the_same_decision():
    """Rank 0 fed 100 tokens in 1 s and evaluated 3.0; rank 1 fed 250 tokens, its clock says 9 s, its own
    evaluation says 1.0. Tokens are summed (350), the clock is the slowest (9 s), the loss is rank 0's."""
    budgets = [
        Budgets(100, max_tokens=350), Budgets(100, max_tokens=351),
        Budgets(100, max_time_s=9.0), Budgets(100, max_time_s=9.5),
        Budgets(100, target_loss=3.0), Budgets(100, target_loss=2.0),
    ]
    out = run_ranks(_agree, 2, budgets, [(100, 1.0, 3.0), (250, 9.0, 1.0)], timeout=120)
    want = ["max_tokens", None, "max_time_s", None, "target_loss", None]
    assert out == [want, want]


# ---------------------------------------------------------------------------------------------- whole runs
def _steps(out, rank):
    return [r for r in read_jsonl(out / f"metrics-rank{rank}.jsonl") if "event" not in r]


def _evals(out, rank):
    return [r for r in read_jsonl(out / f"metrics-rank{rank}.jsonl") if r.get("event") == "eval"]


def _tokens_at(out, step):
    """Tokens of both workers after ``step`` (the sum of their ``tokens_total``)."""
    return sum(r["tokens_total"] for rank in (0, 1) for r in _steps(out, rank) if r["step"] == step)


def _stopped_together(out, steps):
    """Both workers logged exactly steps 1..steps and evaluated the last one."""
    for rank in (0, 1):
        assert [r["step"] for r in _steps(out, rank)] == list(range(1, steps + 1))
        assert _evals(out, rank)[-1]["step"] == steps


def test_a_token_budget_stops_at_the_first_step_that_reaches_it(tmp_path):
    """zero1 on 2 workers feeds 2 x 64 = 128 tokens per step: a budget of 300 is reached at step 3 (384)."""
    out = tmp_path / "run"
    proc = train(*small_job(tmp_path), "--strategy", "zero1", "--max-steps", "50", "--max-tokens", "300",
                 "--no-export", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["stopped_by"], summary["steps"], summary["tokens"]) == ("max_tokens", 3, 384)
    assert summary["budgets"] == {"max_steps": 50, "max_tokens": 300, "max_time_s": None, "target_loss": None}
    assert _tokens_at(out, 2) == 256 < 300 <= _tokens_at(out, 3) == 384
    _stopped_together(out, 3)
    assert "stopped by max_tokens" in proc.stdout


def test_a_time_budget_stops_every_worker_at_the_same_step_with_a_slow_worker(tmp_path):
    out = tmp_path / "run"
    proc = train(*small_job(tmp_path), "--strategy", "ddp", "--max-steps", "5000", "--max-time-s", "3",
                 "--slow-worker", "1:3", "--no-export", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "max_time_s" and 1 < summary["steps"] < 5000
    assert summary["wall_s"] >= 3.0
    _stopped_together(out, summary["steps"])
    before = [r["time_s"] for rank in (0, 1) for r in _steps(out, rank) if r["step"] == summary["steps"] - 1]
    assert max(before) < 3.0  # the step before had not reached the budget on any worker
    assert sum(r["slow_sleep_s"] for r in _steps(out, 1)) > 0 == sum(r["slow_sleep_s"] for r in _steps(out, 0))


def test_a_target_loss_stops_at_the_first_evaluation_at_or_below_it(tmp_path):
    """The same job twice (same --max-steps: the lr schedule spans them): once to read its evaluations, once
    with the loss of step 4 as the target."""
    job = [*small_job(tmp_path), "--strategy", "zero1", "--eval-every", "1", "--max-steps", "8", "--no-export"]
    proc = train(*job, "--out", str(tmp_path / "reference"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    curve = {e["step"]: e["loss"] for e in _evals(tmp_path / "reference", 0)}
    target = curve[4]
    expected = min(s for s in range(1, 9) if curve[s] <= target)  # the evaluation before step 1 does not count
    out = tmp_path / "run"
    proc = train(*job, "--target-loss", repr(target), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["stopped_by"], summary["steps"]) == ("target_loss", expected)
    assert summary["last_eval_loss"] == curve[expected]
    _stopped_together(out, expected)


@pytest.mark.parametrize("strategy", ["acco", "cdp"])
def test_strategies_with_work_in_flight_stop_on_a_budget_and_close_cleanly(strategy, tmp_path):
    """ACCO's workers feed as many micro-batches as fit (different counts per worker), CDP's commit at different
    time steps: both stop together at the first step whose summed tokens reach the budget, and drain."""
    out = tmp_path / "run"
    budget = 10 * TOKENS_PER_MICRO_BATCH
    proc = train(*small_job(tmp_path), "--strategy", strategy, "--max-steps", "100", "--max-tokens", str(budget),
                 "--no-export", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["stopped_by"] == "max_tokens" and 1 <= steps < 100
    assert summary["replicas"] == {"checked": True, "differ": []}  # drained: the same committed parameters
    _stopped_together(out, steps)
    assert _tokens_at(out, steps) >= budget and summary["tokens"] == _tokens_at(out, steps)
    if steps > 1:
        assert _tokens_at(out, steps - 1) < budget


# ---------------------------------------------------------------------------------------------- refused
@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "0"], "--max-tokens must be an integer >= 1 (or leave the flag out), got 0"),
    (["--max-time-s", "0"], "--max-time-s must be > 0 (or leave the flag out), got 0.0"),
    (["--max-time-s", "-5"], "--max-time-s must be > 0 (or leave the flag out), got -5.0"),
    (["--target-loss", "0"], "--target-loss must be > 0 (or leave the flag out), got 0.0"),
    (["--target-loss", "2", "--eval-every", "0"], "--target-loss needs --eval-every N > 0"),
])
def test_bad_budgets_are_refused_before_any_worker_starts(flags, message, monkeypatch, capsys):
    assert message in refused(monkeypatch, capsys, *flags)


def test_bad_budgets_in_a_config_file_are_refused(tmp_path, monkeypatch, capsys):
    path = tmp_path / "run.toml"
    path.write_text("max_time_s = -1\n")
    assert "--max-time-s must be > 0" in refused(monkeypatch, capsys, "--config", str(path))
    path.write_text("max-tokens = 0\n")
    assert "--max-tokens must be an integer >= 1" in refused(monkeypatch, capsys, "--config", str(path))
    path.write_text('target_loss = "low"\n')
    assert "target_loss must be a number, got 'low'" in refused(monkeypatch, capsys, "--config", str(path))
    path.write_text("max_tokens = 4096\nmax_time_s = 30\ntarget_loss = 3\n")
    from quietsync.train.args import parse_train_args

    cfg, _, _ = parse_train_args(["--config", str(path), "--nproc", "1"])
    assert cfg.budgets() == Budgets(300, 4096, 30.0, 3.0)


# ---------------------------------------------------------------------------------------------- compare
def test_compare_gives_every_run_the_budgets(tmp_path, monkeypatch):
    from quietsync.commands import compare

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    ran = []

    class Stop(Exception):
        pass

    def fake_run_job(cfg, strategy_config, nodes, nproc_given):
        ran.append(cfg)
        return 0

    def no_rows(*args):
        raise Stop

    monkeypatch.setattr(compare, "run_job", fake_run_job)
    monkeypatch.setattr(compare, "_rows", no_rows)
    with pytest.raises(Stop):
        compare.compare_main(["--strategies", "zero1", "ddp:accumulation=2", "--out", str(tmp_path / "cmp"),
                              "--nproc", "1", "--max-tokens", "4096", "--max-time-s", "60", "--target-loss", "3.5"])
    assert [c.strategy for c in ran] == ["zero1", "ddp"]
    assert all(c.budgets() == Budgets(300, 4096, 60.0, 3.5) for c in ran)
    ran.clear()
    with pytest.raises(Stop):  # the target for the report only
        compare.compare_main(["--strategies", "zero1", "--out", str(tmp_path / "cmp2"), "--nproc", "1",
                              "--target-loss", "3.5", "--no-stop-at-target"])
    assert [c.budgets() for c in ran] == [Budgets(300)]


def test_compare_at_an_equal_token_budget(tmp_path, monkeypatch):
    """zero1 (1 micro-batch per step) and ddp with accumulation 2 stop at the same 256 tokens, after 4 and 2
    steps; the table says what stopped each; with --trace their timelines are drawn side by side."""
    from quietsync.commands.compare import compare_main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "cmp"
    job = [f for f in small_job(tmp_path, nproc=1)]
    rc = compare_main(["--strategies", "zero1", "ddp:accumulation=2", "--out", str(out), *job, "--no-export",
                       "--max-steps", "50", "--max-tokens", str(4 * TOKENS_PER_MICRO_BATCH), "--trace"])
    assert rc == 0
    rows = json.loads((out / "compare.json").read_text())
    assert [(r["stopped_by"], r["steps"], r["tokens"]) for r in rows] == [("max_tokens", 4, 256),
                                                                           ("max_tokens", 2, 256)]
    table = (out / "compare.md").read_text()
    assert ("| stopped by | steps |" in table and "| max_tokens | 4 |" in table
            and "different token budgets" not in table)
    assert (out / "timelines.png").read_bytes()[:4] == b"\x89PNG"


def _count_agreements(rank: int, world: int, strategy: str, knobs: dict, steps: int, eval_every: int) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    s = quietsync.make_strategy(strategy, model, torch.optim.SGD, config=knobs or None, lr=0.1)
    guard = NonFiniteGuard("stop", s)
    try:
        watch = BudgetWatch(Budgets(max_steps=steps, max_time_s=1e9), s)
        at = []
        for step in range(1, steps + 1):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            s.backward(loss)
            assert s.step()
            before = watch.agreements
            stopped = watch.check(8 * step, 0.01 * step, None, evaluated=step % eval_every == 0)
            if watch.agreements > before:
                at.append(step)
        return at, stopped
    finally:
        guard.close()
        s.close()


@pytest.mark.parametrize("strategy, knobs, want", [
    ("ddp", {}, list(range(1, 13))),                          # every round is collective: agreed every step
    ("localsgd", {"sync_every": 4}, [4, 6, 8, 12]),           # at its syncs (every 4) and evaluations (every 6)
    ("diloco", {"sync_every": 4}, [4, 6, 8, 12]),
])
def test_local_methods_agree_on_budgets_only_where_their_workers_meet(strategy, knobs, want):
    """An agreement after every inner step would add a barrier to each one (a cross-node round trip; the faster
    worker waiting for the slower every step): under localsgd/diloco the workers agree every H steps and after
    every evaluation, and only --max-steps is checked in between -- the same steps on every worker."""
    out = run_ranks(_count_agreements, 2, strategy, knobs, 12, 6, timeout=120)
    assert out[0] == out[1] == (want, "max_steps")
