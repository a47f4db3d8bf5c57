"""Replica groups of a ``--fault-tolerance torchft`` job as real processes on this machine, as a cluster runs
them: a Lighthouse (in the test process) and one ``quietsync train --replica-group K --lighthouse ...`` process per
replica group, forked from the tests' forkserver (torch and quietsync imported once: tests/distributed.py) so a
(re)start costs little. A process can be killed for real (``QUIETSYNC_FT_KILL``: it ``SIGKILL``s itself at a
named point), started again, held at a step until a restarted one is up (``QUIETSYNC_FT_HOLD``), and every
process started is accounted for at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.distributed import _CTX
from tests.train.conftest import synthetic_text

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
AUDIT = {"QUIETSYNC_AUDIT_DATA": "1"}
KILLED = -signal.SIGKILL
"""The exit status of a process killed with ``SIGKILL``."""


def job_flags(root: Path, out: Path, *more: str) -> list[str]:
    """The tests' job: a tiny model on a synthetic corpus written once under ``root``, one thread per worker."""
    data = root / "text.txt"
    if not data.exists():
        data.write_text(synthetic_text(2000))
    return ["--model", "tiny", "--micro-batch-size", "2", "--seq-len", "32", "--vocab-size", "300", "--dataset",
            str(data), "--cache-dir", str(root / "cache"), "--eval-every", "0", "--eval-windows", "4",
            "--no-progress", "--no-plot", "--timeout-s", "30", "--threads", "1", "--out", str(out), *more]


def _replica(argv: list[str], env: dict[str, str], log: str) -> None:
    os.environ.update(env)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k, None)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from quietsync.commands.main import main

    code = main(["train", *argv])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Replicas:
    """A Lighthouse and the replica group processes of one job (module docstring)."""

    def __init__(self, folder: Path, replicas: int, flags: list[str], heartbeat_timeout_ms: int = 1500) -> None:
        from quietsync.faults.lighthouse import LighthouseConfig, start_lighthouse

        self.folder, self.replicas, self.flags = folder, replicas, flags
        self.server = start_lighthouse(LighthouseConfig(bind="127.0.0.1:0", heartbeat_timeout_ms=heartbeat_timeout_ms,
                                                        join_timeout_ms=5000))
        self.address = f"127.0.0.1:{self.server.address().rpartition(':')[2]}"
        self.started: list[tuple[int, Any]] = []
        """Every process started: (replica group, process)."""
        self.known: dict[int, set[str]] = {}
        """Incarnations of each replica group seen so far (see :meth:`go`, :meth:`wait_restarted`)."""

    def start(self, k: int, env: dict[str, str] | None = None, workers: int = 1) -> Any:
        """Start replica group ``k`` (``workers`` worker processes) with ``env`` added to its environment."""
        argv = [*self.flags, "--fault-tolerance", "torchft", "--lighthouse", self.address, "--nodes",
                str(self.replicas), "--nproc", str(workers), "--replica-group", str(k)]
        starts = sum(1 for r, _ in self.started if r == k)
        log = str(self.folder / f"replica{k}.{starts}.log")
        proc = _CTX.Process(target=_replica, args=(argv, {**OFFLINE, **AUDIT, **(env or {})}, log))
        proc.start()
        self.started.append((k, proc))
        return proc

    def heartbeating(self, k: int) -> set[str]:
        """The incarnations (torchft replica ids) of replica group ``k`` that sent a heartbeat in the last second."""
        page = urllib.request.urlopen(f"http://{self.address}/status", timeout=5).read().decode()
        seen = re.findall(rf"(quietsync_replica_{k}:[0-9a-f-]+): seen ([0-9.]+)(m?s) ago", page)
        return {name for name, value, unit in seen if float(value) * (1e-3 if unit == "ms" else 1.0) < 1.0}

    def wait_heartbeat(self, k: int, timeout: float, known: set[str] = frozenset()) -> set[str]:
        """Wait until an incarnation of replica group ``k`` not in ``known`` sends heartbeats; all that do."""
        deadline = time.monotonic() + timeout
        while not (self.heartbeating(k) - set(known)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica group {k} sent no heartbeat within {timeout:g}s:\n{self.logs()}")
            time.sleep(0.05)
        return self.heartbeating(k)

    def go(self, flag: Path, groups: list[int], timeout: float = 90.0) -> None:
        """Once every replica group of ``groups`` sends heartbeats (held before its first quorum), let them join."""
        self.known = {k: self.wait_heartbeat(k, timeout) for k in groups}
        flag.write_text("")

    def wait_restarted(self, k: int, timeout: float = 90.0) -> None:
        """Wait until a new incarnation of replica group ``k`` sends heartbeats."""
        self.known[k] = self.known.get(k, set()) | self.wait_heartbeat(k, timeout, self.known.get(k, set()))

    def wait_file(self, path: Path, timeout: float = 90.0) -> None:
        """Wait until ``path`` exists (a replica's ``QUIETSYNC_FT_READY`` file, a survivor's records)."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} did not appear within {timeout:g}s:\n{self.logs()}")
            time.sleep(0.05)

    def join(self, proc: Any, timeout: float) -> int | None:
        proc.join(timeout)
        return proc.exitcode

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.folder.glob("replica*.log")))

    def alive(self) -> list[int]:
        """Pids of the started processes still running."""
        return [p.pid for _, p in self.started if p.is_alive()]

    def close(self) -> None:
        for _, proc in self.started:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        self.server.shutdown()


def wait_exit(replicas: Replicas, proc: Any, timeout: float = 150.0) -> int | None:
    """``proc``'s exit status, asserting it ended within ``timeout`` seconds."""
    code = replicas.join(proc, timeout)
    assert code is not None, f"{proc.name} still running after {timeout:g}s:\n{replicas.logs()}"
    return code


def records(out: Path, rank: int) -> list[dict[str, Any]]:
    """Step records of worker ``rank`` (every incarnation, in file order)."""
    path = out / f"metrics-rank{rank}.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "event" not in r] if path.exists() else []


def audit(out: Path, replicas: int) -> tuple[list[int], dict[str, Any]]:
    """The windows every commit committed, in commit order, checked to agree between the replicas that logged the
    same step; and the summary's fault-tolerance section."""
    by_step: dict[int, set[tuple[int, ...]]] = {}
    for rank in range(replicas):
        for r in records(out, rank):
            if "commit" in r:
                by_step.setdefault(r["step"], set()).add(tuple(r["commit"]["committed"]))
    disagree = {s: v for s, v in by_step.items() if len(v) != 1}
    assert not disagree, f"replicas logged different commits for the same step: {disagree}"
    summary = json.loads((out / "summary.json").read_text())["fault_tolerance"]
    committed = [w for s in sorted(by_step) for w in next(iter(by_step[s]))]
    if summary.get("finish_commit"):
        committed += summary["finish_commit"]["committed"]
    return committed, summary
