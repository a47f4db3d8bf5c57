"""A pilot runs the job ``quietsync train`` would run with its flags, its output in its log, and stops half-way
when it is pruned: a pilot of local workers is launched from the planner's own process (no interpreter of its own to
start), one it cannot launch so (a single worker) runs as a ``quietsync train`` subprocess in its own session; a
refused one ends at once, its one-line refusal in the log."""

from __future__ import annotations

import json
import time

import pytest

from quietsync.plan.pilot_jobs import start_pilot
from tests.train.conftest import synthetic_text

pytestmark = pytest.mark.timeout(200)


def _job(tmp_path, *more: str) -> list[str]:
    data = tmp_path / "text.txt"
    if not data.exists():
        data.write_text(synthetic_text(1000))
    return ["--model", "tiny", "--threads", "1", "--micro-batch-size", "2", "--seq-len", "32", "--vocab-size", "300",
            "--dataset", str(data), "--cache-dir", str(tmp_path / "cache"), "--eval-every", "0", "--no-progress",
            "--no-plot", "--no-export", "--save-every", "0", "--out", str(tmp_path / "run"), *more]


def _steps(tmp_path) -> int:
    path = tmp_path / "run" / "metrics-rank0.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line and "event" not in json.loads(line))


def _wait(cond, limit: float = 150.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit, "timed out"
        time.sleep(0.05)


def test_a_pilot_of_local_workers_stopped_half_way_leaves_no_worker(tmp_path):
    log = tmp_path / "pilot.log"
    job = start_pilot(_job(tmp_path, "--nproc", "2", "--max-steps", "100000"), log)
    workers = job.workers.context.processes  # launched from this process: its own workers, no launcher between
    _wait(lambda: _steps(tmp_path) >= 2)
    assert job.poll() is None
    job.stop()
    assert job.poll() is not None and job.poll() < 0
    assert not any(p.is_alive() for p in workers)
    steps = _steps(tmp_path)
    time.sleep(0.5)
    assert _steps(tmp_path) == steps  # nothing trains on
    assert "quietsync train: strategy zero1, 2 worker(s)" in log.read_text()  # the workers' own output, in the log


def test_a_pilot_that_ends_reports_its_status_and_a_refused_one_its_one_line(tmp_path):
    log = tmp_path / "pilot.log"
    job = start_pilot(_job(tmp_path, "--nproc", "2", "--max-steps", "3"), log)
    _wait(lambda: job.poll() is not None)
    assert job.poll() == 0 and _steps(tmp_path) == 3
    refused = start_pilot(_job(tmp_path, "--nproc", "2", "--lr", "0"), log)
    assert refused.poll() == 2
    assert "--lr must be" in log.read_text()


def test_a_single_worker_pilot_runs_as_its_own_process_and_stops_as_one(tmp_path):
    log = tmp_path / "pilot.log"
    job = start_pilot(_job(tmp_path, "--nproc", "1", "--max-steps", "100000"), log)
    assert hasattr(job, "proc")  # it would train in this process: a subprocess in its own session instead
    assert job.poll() is None
    job.stop()  # at once: its interpreter need not finish importing to show it is stopped whole
    assert job.poll() is not None and job.poll() != 0
