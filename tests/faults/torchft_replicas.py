"""Replica groups of a ``--fault-tolerance torchft`` job as real processes on this machine, as a cluster runs
them: a Lighthouse (in the test process) and one ``quietsync train --replica-group K --lighthouse ...`` process per
replica group, forked from the tests' forkserver (torch and quietsync imported once: tests/distributed.py) so a
(re)start costs little. A process can be killed for real (``QUIETSYNC_FT_KILL``: it ``SIGKILL``s itself at a
named point), started again, held at a step until a restarted one is up (``QUIETSYNC_FT_HOLD``), and every
process started is accounted for at the end. With ``lighthouse_process=True`` the Lighthouse runs in a process of
its own at a fixed port, so a test can kill it (``SIGKILL``) and start it again at the same address.
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


def _lighthouse(config: Any) -> None:
    """A Lighthouse process (killed by the test)."""
    import threading

    from quietsync.faults.lighthouse import start_lighthouse

    server = start_lighthouse(config)  # noqa: F841 - serves until the process is killed
    threading.Event().wait()


class Replicas:
    """A Lighthouse and the replica group processes of one job (module docstring)."""

    def __init__(self, folder: Path, replicas: int, flags: list[str], heartbeat_timeout_ms: int = 1500,
                 lighthouse_process: bool = False) -> None:
        from quietsync.faults.lighthouse import LighthouseConfig, start_lighthouse
        from tests.distributed import free_port

        self.folder, self.replicas, self.flags = folder, replicas, flags
        self.lighthouse: Any = None
        """The Lighthouse's process (``lighthouse_process=True``), else None (it runs in this process)."""
        if lighthouse_process:
            self.config = LighthouseConfig(bind=f"127.0.0.1:{free_port()}", heartbeat_timeout_ms=heartbeat_timeout_ms,
                                           join_timeout_ms=5000)
            self.server = None
            self.address = self.config.bind
            self.start_lighthouse()
        else:
            self.server = start_lighthouse(LighthouseConfig(bind="127.0.0.1:0", join_timeout_ms=5000,
                                                            heartbeat_timeout_ms=heartbeat_timeout_ms))
            self.address = f"127.0.0.1:{self.server.address().rpartition(':')[2]}"
        self.started: list[tuple[int, Any]] = []
        """Every process started: (replica group, process)."""
        self.known: dict[int, set[str]] = {}
        """Incarnations of each replica group seen so far (see :meth:`go`, :meth:`wait_restarted`)."""

    def start_lighthouse(self, timeout: float = 60.0) -> None:
        """Start the Lighthouse's process (at the same address every time) and wait until it answers."""
        from quietsync.faults.lighthouse import reachable

        self.lighthouse = _CTX.Process(target=_lighthouse, args=(self.config,))
        self.lighthouse.start()
        deadline = time.monotonic() + timeout
        while reachable(self.address, 1.0) is not None:
            if time.monotonic() > deadline or not self.lighthouse.is_alive():
                raise TimeoutError(f"the Lighthouse at {self.address} did not come up within {timeout:g}s")
            time.sleep(0.05)

    def kill_lighthouse(self) -> None:
        """``SIGKILL`` the Lighthouse's process and wait until it is gone."""
        self.lighthouse.kill()
        self.lighthouse.join(10)
        assert self.lighthouse.exitcode == KILLED

    def wait_text(self, log: str, text: str, timeout: float = 90.0) -> None:
        """Wait until the log ``log`` (a name under the folder: ``replica0.0.log``) holds ``text``."""
        path = self.folder / log
        deadline = time.monotonic() + timeout
        while not (path.exists() and text in path.read_text()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{log} did not say {text!r} within {timeout:g}s:\n{self.logs()}")
            time.sleep(0.05)

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

    def status(self) -> str:
        """The Lighthouse's status page (quorum, pending requests, heartbeats)."""
        return urllib.request.urlopen(f"http://{self.address}/status", timeout=5).read().decode()

    def heartbeating(self, k: int) -> set[str]:
        """The incarnations (torchft replica ids) of replica group ``k`` that sent a heartbeat in the last second."""
        page = self.status()
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

    def asking(self) -> int:
        """How many replica groups' quorum requests the Lighthouse holds now (its status page)."""
        found = re.search(r"\[\d+/(\d+) participants healthy\]", self.status())
        return int(found.group(1)) if found else 0

    def wait_asking(self, count: int, held: list[Path], timeout: float = 90.0) -> None:
        """Once the survivors are held (each hold's ``PATH.waiting`` of ``held`` exists), wait until the Lighthouse
        holds ``count`` quorum requests: the returning replica groups' are in before the survivors are let go. A
        ``QUIETSYNC_FT_READY`` file alone is not enough: it is written just before the request is sent, and on a
        loaded machine a survivor let go at once can finish the run before that request arrives (its quorums then
        never wait for the returning replica, which finds the job over)."""
        for path in held:
            self.wait_file(Path(f"{path}.waiting"), timeout)
        deadline = time.monotonic() + timeout
        while self.asking() < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Lighthouse held fewer than {count} quorum request(s) after {timeout:g}s:\n"
                                   f"{self.logs()}")
            time.sleep(0.05)

    def rejoin(self, k: int, release: Path, env: dict[str, str] | None = None, workers: int = 1) -> Any:
        """Start replica group ``k`` again and, once its first quorum request is in, let the survivors held at
        ``release`` go: their next round start takes it in, and it heals there. Its process."""
        ready = self.folder / f"ready{k}.{len(self.started)}"
        proc = self.start(k, {**(env or {}), "QUIETSYNC_FT_READY": str(ready)}, workers=workers)
        self.wait_file(ready)  # about to ask for its first quorum
        self.wait_asking(1, [release])  # and its request is in
        release.write_text("")
        return proc

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
        """Pids of the started processes still running (the Lighthouse's included)."""
        lighthouse = [self.lighthouse] if self.lighthouse is not None else []
        return [p.pid for p in [*(p for _, p in self.started), *lighthouse] if p.is_alive()]

    def close(self) -> None:
        for _, proc in self.started:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        if self.server is not None:
            self.server.shutdown()
        if self.lighthouse is not None and self.lighthouse.is_alive():
            self.lighthouse.kill()
            self.lighthouse.join(10)


def wait_exit(replicas: Replicas, proc: Any, timeout: float = 150.0) -> int | None:
    """``proc``'s exit status, asserting it ended within ``timeout`` seconds."""
    code = replicas.join(proc, timeout)
    assert code is not None, f"{proc.name} still running after {timeout:g}s:\n{replicas.logs()}"
    return code


def records(out: Path, rank: int) -> list[dict[str, Any]]:
    """Step records of worker ``rank`` (every incarnation, in file order). Read while the worker writes: the text
    after the last newline is a record still being written, left for a later read."""
    path = out / f"metrics-rank{rank}.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [r for r in map(json.loads, lines) if "event" not in r]


def merged(record: dict[str, Any]) -> dict[str, list[int]]:
    """The windows the commits logged with a step record committed and gave back, in commit order."""
    commits = record.get("commits", [])
    return {k: [w for c in commits for w in c[k]] for k in ("committed", "given_back")}


def audit(out: Path, replicas: int, workers: int = 1) -> tuple[list[int], dict[str, Any]]:
    """The data audit of a run of ``replicas`` replica groups of ``workers`` workers, whatever the step each commit
    was logged at (one launched on a communication thread -- streaming DiLoCo's fragment -- lands during a later
    step, at a moment that differs between replicas). It checks that

    * every worker logged its commits in their order (torchft's numbers strictly increasing), each one its replica
      group took part in -- or, in a step where it trained no window (a replica's first step after a heal, under
      the asynchronous join: faults/async_join.py), one it abstained from;
    * the workers that logged the same commit (its number) agree on it: the replica groups in it, the step it was
      launched at, the windows it committed and gave back;
    * the commits logged, with those of the run's end (the summary's), are numbered 1..N: none missing;
    * every window committed was trained (logged) by a worker of a replica group in the commit, and every window
      trained is committed or given back by a commit, or still held by the run.

    Returns the windows committed, in commit order, and the summary's fault-tolerance section."""
    summary = json.loads((out / "summary.json").read_text())["fault_tolerance"]
    by_number: dict[int, dict[str, Any]] = {}
    trained: dict[int, set[int]] = {k: set() for k in range(replicas)}

    def take(commit: dict[str, Any], who: str) -> None:
        seen = by_number.setdefault(commit["id"], commit)
        assert seen == commit, f"{who} logged commit {commit['id']} as {commit}, another replica as {seen}"

    for rank in range(replicas * workers):
        group, last = rank // workers, 0
        for r in records(out, rank):
            trained[group].update(r.get("windows", []))
            for c in r.get("commits", []):
                assert c["id"] > last, f"worker {rank} logged commit {c['id']} after commit {last}"
                assert group in c["members"] or r.get("windows") == [], \
                    f"worker {rank} logged commit {c['id']} without its replica group, in a step it trained in: {c}"
                take(c, f"worker {rank}")
                last = c["id"]
    for c in summary.get("finish_commits") or []:
        take(c, "the summary")
    numbers = sorted(by_number)
    assert numbers == list(range(1, len(numbers) + 1)), f"commits missing: logged {numbers}"
    commits = [by_number[n] for n in numbers]
    for c in commits:
        mine = set().union(*(trained[k] for k in c["members"]))
        assert set(c["committed"]) <= mine, f"commit {c['id']} holds windows no member trained: {c}"
    committed = [w for c in commits for w in c["committed"]]
    accounted = set(committed) | {w for c in commits for w in c["given_back"]} | set(summary["windows_held"])
    assert set().union(*trained.values()) <= accounted, "a window trained and neither committed nor given back"
    return committed, summary
