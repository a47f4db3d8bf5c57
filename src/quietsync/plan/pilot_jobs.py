"""How a pilot's training job runs: on workers forked from this process's launcher, or as a ``quietsync train``
subprocess -- either way the same job a user's ``quietsync train`` with the pilot's flags would run, its output in
the pilot's log, stoppable half-way (a pruned pilot).

A pilot of local workers (``--nproc`` > 1, no torchrun, elastic or torchft run) is launched from this process
(:class:`~quietsync.cli.launch.LocalWorkers`): its workers come from the planner's one forkserver, which imported
torch, the training loop and the model classes once for every pilot, where a subprocess would import them twice
per pilot (its launcher and its own forkserver: about 6 CPU-seconds a pilot). Any other pilot runs as a subprocess
in its own session, so stopping it stops every process it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

__all__ = ["PilotJob", "start_pilot"]


class PilotJob(Protocol):
    """A running pilot job."""

    def poll(self) -> int | None:
        """The job's exit status once it ended (0 done, 1 a worker failed, 2 refused, negative: stopped), else
        None."""

    def stop(self) -> None:
        """Stop the job and every process it started."""


def start_pilot(argv: list[str], log: Path) -> PilotJob:
    """Start ``quietsync train argv`` with its output written to ``log`` (see the module docstring)."""
    local = _Local.start(argv, log)
    return local if local is not None else _Subprocess(argv, log)


class _Subprocess:
    """``python -m quietsync train`` in its own session."""

    def __init__(self, argv: list[str], log: Path) -> None:
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "quietsync", "train", *argv], stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         # unbuffered: the log gets each line as it comes, the last one too if killed
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        """Terminate the process group, then kill what is left of it."""
        proc = self.proc
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20.0)
        except subprocess.TimeoutExpired:
            pass
        try:  # the launcher may be gone while a worker of its group is not
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10.0)


class _Local:
    """The job's local workers, launched from this process."""

    def __init__(self, workers: Any, log: Path) -> None:
        self.workers, self.log, self.code = workers, log, None

    @classmethod
    def start(cls, argv: list[str], log: Path) -> PilotJob | None:
        """The job launched here, or None where it must run as a subprocess (one worker, torchrun, an elastic or
        torchft run); a job refused before its workers start ends at once with status 2, the refusal in ``log``."""
        from ..cli.flags import FlagError
        from ..cli.launch import LocalWorkers, under_torchrun
        from ..train.args import PROG, parse_train_args
        from ..train.job_model import worker_preload
        from ..train.loop import run
        from ..train.run_job import before_workers

        with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                cfg, strategy_config, nodes = parse_train_args(argv)
            except SystemExit as e:  # the one-line refusal is in the log
                return _Ended(int(e.code or 2))
            if cfg.nproc <= 1 or under_torchrun() or cfg.elastic or cfg.fault_tolerance != "none":
                return None
            try:
                for note in before_workers(cfg, strategy_config, nodes):
                    print(f"{PROG} train: {note}")
            except FlagError as e:
                print(f"{PROG} train: error: {e}")
                return _Ended(2)
        return cls(LocalWorkers(run, (cfg, strategy_config, nodes), cfg.nproc, worker_preload(cfg.model),
                                output=log), log)

    def poll(self) -> int | None:
        from ..cli.launch import WorkerFailed
        from ..train.args import PROG

        if self.code is None:
            try:
                done = self.workers.poll(0.0)
            except WorkerFailed as e:
                with open(self.log, "a") as out:
                    out.write(f"{e.details}\n{PROG} train: error: {e}\n")
                done, self.code = True, 1
            if done:
                self.code = 0 if self.code is None else self.code
                self.workers.close()
        return self.code

    def stop(self) -> None:
        if self.code is None:
            self.workers.stop()
            self.workers.close()
            self.code = -signal.SIGTERM  # as Popen reports a process ended by SIGTERM


class _Ended:
    """A job that ended before any worker started."""

    def __init__(self, code: int) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code

    def stop(self) -> None:
        pass
