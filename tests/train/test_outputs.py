"""Runs never overwrite each other: a new run into a used --out is refused before workers start, unless
--overwrite, which removes that run's outputs (and only those); compare follows the same rule."""

from __future__ import annotations

import json

import pytest

from quietsync.train.config import TrainConfig
from quietsync.train.metrics import read_jsonl
from quietsync.train.outputs import out_problem, remove_outputs
from tests.shared import copy_of

from ._run import refused, small_job, train

pytestmark = pytest.mark.timeout(60)


def test_out_problem_rules(tmp_path):
    out = tmp_path / "run"
    assert out_problem(TrainConfig(out=str(out))) is None  # missing
    out.mkdir()
    assert out_problem(TrainConfig(out=str(out))) is None  # empty
    (out / "summary.json").write_text("{}")
    assert "--out" in out_problem(TrainConfig(out=str(out))) and "--overwrite" in out_problem(TrainConfig(out=str(out)))
    assert out_problem(TrainConfig(out=str(out), overwrite=True)) is None
    assert out_problem(TrainConfig(out=str(out), resume="latest")) is None  # continues the run in --out
    inside = str(out / "checkpoints" / "step-0000002")
    assert out_problem(TrainConfig(out=str(out), resume=inside)) is None
    assert "--overwrite would delete" in out_problem(TrainConfig(out=str(out), resume="latest", overwrite=True))
    # a checkpoint from elsewhere starts a new --out: the new-run rule applies
    assert "not empty" in out_problem(TrainConfig(out=str(out), resume=str(tmp_path / "other")))


def test_overwrite_removes_only_what_a_run_writes(tmp_path):
    for name in ("metrics-rank0.jsonl", "metrics-rank1.jsonl", "summary.json", "loss.png", "trace.json",
                 "profile-rank0.json", "timeline.png", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "checkpoints" / "step-0000002").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    removed = remove_outputs(tmp_path)
    assert "checkpoints" in removed and "metrics-rank1.jsonl" in removed and "notes.txt" not in removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]


def test_overwrite_keeps_a_users_own_files_inside_checkpoints(tmp_path):
    """--overwrite removes the rank files, logical parts and partial writes of step folders, and the folders it
    empties; a file of the user's own there (and the folders holding it) stays."""
    root = tmp_path / "checkpoints"
    mine = root / "README.txt"
    kept_step = root / "step-0000004"
    gone_step = root / "step-0000002"
    for step in (kept_step, gone_step):
        (step / "logical").mkdir(parents=True)
        (step / "logical" / ".metadata").write_text("x")
        (step / "logical" / "__0_0.distcp").write_text("x")
        (step / "rank0.pt").write_text("x")
        (step / "rank1.pt.tmp").write_text("x")  # left by a kill -9 during a save
    mine.write_text("my notes on this run")
    (kept_step / "eval-notes.md").write_text("mine too")
    (root / "scratch").mkdir()
    (root / "scratch" / "rank0.pt").write_text("not a step folder: not ours")
    removed = remove_outputs(tmp_path)
    assert removed == ["checkpoints"]
    assert mine.read_text() == "my notes on this run"
    assert sorted(p.name for p in kept_step.iterdir()) == ["eval-notes.md"]
    assert not gone_step.exists()
    assert (root / "scratch" / "rank0.pt").exists()


@pytest.mark.timeout(300)
def test_a_used_out_is_refused_and_overwrite_replaces_it(tmp_path, monkeypatch, capsys, finished_zero1_run):
    """A copy of the shared finished zero1 run (tests/train/conftest.py: 2 workers, 4 steps, checkpoints)."""
    shared, job = finished_zero1_run
    out = copy_of(shared, tmp_path / "run")
    assert (out / "checkpoints").is_dir()
    (out / "notes.txt").write_text("mine")
    before = (out / "metrics-rank0.jsonl").read_text()
    line = refused(monkeypatch, capsys, *job, "--max-steps", "3", "--out", str(out))
    assert f"--out {out} is not empty" in line and "--overwrite" in line
    assert (out / "metrics-rank0.jsonl").read_text() == before  # untouched
    second = train(*job, "--max-steps", "3", "--overwrite", "--out", str(out))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "--overwrite: removed" in second.stdout
    assert not (out / "checkpoints").exists()  # the first run's checkpoints are gone ...
    assert (out / "notes.txt").read_text() == "mine"  # ... what a run does not write stays
    steps = [r["step"] for r in read_jsonl(out / "metrics-rank0.jsonl") if "event" not in r]
    assert steps == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_compare_refuses_a_used_out(tmp_path, capsys):
    from quietsync.commands.compare import compare_main

    (tmp_path / "compare.md").write_text("old")
    with pytest.raises(SystemExit) as e:
        compare_main(["--strategies", "zero1", "ddp", "--out", str(tmp_path), "--model", "tiny"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--out {tmp_path} is not empty" in err and "--overwrite" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare.md"]  # nothing ran


@pytest.mark.timeout(240)
def test_compare_overwrite_replaces_its_runs(tmp_path, monkeypatch):
    from quietsync.commands.compare import compare_main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "cmp"
    (out / "zero1").mkdir(parents=True)
    (out / "zero1" / "metrics-rank1.jsonl").write_text('{"step": 99}\n')  # a stale worker of an older run
    (out / "compare.png").write_text("stale")
    rc = compare_main(["--strategies", "zero1", "--out", str(out), "--overwrite", "--max-steps", "2",
                       *small_job(tmp_path, nproc=1)])
    assert rc == 0
    assert sorted(p.name for p in (out / "zero1").iterdir()) == ["metrics-rank0.jsonl", "model", "summary.json"]
    assert json.loads((out / "compare.json").read_text())[0]["steps"] == 2
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
