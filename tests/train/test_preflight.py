"""Every check that can run before workers start does (issue 10, row 6): a bad path, value or dataset is
one line on stderr naming the flag, exit status 2, and no worker is started."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ._run import refused as refused_line
from ._run import small_job
from .conftest import synthetic_text

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def refused(tmp_path, monkeypatch, capsys):
    """``refused(*flags)``: ``quietsync train`` of a small job plus ``flags``, in this process; asserts exit
    status 2 with one line on stderr, no worker started, within seconds; returns the line."""
    job = small_job(tmp_path) + ["--max-steps", "2", "--out", str(tmp_path / "out")]

    def run(*flags: str) -> str:
        t0 = time.monotonic()
        line = refused_line(monkeypatch, capsys, *job, *flags)
        assert time.monotonic() - t0 < 10
        return line

    return run


def test_out_that_is_a_file(tmp_path, refused):
    (tmp_path / "file").write_text("x")
    assert "--out must be a folder" in refused("--out", str(tmp_path / "file"))
    assert "on its path is a file" in refused("--out", str(tmp_path / "file" / "run"))


def test_out_that_is_not_writable(tmp_path, refused):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    immutable = False
    if os.access(locked, os.W_OK):  # root ignores modes; an immutable folder stops root too
        immutable = subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode == 0
        if not immutable:
            pytest.skip("running as root without chattr: no folder here is unwritable")
    try:
        assert "is not writable" in refused("--out", str(locked))
        assert "is not writable" in refused("--out", str(locked / "run"))
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(locked)], check=True)
        locked.chmod(0o755)


def test_cache_dir_that_is_a_file(tmp_path, refused):
    (tmp_path / "file").write_text("x")
    assert "--cache-dir must be a folder" in refused("--cache-dir", str(tmp_path / "file"))


def test_resume_of_a_missing_folder(tmp_path, refused):
    line = refused("--resume", str(tmp_path / "nope"))
    assert "--resume must be a checkpoint folder" in line and "is missing" in line
    line = refused("--resume")  # bare: the newest under --out, and there is none
    assert "--resume found no complete checkpoint" in line


@pytest.mark.parametrize("flags, expected", [
    (["--weight-decay", "nan"], "--weight-decay must be >= 0, got nan"),
    (["--timeout-s", "inf"], "--timeout-s must be > 0, got inf"),
    (["--slow-worker", "1:inf"], "--slow-worker factor must be >= 1, got inf"),
    (["--vocab-size", "1"], "--vocab-size must be an integer >= 257, got 1"),
])
def test_values(refused, flags, expected):
    assert refused(*flags).endswith(expected)


def test_threads_are_bounded(refused):
    cap = 4 * (os.cpu_count() or 1)
    assert f"--threads must be an integer in [0, {cap}]" in refused("--threads", "100000")


def test_empty_and_tiny_datasets(tmp_path, refused):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "--dataset must hold at least 2 documents" in refused("--dataset", str(empty))
    small = tmp_path / "small.txt"
    small.write_text(synthetic_text(200))  # a few thousand tokens: enough for 2 x 2 x 32, not for 2 x 64 x 128
    line = refused("--dataset", str(small), "--micro-batch-size", "64", "--seq-len", "128")
    assert "is too small" in line and "--micro-batch-size 64 x --seq-len 128" in line


@pytest.mark.timeout(60)
def test_the_command_fails_fast_without_starting_workers(tmp_path):
    (tmp_path / "file").write_text("x")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "quietsync", "train", "--model", "tiny",
                           "--out", str(tmp_path / "file"), "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=50)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--out must be a folder" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 20  # a worker start alone (process group, tokenizer) took longer
