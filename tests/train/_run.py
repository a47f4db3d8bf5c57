"""Helpers of the end-to-end `quietsync train` tests.

* :func:`train` runs ``quietsync train FLAGS`` as the command does — :func:`quietsync.train.cli.main`: the
  parsing, the checks before any worker starts, the notes, the exit status and the one-line failure report
  naming the worker that failed first — with each worker doing what a launched worker does
  (:func:`quietsync.train.launch.run_local_worker`: torchrun's environment, loopback gloo, the file rendezvous,
  the failure note, the job function). Only *how* the workers start differs: they are forked from the test
  harness's forkserver (:func:`tests.distributed.run_ranks`), which imported torch, transformers and the
  training loop once, instead of being spawned as fresh interpreters. Tests whose claim is about the launcher's
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
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed import run_ranks

from .conftest import synthetic_text

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")


def small_job(tmp_path: Path, nproc: int = 2) -> list[str]:
    """Flags of a small job (tiny model, local text, ``nproc`` workers) whose files live under ``tmp_path``."""
    data = tmp_path / "text.txt"
    if not data.exists():
        data.write_text(synthetic_text(1500))
    return ["--model", "tiny", "--nproc", str(nproc), "--micro-batch-size", "2", "--seq-len", "32", "--vocab-size", "300",
            "--dataset", str(data), "--cache-dir", str(tmp_path / "cache"), "--eval-windows", "4",
            "--eval-every", "0", "--no-progress", "--no-plot"]


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
    from quietsync.train import launch as launch_module
    from quietsync.train.cli import main

    saved = {k: os.environ.pop(k) for k in TORCHRUN_VARS if k in os.environ}  # as a user's shell runs it
    saved_offline = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    real_launch = launch_module.launch
    launch_module.launch = lambda fn, args=(), nproc=1: _launch_forked(fn, args, nproc, timeout)
    out, err = io.StringIO(), io.StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                rc = main(["train", *flags])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        launch_module.launch = real_launch
        for k, v in saved_offline.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.environ.update(saved)
    return Finished(rc, out.getvalue(), err.getvalue())


def _launch_forked(fn, args: tuple, nproc: int, timeout: float) -> None:
    """:func:`quietsync.train.launch.launch` with forked workers: ``fn(*args)`` on ``nproc`` local workers, their
    output copied to this process's, :class:`~quietsync.train.launch.WorkerFailed` for the worker that failed
    first (the launcher's own choice, from the workers' failure notes). A world of one runs here, as there."""
    from quietsync.train.launch import GRACE_S, first_failure

    if nproc <= 1:
        return fn(*args)
    with tempfile.TemporaryDirectory(prefix="quietsync-launch-") as errors:
        got = run_ranks(_forked_worker, nproc, fn, args, errors, timeout=timeout, nodes=1, env=dict(OFFLINE),
                        expect_failure=True, grace_s=GRACE_S)
        for rank in range(nproc):
            for stream, name in ((sys.stdout, "stdout"), (sys.stderr, "stderr")):
                path = Path(errors, f"{name}-{rank}")
                if path.exists():
                    stream.write(path.read_text())
        failed = [r for r in range(nproc) if got[r][0] == "error"]
        if failed:
            noted = [r for r in failed if Path(errors, f"rank{r}").exists()]
            rank = (noted or failed)[0]
            raise first_failure(errors, rank, got[rank][1])
        missing = [r for r in range(nproc) if got[r][0] != "ok"]
        if missing:
            raise TimeoutError(f"workers {missing} of {nproc} did not finish within {timeout:g}s")
    return None


def _forked_worker(rank: int, world: int, fn, args: tuple, errors: str) -> None:
    """One forked worker: what a launched worker runs, its output kept in files for the parent."""
    from quietsync.train.launch import run_local_worker

    with open(Path(errors, f"stdout-{rank}"), "w", buffering=1) as out, \
            open(Path(errors, f"stderr-{rank}"), "w", buffering=1) as err:
        sys.stdout, sys.stderr = out, err
        try:
            run_local_worker(rank, fn, args, world, int(os.environ["MASTER_PORT"]), errors)
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__


def train_subprocess(*flags: str, timeout: float = 200) -> subprocess.CompletedProcess:
    """``quietsync train FLAGS`` as a subprocess (local workers spawned by its launcher)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(OFFLINE)
    return subprocess.run([sys.executable, "-m", "quietsync.train.cli", "train", *flags],
                          capture_output=True, text=True, env=env, timeout=timeout)


def refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *flags: str) -> str:
    """Run ``quietsync train FLAGS`` in this process; assert exit 2, one line on stderr, no worker started;
    return the line."""
    from quietsync.train import launch as launch_module
    from quietsync.train.cli import main

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
