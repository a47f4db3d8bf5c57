"""Helpers of the end-to-end `quietsync train` tests: a small 2-worker job as a subprocess, and a refused
command run in this process (exit 2, one line, no worker started)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import synthetic_text

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def small_job(tmp_path: Path, nproc: int = 2) -> list[str]:
    """Flags of a small job (tiny model, local text, ``nproc`` workers) whose files live under ``tmp_path``."""
    data = tmp_path / "text.txt"
    if not data.exists():
        data.write_text(synthetic_text(1500))
    return ["--model", "tiny", "--nproc", str(nproc), "--micro-batch-size", "2", "--seq-len", "32", "--vocab-size", "300",
            "--dataset", str(data), "--cache-dir", str(tmp_path / "cache"), "--eval-windows", "4",
            "--eval-every", "0", "--no-progress", "--no-plot"]


def train(*flags: str, timeout: float = 200) -> subprocess.CompletedProcess:
    """``quietsync train FLAGS`` as a subprocess (local workers)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    env.update(OFFLINE)
    return subprocess.run([sys.executable, "-m", "quietsync.train.cli", "train", *flags],
                          capture_output=True, text=True, env=env, timeout=timeout)


def refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *flags: str) -> str:
    """Run ``quietsync train FLAGS`` in this process; assert exit 2, one line on stderr, no worker started;
    return the line."""
    from quietsync.train import launch as launch_module
    from quietsync.train.cli import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch_module, "launch", no_workers)
    capsys.readouterr()
    try:
        rc = main(["train", *flags])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("quietsync train: error: --"), err
    return lines[0]
