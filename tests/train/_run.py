"""Helpers of the end-to-end `quietsync train` tests.

* :func:`train` runs ``quietsync train FLAGS`` as the command does — :func:`quietsync.commands.main.main`: the
  parsing, the checks before any worker starts, the notes, the exit status and the one-line failure report
  naming the worker that failed first — with each worker doing what a launched worker does
  (:func:`quietsync.cli.launch.run_local_worker`: torchrun's environment, loopback gloo, the file rendezvous,
  the failure note, the job function). Only *how* the workers start differs: they are forked from the test
  harness's forkserver (:mod:`tests.launcher`), which imported torch, transformers and the training loop once,
  instead of being spawned as fresh interpreters. Tests whose claim is about the launcher's
  processes (spawn, signals, kill -9, exit of a killed launcher, torchrun) use :func:`train_subprocess`, as do
  the CLI smoke test and tests/faults.
* :func:`train_subprocess`: ``quietsync train FLAGS`` as a subprocess (local workers spawned by its launcher).
* :func:`refused`: a refused command run in this process (exit 2, one line, no worker started).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launcher import OFFLINE, forked_launcher

from .conftest import synthetic_text

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")


def small_job(tmp_path: Path, nproc: int = 2) -> list[str]:
    """Flags of a small job (tiny model, local text, ``nproc`` workers) whose files live under ``tmp_path``."""
    data = tmp_path / "text.txt"
    if not data.exists():
        data.write_text(synthetic_text(1500))
    return ["--model", "tiny", "--nproc", str(nproc), "--micro-batch-size", "2", "--seq-len", "32",
            "--vocab-size", "300",
            "--dataset", str(data), "--cache-dir", str(tmp_path / "cache"), "--eval-windows", "4",
            "--eval-every", "0", "--no-progress", "--no-plot"]


def shared_run(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str,
               nproc: int = 2) -> tuple[Path, list[str]]:
    """A finished ``train(*small_job(F, nproc), *flags, "--out", F/"run")`` in a folder F of this test session, run
    once whichever test process asks first (:func:`tests.shared.shared_folder`); returns ``(F/"run",
    small_job(F, nproc))`` — the job's flags, for a test that resumes a copy (the dataset path must not change).
    Read it, or copy it first (:func:`tests.shared.copy_of`)."""
    from tests.shared import shared_folder

    def build(folder: Path) -> None:
        proc = train(*small_job(folder, nproc), *flags, "--out", str(folder / "run"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        (folder / "stdout.txt").write_text(proc.stdout)

    folder = shared_folder(tmp_path_factory, name, build)
    return folder / "run", small_job(folder, nproc)


@dataclass
class Finished:
    """A finished ``quietsync train``: its exit status and what it printed (the fields of
    :class:`subprocess.CompletedProcess` the tests read)."""

    returncode: int
    """0, 1 (a worker failed), 2 (refused before any worker started) or 130 (interrupted)."""
    stdout: str
    """The command's standard output, then each worker's, by rank."""
    stderr: str
    """The command's standard error (for a failed worker: its traceback, then the one-line error), after each
    worker's own."""


def train(*flags: str, timeout: float = 200) -> Finished:
    """``quietsync train FLAGS`` with its workers forked from the harness's forkserver (see the module doc)."""
    from quietsync.commands.main import main

    out, err = io.StringIO(), io.StringIO()
    with forked_launcher(timeout), redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(["train", *flags])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return Finished(rc, out.getvalue(), err.getvalue())


def train_subprocess(*flags: str, timeout: float = 200) -> subprocess.CompletedProcess:
    """``quietsync train FLAGS`` as a subprocess (local workers spawned by its launcher)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(OFFLINE)
    return subprocess.run([sys.executable, "-m", "quietsync", "train", *flags],
                          capture_output=True, text=True, env=env, timeout=timeout)


def refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *flags: str) -> str:
    """Run ``quietsync train FLAGS`` in this process; assert exit 2, one line on stderr, no worker started;
    return the line."""
    from quietsync.cli import launch as launch_module
    from quietsync.commands.main import main

    for k in TORCHRUN_VARS:
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
