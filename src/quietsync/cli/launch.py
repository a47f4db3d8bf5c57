"""Start the workers of a job: in place under torchrun, or as local processes.

* Under torchrun (``RANK`` and ``WORLD_SIZE`` in the environment) every process runs the job function
  unchanged, across as many nodes as torchrun spans; ``--nproc`` is ignored. A worker started by torchrun's
  agent dies with it (the same parent-death signal as below): a node whose agent is killed leaves no worker
  behind, which matters to elastic runs (a stray worker could still be writing a checkpoint).
* Otherwise, with ``nproc > 1``, :func:`launch` starts ``nproc`` local workers (``torch.multiprocessing``,
  *forkserver* start method: one fresh interpreter imports torch and the job's module once, and each worker is
  forked from it, with the launcher's environment and working directory, as *spawn* would give it; *spawn* where
  the platform has no forkserver) on a free local port, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set as torchrun would; gloo on CPU, bound to
  the loopback interface, with a file-based rendezvous (no store listening on the network). If one worker fails, the
  others are terminated and :class:`WorkerFailed` names
  the worker that failed **first** (the root cause — its peers typically fail a moment later with a broken
  connection) with its traceback. The others are stopped as soon as one failed: SIGTERM, SIGKILL after
  :data:`GRACE_S` (at once for a stopped, SIGSTOP'd, worker, which cannot act on SIGTERM), so a frozen worker
  ends the job ``--timeout-s`` after it froze plus its peer's clean-up (about 2 s), within the documented
  ``--timeout-s`` + 5 s. An interrupt (SIGINT) of the launcher stops every worker within seconds
  (SIGTERM, then SIGKILL after a grace period); checkpoints are written atomically, so one cut short is
  simply absent. A launcher killed outright (``kill -9``) takes its workers with it (Linux: the kernel
  sends each worker SIGTERM when its parent dies).
* With ``nproc == 1`` the job runs in this process as a world of one (no process group).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..transport import RENDEZVOUS_ENV

GRACE_S = 5.0
"""Seconds workers get to exit after SIGTERM before they are killed."""


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


ERRORS_ENV = "QUIETSYNC_LAUNCH_ERRORS"
"""Set in local workers: the folder where each failing worker notes when and why it failed."""


def note_failure() -> None:
    """Call in an ``except`` block of a local worker, *before* cleanup that may block: records the time and
    traceback of the failure, so the launcher blames the worker that failed first (no-op elsewhere)."""
    folder = os.environ.get(ERRORS_ENV)
    rank = os.environ.get("RANK")
    if folder and rank is not None:
        path = Path(folder, f"rank{rank}")
        if not path.exists():  # written whole (then renamed): the launcher may read it while a peer still fails
            part = path.with_name(f".{path.name}.{os.getpid()}")
            part.write_text(f"{time.time()!r}\n{traceback.format_exc()}")
            os.replace(part, path)


FORKSERVER_PRELOAD: list[str] = ["quietsync.cli.forkserver_exit", "torch"]
"""Modules the local workers' forkserver imports once before it forks them (the job function's own module is
added at each launch): what every worker would otherwise import afresh; first, the forkserver's exit without
the interpreter's teardown (:mod:`quietsync.cli.forkserver_exit`)."""


def _parent_of(pid: int) -> int | None:
    """The parent of ``pid`` (Linux ``/proc``), None where it cannot be read."""
    try:
        # after the last ')': the command name in parentheses may itself hold spaces or ')'
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _die_with_launcher(launcher_pid: int) -> None:
    """SIGTERM this worker when its launcher dies, so a ``kill -9`` of ``quietsync train`` leaves no worker
    training on; exit at once if the launcher is already gone.

    A worker whose parent is the launcher (torchrun's agent) asks the kernel (Linux ``PR_SET_PDEATHSIG``). A worker
    forked from the launcher's forkserver cannot: the forkserver outlives the launcher as long as any of its
    children lives (each holds the end of the pipe whose closing tells it to exit), so the worker watches the
    launcher itself (a pidfd, which becomes readable when the process ends)."""
    parent = os.getppid()
    if parent == launcher_pid:
        if not sys.platform.startswith("linux"):
            return  # no prctl: the peers' timeout still ends the job
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != launcher_pid:  # it died before it was asked: the signal will never come
            os._exit(1)
        return
    try:
        watched: int | None = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        os._exit(1)
    except (OSError, AttributeError):  # no pidfd (kernel < 5.3, not Linux): look every half second instead
        watched = None
    if _parent_of(parent) not in (launcher_pid, None):  # the pid is not (or no longer) our forkserver's launcher
        os._exit(1)

    def watch() -> None:
        if watched is not None:
            select.select([watched], [], [])
        else:
            while _alive(launcher_pid):
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="quietsync-launcher-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def _worker(local_rank: int, fn: Callable[..., Any], args: tuple, nproc: int, port: int, errors: str,
            launcher_pid: int, environ: dict[str, str] | None = None, output: str | None = None) -> None:
    _die_with_launcher(launcher_pid)
    take_environment(environ)
    if output is not None:  # the job's own log, as a launcher whose output went there would have written it
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        # line-buffered, as on a terminal: the log shows each line as it is written
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
    run_local_worker(local_rank, fn, args, nproc, port, errors)


def take_environment(environ: dict[str, str] | None) -> None:
    """Make ``environ`` (the launcher's, when it started this child) this process's environment: a forkserver's
    child starts with the forkserver's, which is the launcher's at the forkserver's start. None: keep it."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)


def start_method(preload: Sequence[str]) -> str:
    """The start method of local children: *forkserver*, whose server imports ``preload`` once (set here before
    the server starts, at its first use in this process; later uses reuse it as it is), else *spawn*."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(dict.fromkeys(preload)))
    return "forkserver"


def run_local_worker(local_rank: int, fn: Callable[..., Any], args: tuple, nproc: int, port: int,
                     errors: str) -> Any:
    """What each local worker of :func:`launch` runs, in whatever process starts it: torchrun's environment for
    worker ``local_rank`` of ``nproc`` on one node (port ``port``), loopback gloo, a file rendezvous and the
    failure notes in the folder ``errors``; then ``fn(*args)`` (its result returned), noting a failure."""
    os.environ.update({
        "RANK": str(local_rank), "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    })
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local workers talk over loopback only ...
    os.environ.setdefault(RENDEZVOUS_ENV, f"file://{errors}/rendezvous")  # ... and meet through a file
    os.environ[ERRORS_ENV] = errors
    try:
        return fn(*args)
    except BaseException:
        note_failure()  # when it failed, and why, unless fn noted it earlier
        raise


def launch(fn: Callable[..., Any], args: tuple = (), nproc: int = 1, preload: Sequence[str] = ()) -> Any:
    """Run ``fn(*args)`` in every worker; return its result when it ran in this process (else None).

    ``fn`` and ``args`` must be picklable (module-level function, dataclass arguments). ``preload``: modules the
    forkserver imports besides :data:`FORKSERVER_PRELOAD` and ``fn``'s own (what the job loads lazily). Raises
    :class:`WorkerFailed` for the worker that failed first (one worker runs in this process: its error too, so a
    caller ends in the same one line whatever ``nproc``); re-raises ``KeyboardInterrupt`` after stopping every
    worker.
    """
    if under_torchrun() and "TORCHELASTIC_RUN_ID" in os.environ:
        _die_with_launcher(os.getppid())  # torchrun's agent: a node whose agent is killed takes its workers along
    if under_torchrun():
        return fn(*args)
    if nproc <= 1:
        try:
            return fn(*args)
        except Exception as e:
            raise WorkerFailed(0, traceback.format_exc()) from e
    workers = LocalWorkers(fn, args, nproc, preload)
    try:
        while not workers.poll():
            pass
    except KeyboardInterrupt:
        workers.stop()
        raise
    finally:
        workers.close()
    return None


class LocalWorkers:
    """``nproc`` (> 1) local workers running ``fn(*args)``, started at construction and watched by :meth:`poll`
    (what :func:`launch` waits on; a caller that must be able to stop a job half-way, such as the planner's pilots,
    uses it directly). ``output``: a file every worker's standard output and error are appended to (else this
    process's). Workers come from this process's forkserver, started at the first use with ``preload``'s imports
    and reused by every later job of the process."""

    def __init__(self, fn: Callable[..., Any], args: tuple, nproc: int, preload: Sequence[str] = (),
                 output: str | os.PathLike[str] | None = None) -> None:
        import torch.multiprocessing as mp

        _quiet_teardown()
        method = start_method([*FORKSERVER_PRELOAD, *([fn.__module__] if fn.__module__ != "__main__" else []),
                               *preload])
        self._errors = tempfile.TemporaryDirectory(prefix="quietsync-launch-")
        self.errors = self._errors.name
        worker_args = (fn, args, nproc, free_port(), self.errors, os.getpid(), dict(os.environ),
                       None if output is None else os.fspath(output))
        self.context = mp.start_processes(_worker, args=worker_args, nprocs=nproc, join=False, start_method=method)

    def poll(self, poll_s: float = 0.5) -> bool:
        """Wait up to ``poll_s``; True once every worker ended well. Raises :class:`WorkerFailed` (the root cause)
        once one failed, its peers stopped."""
        import torch.multiprocessing as mp

        try:
            return _wait_for_workers(self.context, self.errors, poll_s)
        except mp.ProcessRaisedException as e:  # join has terminated the other workers
            raise first_failure(self.errors, e.error_index, e.msg) from None
        except mp.ProcessExitedException as e:
            raise first_failure(self.errors, e.error_index, str(e)) from None

    def stop(self) -> None:
        """Stop every worker still running (:func:`stop_workers`)."""
        stop_workers(self.context.processes)

    def close(self) -> None:
        """Remove the failure notes' folder (after the workers ended)."""
        self._errors.cleanup()


def _wait_for_workers(context: Any, errors: str, poll_s: float) -> bool:
    """Wait up to ``poll_s`` for the workers; True once all ended well. When one failed, the others are stopped
    at once (:func:`stop_workers`; torch's own join would give them two 5 s grace periods) and
    :class:`WorkerFailed` names the root cause."""
    import multiprocessing.connection

    running = [p.sentinel for p in context.processes if p.exitcode is None]
    if running:
        multiprocessing.connection.wait(running, timeout=poll_s)
    failed = [i for i, p in enumerate(context.processes) if p.exitcode not in (None, 0)]
    if failed:
        # a stopped worker raises nothing: its peers time out waiting for it, and one of them is the failure seen
        frozen = [i for i, p in enumerate(context.processes) if p.exitcode is None and _stopped(p.pid)]
        stop_workers(context.processes)
        failure = first_failure(errors, failed[0], _exit_details(context, failed[0]))
        if frozen and failure.rank not in frozen:
            failure.args = (f"{failure.args[0]} (worker {', '.join(map(str, frozen))} was stopped (SIGSTOP) and "
                            f"answered nothing: worker {failure.rank} timed out waiting for it)",)
        raise failure
    if any(p.exitcode is None for p in context.processes):
        return False
    return context.join(timeout=0)


def _exit_details(context: Any, index: int) -> str:
    """The traceback a failed worker left (torch's error file), or how it ended."""
    import pickle

    try:
        with open(context.error_files[index], "rb") as fh:
            return str(pickle.load(fh))
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, IndexError):
        code = context.processes[index].exitcode
        if code is not None and code < 0:
            return f"process {index} terminated with signal {signal_name(-code)}"
        return f"process {index} terminated with exit code {code}"


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; the bare number for a signal Python does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _quiet_teardown() -> None:
    """Keep a failed job's report to its one line: torch's log of each worker it terminates, and the
    resource tracker's warning about the semaphores of a killed worker (which it cleans up), are noise."""
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    quiet = "ignore:resource_tracker:UserWarning"  # read by the tracker process, started at the first spawn
    if quiet not in sys.warnoptions:
        sys.warnoptions.append(quiet)


def first_failure(errors: str, rank: int, details: str) -> WorkerFailed:
    """The :class:`WorkerFailed` of the root cause. ``rank`` is the worker torch saw exit first: if it died
    without noting an error (killed by a signal, or an ``os._exit``), its peers' errors are the consequence
    and it is blamed; otherwise the worker whose noted error came first is."""
    reports = {}
    for path in Path(errors).glob("rank*"):
        stamp, _, trace = path.read_text().partition("\n")
        try:
            reports[int(path.name[4:])] = (float(stamp), trace)
        except ValueError:  # a report cut short (its worker killed while writing it): nothing to order it by
            continue
    if reports and rank in reports:
        rank = min(reports, key=lambda r: reports[r][0])
        details = reports[rank][1]
    return WorkerFailed(rank, details)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, ``T`` in /proc): it cannot act on SIGTERM until continued."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def stop_workers(processes: list[Any], grace_s: float = GRACE_S) -> None:
    """SIGTERM every live worker (SIGKILL at once to a stopped one, which could not act on it), wait up to
    ``grace_s`` for all, then SIGKILL the rest."""
    for p in processes:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL if _stopped(p.pid) else signal.SIGTERM)
            except ProcessLookupError:  # it ended between the check and the signal
                pass
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))  # one grace for all, not one each
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5)
