"""Run a function on N local gloo workers, with a hard timeout, for multi-process tests.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes (forked from a forkserver that imported
torch, quietsync, the training loop and transformers once: :mod:`tests.worker_preload`), sets
the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), calls
``fn(rank, world_size, *args)`` in each and returns the list of results by rank. A worker that raises
fails the test with its traceback; a worker that hangs (or a peer waiting on it) fails it at ``timeout``
— every process is killed, nothing is left running.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue as queue_mod
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from quietsync.cli import launch as _launch

_PRELOAD = ["torch", "quietsync", "tests.worker_preload"]
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(_PRELOAD)  # what workers import, imported once
# quietsync's own launcher, called in this process, starts the same (one per process) forkserver: the same modules
_launch.FORKSERVER_PRELOAD[:] = list(dict.fromkeys([*_launch.FORKSERVER_PRELOAD, *_PRELOAD]))


def interruptible() -> None:
    """``preexec_fn`` of a subprocess a test will interrupt: SIGINT as a terminal's foreground job has it. A shell
    starts background jobs (``make test &``, some CI runners) with SIGINT ignored, an ignored signal stays
    ignored in every child, and Python then installs no KeyboardInterrupt handler."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, nodes: int, port: int, fn: Callable[..., Any], args: tuple,
            results: Any, env: dict[str, str], stacks: str) -> None:
    # SIGUSR1 (sent by run_ranks at its timeout) writes every thread's stack to a file the failure then quotes
    faulthandler.register(signal.SIGUSR1, file=open(stacks, "w"), all_threads=True)
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world // nodes),
        "LOCAL_RANK": str(rank % (world // nodes)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "QUIETSYNC_BACKEND": "gloo",  # CPU workers even on a GPU machine (LOCAL_WORLD_SIZE emulates nodes)
    })
    import torch

    torch.set_num_threads(1)
    try:
        out = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # tensors travel as bytes: no shared-memory handles outliving this process
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0, nodes: int | None = None,
              env: dict[str, str] | None = None, expect_failure: bool = False,
              grace_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo workers; results by rank.

    Args:
        nodes: how many nodes the workers stand for (default: one node per worker).
        env: extra environment variables for the workers.
        expect_failure: return ``{rank: ("ok", result) | ("error", traceback) | ("missing", stacks)}`` instead
            of raising when a worker fails (for tests of failure handling); ``stacks``: every thread's stack of a
            worker still running at the timeout, or None.
        grace_s: with ``expect_failure``, how long the others may still take once one worker failed (then they
            are killed and reported missing, as a launcher stops the peers of a failed worker); default: until
            ``timeout``.
    """
    nodes = world_size if nodes is None else nodes
    results = _CTX.Queue()
    port = free_port()
    # the workers meet through a file, not on that port: another process may take a free port before rank 0
    # listens on it (EADDRINUSE), which a file cannot suffer (a test's own rendezvous in env wins)
    meeting = tempfile.mkdtemp(prefix="quietsync-ranks-")
    env = {"QUIETSYNC_RENDEZVOUS": f"file://{meeting}/rendezvous", **(env or {})}
    procs = [
        _CTX.Process(target=_worker, args=(r, world_size, nodes, port, fn, args, results, env,
                                           os.path.join(meeting, f"stacks-{r}.txt")), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
                got[rank] = (status, value)
                if status == "error" and not expect_failure:
                    break
                if status == "error" and grace_s is not None:
                    deadline = min(deadline, time.monotonic() + grace_s)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=0.5 if len(got) < world_size else 5)
        hung = _stacks([r for r, p in enumerate(procs) if p.is_alive() and r not in got], procs, meeting)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(meeting, ignore_errors=True)
    if expect_failure:
        out = {}
        for r in range(world_size):
            status, value = got.get(r, ("missing", hung.get(r)))
            out[r] = (status, _load(value) if status == "ok" else value)
        return out  # type: ignore[return-value]
    errors = {r: v for r, (s, v) in got.items() if s == "error"}
    if errors:
        r = min(errors)
        raise AssertionError(f"rank {r} of {world_size} failed:\n{errors[r]}")
    missing = [r for r in range(world_size) if r not in got]
    if missing:
        stacks = "".join(f"\n---- rank {r}, every thread's stack at the timeout:\n{hung[r]}" for r in sorted(hung))
        raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:g}s{stacks}")
    return [_load(got[r][1]) for r in range(world_size)]


def _stacks(ranks: list[int], procs: list, meeting: str) -> dict[int, str]:
    """Every thread's stack of each still-running worker of ``ranks`` (faulthandler, on SIGUSR1), for the failure
    message: where a hung worker waited."""
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except OSError:
            pass
    if ranks:
        time.sleep(0.5)
    out = {}
    for r in ranks:
        try:
            with open(os.path.join(meeting, f"stacks-{r}.txt")) as f:
                out[r] = f.read()[-6000:]
        except OSError:
            pass
    return out


def _load(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)
