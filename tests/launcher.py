"""The local launcher of quietsync with forked workers, for tests whose claim is not about the launcher itself.

:func:`quietsync.cli.launch.launch` forks its local workers from a forkserver of its own, which imports torch
and the training loop once per launching process (seconds of CPU). :func:`launch_forked` does what it does —
``fn(*args)`` on ``nproc`` workers, each running :func:`quietsync.cli.launch.run_local_worker` (torchrun's
environment, loopback gloo, the file rendezvous, the failure note), the launcher's
:class:`~quietsync.cli.launch.WorkerFailed` for the worker that failed first, a world of one in this process
— with workers forked from the forkserver of :mod:`tests.distributed`, which imported all that once. Each
worker's standard output and error are copied to this process's, by rank, when they finish.

``with forked_launcher(): ...`` makes every ``quietsync`` entry point that launches workers (``quietsync
train``, ``compare``, ``plan``) use it; the ``forked_launch`` fixture (tests/conftest.py) does the same for one
test. What it does not exercise — the launcher's forkserver, signals, a killed launcher, the death signal — is
tested through real subprocesses (tests/cli/test_launch.py, tests/faults, tests/train/test_cli_smoke.py, which
also checks that a run through the tests' forkserver equals the launcher's own step for step).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.distributed import run_ranks

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
"""No network in tests: the Hugging Face libraries read only their local caches."""

DEFAULT_TIMEOUT_S = 200.0


def launch_forked(fn: Callable[..., Any], args: tuple = (), nproc: int = 1,
                  timeout: float = DEFAULT_TIMEOUT_S) -> Any:
    """:func:`quietsync.cli.launch.launch` with forked workers (see the module doc)."""
    from quietsync.cli.launch import GRACE_S, first_failure

    if nproc <= 1:
        return fn(*args)
    with tempfile.TemporaryDirectory(prefix="quietsync-launch-") as errors:
        env = {**OFFLINE, **{k: v for k, v in os.environ.items() if k.startswith("QUIETSYNC_")}}  # as spawned ones
        got = run_ranks(_forked_worker, nproc, fn, args, errors, timeout=timeout, nodes=1, env=env,
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
            stacks = "".join(f"\n---- worker {r}, every thread's stack at the timeout:\n{got[r][1]}"
                             for r in missing if got[r][1])
            raise TimeoutError(f"workers {missing} of {nproc} did not finish within {timeout:g}s{stacks}")
    return None


def _forked_worker(rank: int, world: int, fn: Callable[..., Any], args: tuple, errors: str) -> None:
    """One forked worker: what a launched worker runs, its output kept in files for the parent."""
    from quietsync.cli.launch import run_local_worker

    with open(Path(errors, f"stdout-{rank}"), "w", buffering=1) as out, \
            open(Path(errors, f"stderr-{rank}"), "w", buffering=1) as err:
        sys.stdout, sys.stderr = out, err
        try:
            run_local_worker(rank, fn, args, world, int(os.environ["MASTER_PORT"]), errors)
        finally:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__


@contextmanager
def forked_launcher(timeout: float = DEFAULT_TIMEOUT_S) -> Iterator[None]:
    """Within: :func:`quietsync.cli.launch.launch` is :func:`launch_forked`, the Hugging Face libraries are
    offline, and this process has no torchrun variables (as a user's shell runs a command)."""
    from quietsync.cli import launch as launch_module

    keys = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", *OFFLINE)
    saved = {k: os.environ.get(k) for k in keys}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)
    os.environ.update(OFFLINE)
    real = launch_module.launch
    # the harness's forkserver already imports what ``preload`` names (tests/worker_preload.py)
    launch_module.launch = lambda fn, args=(), nproc=1, preload=(): launch_forked(fn, args, nproc, timeout)
    try:
        yield
    finally:
        launch_module.launch = real
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
