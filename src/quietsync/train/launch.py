"""Start the workers of a job: in place under torchrun, or as local processes.

* Under torchrun (``RANK`` and ``WORLD_SIZE`` in the environment) every process runs the job function
  unchanged, across as many nodes as torchrun spans; ``--nproc`` is ignored.
* Otherwise, with ``nproc > 1``, :func:`launch` spawns ``nproc`` local workers (``torch.multiprocessing``,
  *spawn* start method) on a free local port, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set as torchrun would; gloo on CPU. If one
  worker fails, the others are terminated and :class:`WorkerFailed` carries the failed worker's traceback.
* With ``nproc == 1`` the job runs in this process as a world of one (no process group).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any


class WorkerFailed(RuntimeError):
    """A local worker raised or died; ``rank`` is the worker, ``details`` its traceback or exit status."""

    def __init__(self, rank: int, details: str) -> None:
        self.rank = rank
        self.details = details.rstrip()
        last = next((ln for ln in reversed(self.details.splitlines()) if ln.strip()), "failed")
        super().__init__(f"worker {rank} failed: {last.strip()}")


def under_torchrun() -> bool:
    """Whether a launcher (torchrun or similar) already set ``RANK`` and ``WORLD_SIZE``."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(local_rank: int, fn: Callable[..., Any], args: tuple, nproc: int, port: int) -> None:
    os.environ.update({
        "RANK": str(local_rank), "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    fn(*args)


def launch(fn: Callable[..., Any], args: tuple = (), nproc: int = 1) -> Any:
    """Run ``fn(*args)`` in every worker; return its result when it ran in this process (else None).

    ``fn`` and ``args`` must be picklable (module-level function, dataclass arguments).
    """
    if under_torchrun() or nproc <= 1:
        return fn(*args)
    import torch.multiprocessing as mp

    try:
        mp.start_processes(
            _worker, args=(fn, args, nproc, free_port()), nprocs=nproc, join=True, start_method="spawn"
        )
    except mp.ProcessRaisedException as e:
        raise WorkerFailed(e.error_index, e.msg) from None
    except mp.ProcessExitedException as e:
        raise WorkerFailed(e.error_index, str(e)) from None
    return None
