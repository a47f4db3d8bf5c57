"""Starting the replica groups of a ``--fault-tolerance torchft`` job.

* **On one machine** (no ``--replica-group``): the launcher starts a Lighthouse in its own process (unless
  ``--lighthouse`` names one), then ``--nodes`` replica groups, each a child process with ``--nproc / --nodes``
  workers (one: the child trains itself; several: it spawns them, :mod:`quietsync.cli.launch`). When a replica
  group dies -- ``kill -9``, a crash, or a replica that fell behind its peers -- the launcher starts it again, up
  to ``--replica-restarts`` times: it heals from a live peer and rejoins, while the others never restart. One that
  dies more often is left dead and the others finish the run (exit 0; the job's last line names it); the job
  fails (exit 1) only when every replica group ran out. A replica group stopped by ``--on-nonfinite`` (exit 3,
  :data:`~quietsync.train.replica_nonfinite.NONFINITE_EXIT`: every replica raises at the same commit vote) is not
  started again -- it would heal and train into the same values -- and the job exits 3 once the others have
  stopped too (at most ``--timeout-s`` later; then they are stopped). An interrupt stops everything (exit 130).
  Children die with the launcher. They are forked from a forkserver that imported torch, the replica loop and
  the model classes once (:func:`_replica_context`): a replica group started again does not import them again.
* **One replica group of a cluster job** (``--replica-group K --lighthouse HOST:PORT``): this machine's replica
  group only -- its ``--nproc`` local workers, or torchrun's -- and the cluster's scheduler restarts it (it exits 3
  when stopped by a non-finite value: a scheduler should not restart that).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
import traceback
from typing import Any

from ..cli.launch import signal_name
from ..faults.inject import group_environment
from ..faults.quorum import FellBehind, HealFailed, NoQuorum
from .args import PROG
from .nonfinite import NonFiniteError
from .replica_loop import run_replica
from .replica_nonfinite import NONFINITE_EXIT
from .replicas import ReplicasDiffer

POLL_S = 0.2

PROTOCOL_STOPS = (NoQuorum, FellBehind, HealFailed, ReplicasDiffer)
"""A replica group's stops that its message explains in full: said in one line, without a traceback (the last: it
leaves to heal, ``--on-replicas-differ heal``)."""


def run_one_replica_group(cfg: Any, strategy_config: Any, replica: int, replicas: int, lighthouse: str,
                          workers: int) -> int:
    """Run replica group ``replica``'s workers here (in place under torchrun); its exit status (0, 1, 130, or
    :data:`NONFINITE_EXIT` when ``--on-nonfinite`` stopped it)."""
    from ..cli.launch import WorkerFailed, launch
    from .job_model import worker_preload

    try:
        launch(run_replica, (cfg, strategy_config, replica, replicas, lighthouse), nproc=workers,
               preload=worker_preload(cfg.model))
    except (NonFiniteError, WorkerFailed, *PROTOCOL_STOPS) as e:
        # a worker run in this process (one worker, or under torchrun): its own error, said in one clean line
        own = e.__cause__ if isinstance(e, WorkerFailed) else e
        if isinstance(own, NonFiniteError):
            print(f"{PROG} train: error: replica group {replica}: NonFiniteError: {own}", file=sys.stderr, flush=True)
            return NONFINITE_EXIT
        # the protocol's own stops (no quorum; left out, or a heal source lost: restarted, it heals): their
        # messages say why, a traceback would only bury them
        # leaving to heal (--on-replicas-differ heal) is what was asked for, not an error
        kind = "" if isinstance(own, ReplicasDiffer) or f".{ReplicasDiffer.__name__}: " in str(e) else "error: "
        if isinstance(own, PROTOCOL_STOPS):
            said = str(own).removeprefix("quietsync: ").removeprefix(f"replica group {replica}: ")  # said once below
            print(f"{PROG} train: {kind}replica group {replica}: {said}", file=sys.stderr, flush=True)
            return 1
        if any(f".{stop.__name__}: " in str(e) for stop in PROTOCOL_STOPS):  # a spawned worker's, as text
            print(f"{PROG} train: {kind}replica group {replica}: {e}", file=sys.stderr, flush=True)
            return 1
        print(e.details, file=sys.stderr)
        print(f"{PROG} train: error: replica group {replica}: {e}", file=sys.stderr, flush=True)
        return NONFINITE_EXIT if "NonFiniteError: " in str(e) else 1  # a worker's error arrives as text
    except KeyboardInterrupt:
        return 130
    return 0


def _replica_main(cfg: Any, strategy_config: Any, replica: int, replicas: int, lighthouse: str, workers: int,
                  launcher: int, environ: dict[str, str] | None = None) -> None:
    """A replica group child of the local launcher."""
    from ..cli.launch import _die_with_launcher, take_environment

    _die_with_launcher(launcher)
    take_environment(environ)
    try:
        code = run_one_replica_group(cfg, strategy_config, replica, replicas, lighthouse, workers)
    except BaseException:  # noqa: BLE001 - the child's traceback, then its exit status
        traceback.print_exc()
        code = 1
    # os._exit below skips Python's clean-up: flush by hand
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


REPLICA_PRELOAD = ("torch", "quietsync.train.replica_launch", "quietsync.train.replica_loop")
"""What the replica groups' forkserver imports before it forks them (besides the workers' model classes)."""


def _replica_context(model: str) -> Any:
    """Where replica groups come from: a forkserver that imported torch, the replica loop (torchft with it) and the
    model classes once, so a replica group started again after a failure does not import them again (seconds of
    CPU on its way back to training); *spawn* where the platform has no forkserver. Not a fork of this process:
    it runs the Lighthouse's threads."""
    from ..cli.launch import start_method
    from .job_model import worker_preload

    return multiprocessing.get_context(start_method([*REPLICA_PRELOAD, *worker_preload(model)]))


def _ended(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal_name(-code)}"
    return f"exit status {code}"


def run_local_replicas(cfg: Any, strategy_config: Any, replicas: int) -> int:
    """The local launcher (module docstring); the job's exit status."""
    from ..faults.lighthouse import LighthouseConfig, start_lighthouse

    workers = cfg.nproc // replicas
    if not cfg.threads:
        # every replica group's workers share this machine's cores
        cfg = dataclasses.replace(cfg, threads=max(1, (os.cpu_count() or 1) // cfg.nproc))
    server = None
    if cfg.lighthouse is None:
        server = start_lighthouse(LighthouseConfig(bind="127.0.0.1:0"))
        address = f"127.0.0.1:{server.address().rpartition(':')[2]}"
    else:
        address = cfg.lighthouse
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # replica groups of one machine talk over loopback
    context = _replica_context(cfg.model)
    children: dict[int, Any] = {}
    restarts = dict.fromkeys(range(replicas), 0)
    finished: set[int] = set()
    given_up: set[int] = set()  # out of restarts: left dead while the others go on
    nonfinite: float | None = None  # when a replica group stopped for a non-finite value

    def start(k: int) -> None:
        child = context.Process(target=_replica_main, name=f"quietsync-replica{k}",
                                args=(cfg, strategy_config, k, replicas, address, workers, os.getpid(),
                                      # a forkserver child starts with the forkserver's environment
                                      group_environment(dict(os.environ), k)))
        child.start()
        children[k] = child

    def stop_all() -> None:
        from ..cli.launch import stop_workers

        stop_workers([c for c in children.values() if c.is_alive()])

    print(f"{PROG} train: --fault-tolerance torchft: {replicas} replica groups of {workers} worker(s), Lighthouse at "
          f"{address}; a replica group that dies is started again (up to {cfg.replica_restarts} times) and heals "
          "from a live peer", flush=True)
    try:
        for k in range(replicas):
            start(k)
        while len(finished) < replicas:
            running = [c.sentinel for k, c in children.items() if k not in finished and c.exitcode is None]
            if running:
                multiprocessing.connection.wait(running, timeout=POLL_S)
            for k, child in list(children.items()):
                if k in finished or child.exitcode is None:
                    continue
                if child.exitcode == 0:
                    finished.add(k)
                    continue
                # after a non-finite stop no group is started again
                if child.exitcode == NONFINITE_EXIT or nonfinite is not None:
                    if child.exitcode == NONFINITE_EXIT and nonfinite is None:
                        nonfinite = time.monotonic()
                        print(f"{PROG} train: error: replica group {k} stopped for a non-finite value "
                              "(--on-nonfinite); it is not started again, the job stops", file=sys.stderr, flush=True)
                    finished.add(k)
                    continue
                # the last one, after the others ended the run: a restart would find no live peer to heal from
                if finished - given_up and len(finished) + 1 == replicas:
                    print(f"{PROG} train: replica group {k} ended ({_ended(child.exitcode)}) after the others had "
                          "finished the run", file=sys.stderr, flush=True)
                    finished.add(k)
                    continue
                if restarts[k] >= cfg.replica_restarts:
                    # the others go on without it: stopping them would lose the run (torchft runs write no checkpoints)
                    print(f"{PROG} train: replica group {k} ended ({_ended(child.exitcode)}) and was restarted "
                          f"{restarts[k]} time(s) already (--replica-restarts {cfg.replica_restarts}): it is not "
                          "started again, the others go on without it", file=sys.stderr, flush=True)
                    finished.add(k)
                    given_up.add(k)
                    continue
                restarts[k] += 1
                print(f"{PROG} train: replica group {k} ended ({_ended(child.exitcode)}); starting it again (restart "
                      f"{restarts[k]} of {cfg.replica_restarts}): it heals from a live peer", flush=True)
                start(k)
            if nonfinite is not None and time.monotonic() - nonfinite > cfg.timeout_s:
                stop_all()  # every replica met the same vote; one that did not (it was joining) is stopped
                break
            time.sleep(0)
    except KeyboardInterrupt:
        stop_all()
        print(f"{PROG} train: interrupted", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.shutdown()
    if nonfinite is not None:
        return NONFINITE_EXIT
    if len(given_up) == replicas:
        print(f"{PROG} train: error: every replica group ended more often than --replica-restarts "
              f"{cfg.replica_restarts} allows", file=sys.stderr, flush=True)
        return 1
    if given_up:  # said when it happened too: the job's last line is where a reader looks
        dead, many = sorted(given_up), len(given_up) > 1
        print(f"{PROG} train: replica group{'s' if many else ''} {', '.join(map(str, dead))} ended more often than "
              f"--replica-restarts {cfg.replica_restarts} allows and {'were' if many else 'was'} left dead; the "
              f"others finished the run without {'them' if many else 'it'}", file=sys.stderr, flush=True)
    return 0


__all__ = ["run_local_replicas", "run_one_replica_group"]
