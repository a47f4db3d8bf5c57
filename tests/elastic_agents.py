"""Several torchrun agents on this machine as the nodes of one elastic ``quietsync train --elastic`` job: start
them, kill one (``kill -9`` of the agent, or of one of its workers), start it again, wait for the end, and
account for every process they started.

Agent ``i`` is ``torchrun --nnodes MIN:MAX --nproc-per-node P --max-restarts K --rdzv-backend c10d
--rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID --rdzv-conf last_call_timeout=L,keep_alive_interval=2,
keep_alive_max_attempt=3 --monitor-interval M -m quietsync train --elastic ...`` with its output in
``agent{i}.{k}.log`` (the k-th start). A node whose agent was killed is declared dead after 6 s without its
heartbeat instead of torch's default 15 s (5 s × 3): the survivors' restart waits for that. Agent 0 is
started first (:meth:`Agents.start_host`) and hosts the rendezvous store -- the c10d backend's first agent to
bind the endpoint does, so the others start only once the store listens: kill the others. A thread records
every process under the agents as it appears, so :meth:`Agents.survivors` can say whether anything outlived the
job, and when each process was first and last seen (the timeline of a membership change).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.distributed import free_port, interruptible

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _children(pid: int) -> list[int]:
    """The children of process ``pid`` (none once it has exited: its /proc folder may go while it is read)."""
    kids = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return kids
    for task in tasks:
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def descendants(pid: int) -> list[int]:
    kids = _children(pid)
    return kids + [d for k in kids for d in descendants(k)]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


WORKER = "-m quietsync train "
"""What a worker's command line holds (``torchrun ... -m quietsync train`` starts each one so)."""


@dataclass
class Seen:
    """A process under an agent: when it was first and last seen alive (monotonic seconds)."""

    pid: int
    agent: int
    first: float
    last: float
    worker: bool = field(default=False)
    """Whether it runs ``python -m quietsync train`` (a worker) rather than a helper of the agent."""


class Agents:
    """``n`` torchrun agents of one elastic job (see the module docstring)."""

    def __init__(self, folder: Path, n: int, train_flags: list[str], *, nnodes: str, nproc_per_node: int = 1,
                 max_restarts: int = 3, last_call_timeout: float = 2.0, monitor_interval: float = 0.5,
                 env: dict[str, str] | None = None) -> None:
        self.folder = Path(folder)
        self.n = n
        self.port = free_port()
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        self.base = [torchrun, "--nnodes", nnodes, "--nproc-per-node", str(nproc_per_node), "--max-restarts",
                     str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                     "--rdzv-id", f"qs-elastic-{self.port}", "--rdzv-conf",
                     f"last_call_timeout={last_call_timeout:g},keep_alive_interval=2,keep_alive_max_attempt=3",
                     "--monitor-interval", f"{monitor_interval:g}",
                     "-m", "quietsync", "train", "--elastic", *train_flags]
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
        self.env.update(OFFLINE)
        self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # what --elastic asks for (docs/train.md)
        self.env.update(env or {})
        self.procs: dict[int, subprocess.Popen] = {}
        self.starts: dict[int, int] = {}
        self.seen: dict[int, Seen] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._watch = threading.Thread(target=self._track, daemon=True)
        self._watch.start()

    def _track(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                procs = dict(self.procs)
            for i, p in procs.items():
                for pid in [p.pid, *descendants(p.pid)]:
                    if not alive(pid):
                        continue
                    s = self.seen.get(pid)
                    if s is None:
                        self.seen[pid] = Seen(pid, i, now, now, WORKER in cmdline(pid)
                                              and pid != p.pid)
                    else:
                        s.last = now
            time.sleep(0.1)

    def start(self, i: int) -> subprocess.Popen:
        """Start agent ``i`` (again)."""
        k = self.starts.get(i, 0)
        self.starts[i] = k + 1
        log = open(self.folder / f"agent{i}.{k}.log", "w")
        proc = subprocess.Popen(self.base, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                preexec_fn=interruptible, cwd=self.folder)
        log.close()
        with self._lock:
            self.procs[i] = proc
        return proc

    def start_host(self, timeout: float = 120.0) -> subprocess.Popen:
        """Start agent 0 and return once the rendezvous store it hosts listens (:meth:`wait_for_store`)."""
        proc = self.start(0)
        self.wait_for_store(timeout)
        return proc

    def wait_for_store(self, timeout: float = 120.0) -> None:
        """Return once agent 0's rendezvous store accepts connections. On this machine every agent's endpoint is
        local, so whichever binds it first hosts the store: an agent started before agent 0 had bound it (a loaded
        machine can take seconds to import torch) would host it, and killing that agent would take the store, and
        the job, with it."""
        proc, deadline = self.procs[0], time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
                return
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"agent 0 ended (exit {proc.returncode}) before its rendezvous store "
                                       f"listened\n{self.logs()}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"agent 0's rendezvous store did not listen on port {self.port} within "
                                       f"{timeout:g} s\n{self.logs()}") from None
                time.sleep(0.1)

    def workers(self, i: int) -> list[int]:
        """Live worker processes of agent ``i``."""
        p = self.procs[i]
        return [d for d in descendants(p.pid) if alive(d) and WORKER in cmdline(d)]

    def kill_agent(self, i: int) -> float:
        """``kill -9`` agent ``i`` (its workers get SIGTERM from the kernel); returns when it was killed."""
        t = time.monotonic()
        os.kill(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait(10)
        return t

    def wait(self, timeout: float) -> dict[int, int | None]:
        """Wait for every agent to exit (killing all that remain after ``timeout``); their exit codes."""
        deadline = time.monotonic() + timeout
        codes: dict[int, int | None] = {}
        for i, p in self.procs.items():
            try:
                codes[i] = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[i] = None
        if any(c is None for c in codes.values()):
            self.close()
        return codes

    def survivors(self, grace_s: float = 15.0) -> list[Seen]:
        """Processes the agents started that are still alive ``grace_s`` after the agents ended."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(s.pid) for s in self.seen.values()):
            time.sleep(0.2)
        return [s for s in self.seen.values() if alive(s.pid)]

    def logs(self) -> str:
        return "\n".join(f"==== {p.name}\n{p.read_text()[-6000:]}" for p in sorted(self.folder.glob("agent*.log")))

    def close(self) -> None:
        """Kill everything still running (the test's clean-up)."""
        self._stop.set()
        for p in self.procs.values():
            if p.poll() is None:
                for pid in descendants(p.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                p.kill()
                p.wait(10)
        for s in self.seen.values():
            if alive(s.pid):
                try:
                    os.kill(s.pid, signal.SIGKILL)
                except OSError:
                    pass
