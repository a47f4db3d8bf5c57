"""A pilot with one slow worker measures the pace the run really goes at: a synchronous method waits for the slowest
worker, so the seconds per step a pilot reports are at least that worker's own busy seconds per step — however
long its faster peers wait for it inside their evaluations (the update in flight), which is training time, not
evaluation time (the Streaming DiLoCo row of issue 42 was predicted at half its pilot's time by taking rank 0's
evaluations out)."""

from __future__ import annotations

import json

import pytest

from quietsync.plan.candidates import parse_candidate
from quietsync.plan.pilot_plan import pilot_speed
from quietsync.plan.pilots import PilotCurve, ProcessRunner

SLOW = 3.0
JOB = ["--model", "tiny", "--nproc", "2", "--nodes", "2", "--threads", "1", "--micro-batch-size", "2", "--seq-len",
       "64", "--vocab-size", "4096", "--slow-worker", f"1:{SLOW:g}", "--warmup-steps", "1", "--eval-windows", "4"]
SPEC = "diloco:sync_every=8,fragments=2,overlap_delay=4"
"""Streaming DiLoCo: each fragment's exchange in flight behind τ = 4 inner steps, so a worker that evaluates waits
for it — for its slower peer to get there."""
STEP_TOKENS = 2 * 2 * 64


def _steps(folder, rank: int) -> dict[int, dict]:
    recs = [json.loads(line) for line in (folder / f"metrics-rank{rank}.jsonl").read_text().splitlines() if line]
    return {r["step"]: r for r in recs if "event" not in r}


@pytest.mark.long
@pytest.mark.timeout(280)
def test_a_slow_worker_pilot_reports_the_slowest_workers_pace(tmp_path):
    runner = ProcessRunner(JOB, [], tmp_path, None, lambda c: float(STEP_TOKENS), lambda c: False, log=lambda s: None,
                           timeout_s=240.0)
    cand = parse_candidate(SPEC)
    curve = runner(cand, 64 * STEP_TOKENS, lambda c: False)  # 64 steps, an evaluation every 4
    assert curve.stopped == "budget", curve.stopped
    speed = pilot_speed(curve)
    assert speed is not None
    step_s, tokens = speed
    assert tokens == pytest.approx(STEP_TOKENS)
    # the reference: the slow worker's own busy seconds per step over the same steps (its compute and the sleep
    # that makes it SLOW× slower, from its per-step records) — a lower bound of the pace every worker keeps
    first, last = curve.steps[len(curve.steps) // 2], curve.steps[-1]
    slow = _steps(runner.folder(cand), 1)
    busy = sum(slow[s]["compute_s"] for s in range(first + 1, last + 1)) / (last - first)
    assert step_s >= 0.9 * busy, (step_s, busy)
    # ... and the slow worker's own training clock (its time at the last evaluation minus its evaluations, per
    # step): what the run went at, within 15%
    mine = [json.loads(line) for line in (runner.folder(cand) / "metrics-rank1.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in mine if r.get("event") == "eval"}
    clock = [evals[s]["time_s"] - sum(e["eval_s"] for t, e in evals.items() if t <= s) for s in (first, last)]
    assert step_s == pytest.approx((clock[1] - clock[0]) / (last - first), rel=0.15)
    # rank 0, the fast worker, alone would have said far less: it waits for the slow one inside its evaluations
    # (0.088 against 0.274 on an idle machine; a loaded one slows the fast worker's own compute too)
    rank0 = PilotCurve(curve.spec, curve.tokens, curve.losses, curve.steps, curve.time_s, curve.eval_s, curve.wall_s)
    fast = pilot_speed(rank0)
    assert fast is not None and fast[0] < 0.75 * step_s, (fast, step_s)
