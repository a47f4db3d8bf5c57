"""Every file a resume reads is checked before any worker starts, and a bad one is named; what a save cut short
left is removed at the resume.

* a truncated shard of ``logical/`` (resumed on another number of workers): the launcher refuses in one line
  naming the file (exit 2); a worker that loads it (under torchrun there is no launcher) raises a ValueError
  naming it, before any collective — not a bare ``EOFError`` from inside DCP;
* a truncated rank file of another worker (resumed on the same number): named by the launcher;
* ``rank*.pt.tmp`` and ``logical/.metadata.tmp`` left by a kill during a save are gone after the resume.
"""

from __future__ import annotations

import pytest

from quietsync.train.checkpoint import rank_file

from ._run import refused, train

pytestmark = pytest.mark.timeout(400)


@pytest.fixture
def saved(finished_zero1_run):
    """The job's flags and a zero1 run on 2 workers with checkpoints at steps 2 and 4 (the session's shared one:
    copy before changing it)."""
    out, flags = finished_zero1_run
    return [*flags, "--strategy", "zero1"], out


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_truncated_logical_shard_is_named_before_workers_start(saved, tmp_path, monkeypatch, capsys):
    job, out = saved
    run = _copy(out, tmp_path / "run")
    shard = run / "checkpoints" / "step-0000004" / "logical" / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 3])
    line = refused(monkeypatch, capsys, *job, "--nproc", "1", "--max-steps", "6", "--out", str(run), "--resume")
    assert str(shard) in line and "truncated" in line, line


def test_a_worker_loading_a_truncated_shard_names_it(saved, tmp_path, monkeypatch):
    import torch

    from quietsync.data.sequences import ShardedSequences
    from quietsync.strategies import make_strategy
    from quietsync.train.logical_checkpoint import load_logical

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    _, out = saved
    run = _copy(out, tmp_path / "run")
    folder = run / "checkpoints" / "step-0000004"
    shard = folder / "logical" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    from . import _reshard_workers as w

    strategy = make_strategy("zero1", w.model(0), torch.optim.AdamW, lr=w.LR)
    try:
        with pytest.raises(ValueError) as e:
            load_logical(folder, strategy, ShardedSequences(torch.arange(4000), 8, 2))
    finally:
        strategy.close()
    assert str(shard) in str(e.value) and "truncated" in str(e.value) and "\n" not in str(e.value)
    shard.unlink()
    with pytest.raises(ValueError, match=f"checkpoint file {shard} is missing"):
        from quietsync.train.logical_checkpoint import check_logical_files

        check_logical_files(folder)


def test_a_truncated_rank_file_is_named_before_workers_start(saved, tmp_path, monkeypatch, capsys):
    job, out = saved
    run = _copy(out, tmp_path / "run")
    path = rank_file(run / "checkpoints" / "step-0000004", 1)
    path.write_bytes(path.read_bytes()[:1000])
    line = refused(monkeypatch, capsys, *job, "--max-steps", "6", "--out", str(run), "--resume")
    assert str(path) in line and "cannot be read" in line, line


def test_partial_writes_are_removed_at_the_resume(saved, tmp_path):
    job, out = saved
    run = _copy(out, tmp_path / "run")
    left = [run / "checkpoints" / "step-0000004" / "rank1.pt.tmp",
            run / "checkpoints" / "step-0000002" / "logical" / ".metadata.tmp"]
    for path in left:
        path.write_bytes(b"cut short")
    proc = train(*job, "--max-steps", "5", "--out", str(run), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [p for p in left if p.exists()]
    assert not list((run / "checkpoints").rglob("*.tmp"))
