"""``--on-nonfinite`` under ``--fault-tolerance torchft``, with real replica processes: a non-finite loss or
gradient on one replica (``QUIETSYNC_FT_NONFINITE``) never commits on any.

* **stop** -- every replica stops at the same commit vote, exit 3, naming the step and the replica group; nothing
  of that step is committed (no record, no summary, no model). ddp meets the vote in the same step; diloco, whose
  inner steps are local, at the next outer sync (the replica that saw it waits there).
* **skip** (ddp) -- every replica drops the round (no commit, no record of it), its windows are dealt again, the run
  ends with ``--max-steps`` committed steps and the data audit holds.
* **the local launcher** does not start a replica group stopped by a non-finite value again: the job exits 3.

Each test ends with every process it started gone, and states every exit status.
"""

from __future__ import annotations

import json

import pytest

import quietsync.faults  # noqa: F401  (before torchft: its Rust log level is read at import)
from quietsync.train.replica_nonfinite import NONFINITE_EXIT
from tests.train._run import train_subprocess

from .torchft_replicas import Replicas, audit, job_flags, records, wait_exit

torchft = pytest.importorskip("torchft")

pytestmark = pytest.mark.timeout(240)


def _run(tmp_path, flags: list[str], bad: str) -> tuple[Replicas, list[int]]:
    """Two replica groups (replica group 1 poisoned as ``bad`` says), both in the first quorum; their exit
    statuses, and no process left."""
    replicas = Replicas(tmp_path, 2, job_flags(tmp_path, tmp_path / "run", *flags))
    try:
        go = {"QUIETSYNC_FT_HOLD": f"step:0:{tmp_path / 'go'}"}
        procs = [replicas.start(0, go), replicas.start(1, {**go, "QUIETSYNC_FT_NONFINITE": bad})]
        replicas.go(tmp_path / "go", [0, 1])
        codes = [wait_exit(replicas, p, 120) for p in procs]
    finally:
        replicas.close()
    assert replicas.alive() == []
    return replicas, codes


def _last_line(replicas: Replicas, k: int) -> str:
    return (replicas.folder / f"replica{k}.0.log").read_text().strip().splitlines()[-1]


@pytest.mark.parametrize("strategy,bad,step,logged", [
    ("ddp", "gradient:3", 3, 2),  # the vote is the step's own gradient average
    ("diloco", "loss:3", 3, None),  # replica 0 meets it at the outer sync after its inner step 4
])
def test_stop_ends_every_replica_naming_the_step_and_commits_nothing_of_it(tmp_path, strategy, bad, step, logged):
    extra = ["--sync-every", "4"] if strategy == "diloco" else []
    replicas, codes = _run(tmp_path, ["--strategy", strategy, "--max-steps", "8", *extra], bad)
    assert codes == [NONFINITE_EXIT, NONFINITE_EXIT], replicas.logs()
    what = bad.partition(":")[0]
    for k in (0, 1):
        assert _last_line(replicas, k) == (
            f"quietsync train: error: replica group {k}: NonFiniteError: non-finite {what} in step {step} on replica "
            "group 1 (--on-nonfinite stop); no replica committed it"), replicas.logs()
    out = tmp_path / "run"
    assert not (out / "summary.json").exists() and not (out / "model").exists()
    for k in (0, 1):
        steps = [r["step"] for r in records(out, k)]
        if logged is not None:  # ddp: every step is a commit; step 3 never was
            assert steps == list(range(1, logged + 1))
        committed = [c for r in records(out, k) for c in r.get("commits", [])]
        assert [c["id"] for c in committed] == list(range(1, len(committed) + 1))
        if strategy == "diloco":  # the start check only: the sync that met the vote did not commit
            assert len(committed) == 1 and committed[0]["committed"] == [], committed
        else:  # the start check and steps 1, 2
            assert len(committed) == 3


def test_skip_drops_the_round_on_every_replica_and_the_audit_holds(tmp_path):
    replicas, codes = _run(tmp_path, ["--strategy", "ddp", "--max-steps", "6", "--on-nonfinite", "skip"], "loss:3")
    assert codes == [0, 0], replicas.logs()
    out = tmp_path / "run"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["nonfinite_skips"] == 1
    by_replica = [records(out, k) for k in (0, 1)]
    for rs in by_replica:
        assert [r["step"] for r in rs] == [1, 2, 3, 4, 5, 6]
        assert [r.get("skipped_rounds", 0) for r in rs] == [0, 0, 1, 0, 0, 0]
    dropped = by_replica[0][2]["dropped"]
    assert dropped == by_replica[1][2]["dropped"] and len(dropped) == 4  # both slots of the dropped step
    committed, ft = audit(out, 2)
    assert len(set(committed)) == len(committed), "a window committed twice"
    assert set(dropped) <= set(committed), "a dropped window was not dealt again"
    assert sorted(committed + ft["windows_held"]) == list(range(ft["windows_dealt"])), "a window skipped"
    assert ft["schedule_position"] >= 6 and ft["commits"] == 1 + 6 + 1  # the start check, six steps, the totals


@pytest.mark.long
def test_the_local_launcher_does_not_restart_a_replica_stopped_by_a_non_finite_value(tmp_path, monkeypatch):
    monkeypatch.setenv("QUIETSYNC_FT_NONFINITE", "gradient:2")  # both replica groups, step 2
    out = tmp_path / "run"
    proc = train_subprocess(*job_flags(tmp_path, out, "--strategy", "ddp", "--max-steps", "6"), "--fault-tolerance",
                            "torchft", "--nproc", "2", timeout=120)
    assert proc.returncode == NONFINITE_EXIT, proc.stderr
    assert "starting it again" not in proc.stdout + proc.stderr
    assert ("NonFiniteError: non-finite gradient in step 2 on replica group 0; non-finite gradient in step 2 on "
            "replica group 1 (--on-nonfinite stop); no replica committed it") in proc.stderr
    assert "replica group 0 stopped for a non-finite value (--on-nonfinite); it is not started again, the job stops" \
        in proc.stderr or "replica group 1 stopped for a non-finite value" in proc.stderr, proc.stderr
    assert not (out / "summary.json").exists() and not (out / "model").exists()
