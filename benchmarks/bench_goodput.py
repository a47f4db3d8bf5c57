"""Goodput under a failure schedule (issue 28): the same job -- 2 replicas of one worker each (a core per worker
on this 2-core machine), one thread each, tiny model -- run failure-free, and with replica 1 killed (``kill -9``)
every ``T`` seconds and started again ``D`` seconds later, under

* ``plain``: no fault tolerance, no failures (the reference: ``quietsync train --nodes 2``, its two workers
  started directly as torchrun starts them, as the torchft runs start their replicas: no launcher in the clock);
* ``torchft-free``: ``--fault-tolerance torchft``, no failures (what the per-step quorum costs by itself);
* ``elastic``: ``--elastic`` (one torchrun agent per replica, ``--nnodes 1:N``; agent 1 killed and started again): every
  membership change restarts every worker from the newest checkpoint;
* ``torchft``: ``--fault-tolerance torchft`` (a Lighthouse and one ``quietsync train --replica-group K`` process
  per replica; replica 1 killed and started again): the survivor goes on, the returning replica heals from it.

Goodput = committed tokens per second of the job's wall time (first process started → last one ended) ÷ the
``plain`` run's. Every run commits the same tokens (``--max-steps`` counts tokens: a step with one replica missing
holds half the tokens, the schedule follows tokens), so goodput is the plain run's wall time over the run's. Beside
it: the final held-out loss, the steps each replica count trained, and for each return of replica 1 the seconds
from its process starting to its first committed step, and the longest gap between two of the survivor's steps
around it (its pause).

A run that has not ended ``--limit`` seconds after its start is stopped and recorded as unfinished: its tokens are
the ones its newest checkpoint holds (``elastic``: what a restart keeps), its goodput those over the limit. Under a
schedule whose period is shorter than what a membership change costs ``--elastic``, that is what happens: every kill
and every return restarts every worker (measured here under shared load: 10.7 and 12.6 s from the returning agent's
start to the 2-worker world's first step; more than the 13 s it stayed up in the periods where it never got there),
so a period leaves the restarted world 0 to ~2 s of training before the next kill, often less than one checkpoint
interval (diloco H=20: every 20 steps, ~0.6 s): the job restarts from the same checkpoint again and again. Measured
in two short repros (diloco H=20, 600 steps, T=20 s, D=7 s, under shared load): the 2-worker world trained steps
1-140 before the first kill, then only 9 steps (never checkpointed) in the next 50 s; and 1-100, then nothing from
20 s to 77.7 s (neither the survivor alone, whose restart outlasts the 7 s down time, nor the world of 2, whose
restart outlasts the 13 s up time), then 101-130 (checkpoint 120 kept) before the kill at 80 s.

``--replicas N`` runs N replicas (elastic: N torchrun agents). With more replicas than cores (4 on this 2-core
machine) each is pinned to one core with the others of its core (k per core: every replica runs at 1/k of a core,
as on k-times slower machines), and while replica 1 is down a process spinning on its core holds its share, so the
replicas sharing that core do not speed up: a dead machine's compute is gone, not handed to the survivors (8 on
this machine: ``--replicas 8 --steps 750``, the same tokens as 4 × 1,500). With 2
replicas the failures' cost has a floor whatever the engine does: for the ~23.5 s replica 1 is down or restarting
per period the job trains at half its speed; with N replicas at 1/N -- goodput ≤ 1 − (D + restart)/(N·T) in the
steady state.

``--dilate`` (torchft modes, more replicas than cores) makes such a run stand for the same job with **a core per
replica**: with k replicas per core every replica's work -- steps, imports, the heal, gloo's copies -- takes k times
as long, so every clock of the run is multiplied by k too: the schedule (``T``, ``D``), the Lighthouse's heartbeat
timeout, join timeout and quorum tick, and the survivor's pause window -- the run is then the core-per-replica run
slowed k times throughout, and its goodput (a ratio of the same job's wall times) is that run's. The plain reference
it is judged against is the same job at k per core (it has no clock to scale). What it cannot stand for: a
Lighthouse on its own machine (here it shares the cores) and a real network (here loopback at k times less CPU).
``--replicas 8 --steps 3000 --dilate`` on this 2-core machine: 4 per core, clocks x4 (kill every 240 s, back 80 s
later, heartbeat 8 s): the 8-replica job of ~180 core-equivalent seconds that 8 real cores would run without
``--dilate``.

``--heavy-env`` starts every replica process with a heavy environment's imports first (:data:`HEAVY_IMPORTS`:
transformers' trainer, datasets, pandas, pyarrow, matplotlib, sympy, optuna, sqlalchemy, tensorboard, torch's
compiler -- what a stock GPU image's ``import transformers`` pulls in), so a returning replica pays what it pays on
such a host. ``--standby`` (torchft) runs replica 1's returns as standbys (``quietsync train --standby PATH``): a
standby is started beside the job, imports, opens the data, builds and warms the model, then waits; at each return
the benchmark creates its file (it joins and heals at once) and starts the next standby beside it (its start-up
shares replica 1's core for a few seconds: the standby's cost). A return is then timed from that moment.
``--no-async-join`` (torchft) runs every replica with ``--no-async-join`` (a returning replica computes its first
step while the others wait in its average; the run's file ends in ``-syncjoin``); ``--joins RUNS...`` prints the
survivor's join steps of the runs recorded there, per join mode.

Each run is one invocation (``--run STRATEGY MODE``), so each takes the CPU lock on its own::

    for s in ddp diloco; do for m in plain torchft-free elastic torchft; do
        .venv/bin/python benchmarks/bench_goodput.py --run $s $m; done; done
    .venv/bin/python benchmarks/bench_goodput.py --report

Runs land in ``runs/goodput/RUN.json``; ``--report`` writes ``benchmarks/results/goodput.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from common import OFFLINE, PY_MAIN, RESULTS, cpu_model, write_markdown  # noqa: E402

from quietsync.cli.launch import free_port  # noqa: E402
from quietsync.faults.lighthouse import HEARTBEAT_TIMEOUT_MS  # noqa: E402
from tests.elastic_agents import Agents  # noqa: E402
from tests.train.conftest import synthetic_text  # noqa: E402

RUNS = ROOT / "runs" / "goodput"
MODES = ("plain", "torchft-free", "elastic", "torchft")
STRATEGIES = {"ddp": ["--strategy", "ddp"], "diloco": ["--strategy", "diloco", "--sync-every", "20"]}
HEAVY_IMPORTS = ("import transformers, datasets, pandas, pyarrow, matplotlib.pyplot, sympy, optuna, sqlalchemy, "
                 "tensorboard, torch._dynamo; from transformers import Trainer; ")
"""What ``--heavy-env`` makes every replica process import before quietsync (module docstring)."""


def job_flags(root: Path, out: Path, strategy: str, steps: int, seed: int) -> list[str]:
    """The job every mode runs (its --out aside)."""
    return [*STRATEGIES[strategy], "--model", "tiny", "--max-steps", str(steps), "--micro-batch-size", "8",
            "--seq-len", "128", "--vocab-size", "512", "--dataset", str(root / "text.txt"), "--cache-dir",
            str(root / "cache"), "--eval-every", "0", "--eval-windows", "32", "--no-progress", "--no-plot",
            "--no-export", "--timeout-s", "30", "--threads", "1", "--seed", str(seed), "--out", str(out)]


def records(out: Path) -> list[dict[str, Any]]:
    """Every worker's step records (all incarnations), in no particular order."""
    rows = []
    for path in out.glob("metrics-rank*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "event" not in r and "unix_s" in r:
                rows.append(r)
    return rows


class Schedule:
    """Replica 1 killed every ``period`` seconds from the job's start, started again ``down`` seconds later."""

    def __init__(self, period: float, down: float) -> None:
        self.period, self.down = period, down
        self.events: list[tuple[str, float]] = []
        """("kill" | "start", unix time) of replica 1."""

    def drive(self, t0: float, running, kill, start) -> None:  # noqa: ANN001 - callables
        """Until ``running()`` is false: kill at t0 + k*period, start at t0 + k*period + down."""
        def until(moment: float) -> bool:
            """Wait for ``moment`` while the job runs; whether it still runs."""
            while running() and time.time() < moment:
                time.sleep(0.05)
            return running()

        k = 1
        while running():
            kill_at = t0 + k * self.period
            for at, act, event in ((kill_at, kill, "kill"), (kill_at + self.down, start, "start")):
                if not until(at):
                    return
                act()
                self.events.append((event, time.time()))
            k += 1


CORES: list[int] | None = None
"""``--cores``: the CPUs this run's replicas are pinned to, one each in turn (None: every CPU of the machine, pinned
only where the replicas outnumber them)."""


def parse_cores(text: str) -> list[int]:
    """``"0-7"`` / ``"0,2,4-6"`` as a sorted list of CPU numbers; ValueError naming the form on anything else."""
    cores: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"--cores takes CPU numbers and ranges such as 0-7 or 0,2,4-6; got {text!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"--cores: the range {part.strip()!r} runs backwards")
        cores.update(range(first, last + 1))
    return sorted(cores)


def core_count() -> int:
    """The CPUs the replicas run on: ``--cores``' or the machine's."""
    return len(CORES) if CORES else (os.cpu_count() or 1)


def core_of(k: int, replicas: int) -> int | None:
    """The core replica ``k`` is pinned to: with ``--cores``, the ``k``-th of them (mod their number), so two jobs
    can run side by side on disjoint cores of one machine, each replica on a core of its own; without, only when the
    replicas outnumber the machine's cores (``k`` mod the cores: each core holds the same number of replicas --
    ``main`` refuses other counts -- so every replica runs at the same fraction of a core); None: unpinned."""
    if CORES:
        return CORES[k % len(CORES)]
    cores = os.cpu_count() or 1
    return None if replicas <= cores else k % cores


def pinned(core: int | None):  # noqa: ANN201 - a preexec_fn
    """A ``preexec_fn`` pinning the child to ``core`` (None: nothing)."""
    return None if core is None else (lambda: os.sched_setaffinity(0, {core}))


class CoreHolder:
    """While a pinned replica is down, a process spinning on its core holds its share of that core, so the replicas
    sharing the core do not speed up: a dead machine's compute is gone, not handed to the survivors."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def hold(self, core: int | None) -> None:
        if core is not None and self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pinned(core))

    def release(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


def run_plain(strategy: str, root: Path, out: Path, steps: int, seed: int, replicas: int) -> dict[str, Any]:
    """The failure-free job without fault tolerance, its two workers started here as torchrun starts them (one
    ``quietsync train`` process per worker, ``RANK``/``WORLD_SIZE``/``MASTER_*`` in the environment): the same
    process structure as the torchft runs, whose replica processes are started here too. Through the local
    launcher (``--nproc 2``) the job would also count the launcher's own start-up and the spawn of its workers --
    a second interpreter start and torch import before the first step, ~1.5 s -- and its exit after theirs,
    ~0.5 s, which the torchft runs do not pay."""
    base = [sys.executable, "-c", PY_MAIN, "train", *job_flags(root, out, strategy, steps, seed), "--nodes",
            str(replicas)]
    env = {**os.environ, **OFFLINE, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(replicas), "LOCAL_WORLD_SIZE": str(replicas)}
    t0 = time.time()
    procs = []
    for k in range(replicas):
        log = open(root / f"worker{k}.log", "w")
        procs.append(subprocess.Popen(base, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pinned(
            core_of(k, replicas)), env={**env, "RANK": str(k), "LOCAL_RANK": str(k)}))
        log.close()
    try:
        codes = [p.wait(1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    t1 = time.time()
    if any(codes):
        logs = "\n".join(p.read_text()[-3000:] for p in sorted(root.glob("worker*.log")))
        raise RuntimeError(f"plain run failed ({codes}):\n{logs}")
    return {"t0": t0, "t1": t1, "exit_codes": codes, "events": []}


def run_torchft(strategy: str, root: Path, out: Path, steps: int, seed: int, schedule: Schedule | None,
                replicas: int, heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS, dilation: int = 1,
                heavy: bool = False, standby: bool = False) -> dict[str, Any]:
    """The torchft job: a Lighthouse here and one replica process per replica group (``dilation``: the
    Lighthouse's join timeout and quorum tick multiplied by it, as the heartbeat timeout and the schedule are by
    the caller; ``heavy``: ``--heavy-env``; ``standby``: replica 1 returns as a standby, ``--standby``)."""
    from quietsync.faults.lighthouse import JOIN_TIMEOUT_MS, LighthouseConfig, start_lighthouse

    server = start_lighthouse(LighthouseConfig(bind="127.0.0.1:0", heartbeat_timeout_ms=heartbeat_timeout_ms,
                                               join_timeout_ms=JOIN_TIMEOUT_MS * dilation,
                                               quorum_tick_ms=LighthouseConfig.quorum_tick_ms * dilation))
    address = f"127.0.0.1:{server.address().rpartition(':')[2]}"
    base = [sys.executable, "-c", (HEAVY_IMPORTS if heavy else "") + PY_MAIN, "train",
            *job_flags(root, out, strategy, steps, seed), "--fault-tolerance", "torchft", "--lighthouse", address,
            "--nodes", str(replicas), "--nproc", "1", *([] if ASYNC_JOIN else ["--no-async-join"])]
    env = {**os.environ, **OFFLINE, "GLOO_SOCKET_IFNAME": "lo"}
    procs: dict[int, subprocess.Popen] = {}
    codes: list[tuple[int, int]] = []
    starts = dict.fromkeys(range(replicas), 0)
    holder = CoreHolder()

    standbys: list[tuple[Path, subprocess.Popen]] = []

    def launch(k: int, more: list[str], preexec) -> subprocess.Popen:  # noqa: ANN001 - a preexec_fn
        log = open(root / f"replica{k}.{starts[k]}.log", "w")
        starts[k] += 1
        proc = subprocess.Popen([*base, "--replica-group", str(k), *more], stdout=log, stderr=subprocess.STDOUT,
                                env=env, preexec_fn=preexec)
        log.close()
        return proc

    def start_standby() -> None:
        path = root / f"activate{len(standbys)}"
        # on its own core if one is given: a standby importing beside the replica it replaces slows that replica,
        # and with it every outer sync of the job, for as long as its start-up lasts (~25-40 s on a heavy image)
        core = STANDBY_CORE if STANDBY_CORE is not None else core_of(1, replicas)
        standbys.append((path, launch(1, ["--standby", str(path)], pinned(core))))

    def start(k: int) -> None:
        holder.release()
        if standby and k == 1 and standbys:  # the prepared standby takes over; the next one starts behind it
            path, procs[k] = standbys[-1]
            path.write_text("")
            start_standby()
            return
        procs[k] = launch(k, [], pinned(core_of(k, replicas)))

    def kill() -> None:
        procs[1].send_signal(signal.SIGKILL)
        holder.hold(core_of(1, replicas))
        codes.append((1, procs[1].wait(30)))

    t0 = time.time()
    try:
        for k in range(replicas):
            start(k)
        if standby:
            start_standby()
        if schedule is not None:
            schedule.drive(t0, lambda: procs[0].poll() is None, kill, lambda: start(1))
        codes.append((0, procs[0].wait(1800)))
        t1 = time.time()  # the job ends with replica 0 (it writes the summary)
        for k in range(1, replicas):
            try:
                codes.append((k, procs[k].wait(15)))
            except subprocess.TimeoutExpired:  # restarted too late to join the final quorum: it would wait for
                procs[k].kill()                # a fresh job's full quorum (120 s) and stop; not part of the job
                codes.append((k, procs[k].wait(10)))
    finally:
        for p in [*procs.values(), *(p for _, p in standbys)]:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        holder.release()
        server.shutdown()
    if dict(codes)[0] != 0:
        logs = "\n".join(p.read_text()[-2000:] for p in sorted(root.glob("replica*.log")))
        raise RuntimeError(f"torchft run ended with {codes}:\n{logs}")
    return {"t0": t0, "t1": t1, "exit_codes": codes, "events": schedule.events if schedule else []}


def newest_checkpoint(out: Path) -> int:
    """The step of the newest complete checkpoint under ``out`` (0: none)."""
    steps = [int(p.name.rpartition("-")[2]) for p in (out / "checkpoints").glob("step-*") if p.is_dir()
             and p.name.rpartition("-")[2].isdigit()]
    return max(steps, default=0)


def run_elastic(strategy: str, root: Path, out: Path, steps: int, seed: int, schedule: Schedule, limit: float,
                replicas: int = 2) -> dict[str, Any]:
    folder = root / "agents"
    folder.mkdir()
    agents = Agents(folder, replicas, job_flags(root, out, strategy, steps, seed), nnodes=f"1:{replicas}",
                    max_restarts=100, env={**OFFLINE, "QUIETSYNC_AUDIT_DATA": "1"})  # the audit's records: world size
    holder = CoreHolder()

    def start(i: int) -> None:
        holder.release()
        pid = agents.start(i).pid
        core = core_of(i, replicas)
        if core is not None:  # the agent's workers, spawned after its rendezvous, inherit the pinning
            os.sched_setaffinity(pid, {core})

    def kill() -> None:
        agents.kill_agent(1)
        holder.hold(core_of(1, replicas))

    t0 = time.time()
    try:
        start(0)
        agents.wait_for_store()  # agent 0 hosts the rendezvous store
        for i in range(1, replicas):
            start(i)
        schedule.drive(t0, lambda: agents.procs[0].poll() is None and time.time() < t0 + limit, kill,
                       lambda: start(1))
        finished = agents.procs[0].poll() is not None
        codes = agents.wait(60.0 if finished else 1.0)  # stops what still runs at the limit
        finished = finished or codes.get(0) == 0
        t1 = time.time()
        left = agents.survivors()
    finally:
        agents.close()
        holder.release()
    if finished and codes.get(0) != 0:
        raise RuntimeError(f"elastic run ended with {codes}:\n{agents.logs()}")
    return {"t0": t0, "t1": t1, "exit_codes": sorted(codes.items()), "processes_left": len(left),
            "events": schedule.events, "finished": finished, "newest_checkpoint": newest_checkpoint(out)}


def returns(rows: list[dict[str, Any]], events: list[tuple[str, float]], mode: str, replicas: int = 2,
            window_s: float = 10.0) -> list[dict[str, float]]:
    """For each start of replica 1: seconds from its process starting to its first committed step, and the longest
    gap between two consecutive steps of replica 0 (rank 0's records) from its start to ``window_s`` after it trained
    (the death of the previous incarnation is before ``at``: only the join is measured)."""
    out = []
    for kind, at in events:
        if kind != "start":
            continue
        if mode == "torchft":
            mine = sorted((r for r in rows if r["rank"] == 1 and r["unix_s"] > at), key=lambda r: r["unix_s"])
        else:  # elastic: the first step of the whole world after the start (every worker restarted)
            mine = sorted((r for r in rows if r.get("world_size") == replicas and r["unix_s"] > at),
                          key=lambda r: r["unix_s"])
        if not mine:
            continue
        first = mine[0]["unix_s"]
        survivor = sorted(r["unix_s"] for r in rows if r["rank"] == 0 and at <= r["unix_s"] <= first + window_s)
        gaps = [b - a for a, b in zip(survivor, survivor[1:])]
        out.append({"training_after_s": first - at, "survivor_max_gap_s": max(gaps, default=float("nan")),
                    "survivor_median_step_s": statistics.median(gaps) if gaps else float("nan"),
                    **({"phases": join_phases(rows, at, mine[0])} if mode == "torchft" else {})})
    return out


def join_phases(rows: list[dict[str, Any]], at: float, first: dict[str, Any]) -> dict[str, Any]:
    """Where a return's time goes (torchft), in seconds from the returning process's start: its set-up marks and
    its joining round (``start``/``rounds`` of its first record), the survivor's round that took it in (its step
    record's ``rounds``) and the survivor's step that held that round (``step_s`` from its previous step's end,
    split into ``compute_s``/``comm_s``). Empty where the records hold no phases."""
    if "start" not in first:
        return {}
    marks = first["start"]
    origin = marks.get("activated") or marks.get("process_start") or at  # a standby's return starts when activated
    joiner = {k: round(v - origin, 4) for k, v in marks.items() if v is not None}
    for rnd in first.get("rounds", [])[-1:]:
        joiner.update({f"round_{k}": round(rnd["unix_s"] + v - origin, 4) for k, v in rnd.items()
                       if isinstance(v, float) and k != "unix_s"})
    joiner["first_step"] = round(first["unix_s"] - origin, 4)
    survivor: dict[str, Any] = {}
    mine = sorted((r for r in rows if r["rank"] == 0), key=lambda r: r["unix_s"])
    for before, step in zip(mine, mine[1:]):
        taken = [rnd for rnd in step.get("rounds", []) if rnd["unix_s"] >= at and 1 in rnd.get("members", [])]
        if not taken:
            continue
        rnd = taken[-1]
        survivor = {"previous_step_end": round(before["unix_s"] - origin, 4),
                    **{f"round_{k}": round(rnd["unix_s"] + v - origin, 4) for k, v in rnd.items()
                       if isinstance(v, float) and k != "unix_s"},
                    "round_asked": round(rnd["unix_s"] - origin, 4), "step_end": round(step["unix_s"] - origin, 4),
                    "step_s": round(step["unix_s"] - before["unix_s"], 4), "compute_s": round(step["compute_s"], 4),
                    "comm_s": round(step["comm_s"], 4), "sent_bytes": rnd.get("sent_bytes", 0), "step": step["step"]}
        break
    return {"joiner": joiner, "survivor": survivor}


def run_one(strategy: str, mode: str, steps: int, period: float, down: float, seed: int, limit: float,
            replicas: int = 2, keep: Path | None = None, heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
            dilation: int = 1, heavy: bool = False, standby: bool = False) -> dict[str, Any]:
    """One run, recorded in ``RUNS``. ``dilation`` (torchft modes): the schedule and the Lighthouse's clocks
    multiplied by it (``--dilate``: the replicas per core)."""
    period, down, heartbeat_timeout_ms = period * dilation, down * dilation, heartbeat_timeout_ms * dilation
    RUNS.mkdir(parents=True, exist_ok=True)
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=False)
    with contextlib.nullcontext(str(keep)) if keep else tempfile.TemporaryDirectory(prefix="bench-goodput-") as tmp:
        root = Path(tmp)
        (root / "text.txt").write_text(synthetic_text(6000))
        prepare = subprocess.run([sys.executable, "-c", PY_MAIN, "train", *job_flags(root, root / "prep", strategy, 1,
                                                                                    seed), "--nproc", "1"],
                                 capture_output=True, text=True, timeout=600, env={**os.environ, **OFFLINE})
        if prepare.returncode:  # the tokenizer and the token cache, built before the clock starts
            raise RuntimeError(prepare.stderr[-3000:])
        out = root / "run"
        schedule = Schedule(period, down)
        if mode == "plain":
            result = run_plain(strategy, root, out, steps, seed, replicas)
        elif mode == "torchft-free":
            result = run_torchft(strategy, root, out, steps, seed, None, replicas, heartbeat_timeout_ms, dilation,
                                 heavy)
        elif mode == "torchft":
            result = run_torchft(strategy, root, out, steps, seed, schedule, replicas, heartbeat_timeout_ms,
                                 dilation, heavy, standby)
        else:
            result = run_elastic(strategy, root, out, steps, seed, schedule, limit, replicas)
        rows = records(out)
        if result.get("finished", True):
            summary = json.loads((out / "summary.json").read_text())
        else:  # stopped at the limit: what its newest checkpoint holds is what the job kept
            done = result["newest_checkpoint"]
            per_step = max((r["tokens"] * r["world_size"] for r in rows if r.get("world_size")), default=0)
            summary = {"tokens": done * per_step, "steps": done, "last_eval_loss": float("nan")}
    wall = result["t1"] - result["t0"]
    t0 = result["t0"]
    timeline = sorted(({"t": r["unix_s"] - t0, "rank": r["rank"], "step": r["step"], "tokens": r["tokens"],
                        "replicas": len(r["members"]) if "members" in r else r.get("world_size")}
                       for r in rows), key=lambda r: r["t"])
    run = {"strategy": strategy, "mode": mode, "seed": seed, "replicas": replicas, "max_steps": steps,
           "period_s": period,
           "down_s": down, "wall_s": wall, "limit_s": limit, "finished": result.get("finished", True),
           "tokens": summary["tokens"], "steps": summary["steps"],
           "final_loss": summary["last_eval_loss"], "exit_codes": result["exit_codes"],
           "processes_left": result.get("processes_left", 0),
           "events": [(k, at - t0) for k, at in result["events"]],
           "returns": returns(rows, result["events"], mode, replicas, 10.0 * dilation), "timeline": timeline,
           "dilation": dilation, "heavy_env": heavy, "standby": standby, "standby_core": STANDBY_CORE,
           **({"async_join": ASYNC_JOIN} if mode == "torchft" else {}),
           "fault_tolerance": {k: v for k, v in summary.get("fault_tolerance", {}).items()
                               if k in ("commits", "windows_dealt", "windows_committed", "final_members")},
           "load_average": os.getloadavg(), "cpus": os.cpu_count(), "cores": CORES, "cpu_model": cpu_model(),
           "machine": MACHINE,
           "replicas_per_core": max(1, replicas // core_count()) if core_of(0, replicas) is not None else None,
           **({"heartbeat_timeout_ms": heartbeat_timeout_ms} if mode.startswith("torchft") else {}),
           "command": " ".join(["python", *sys.argv])}
    suffix = ("" if replicas == 2 else f"-replicas{replicas}") + \
        ("" if steps == DEFAULT_STEPS[strategy] else f"-steps{steps}") + ("" if dilation == 1 else f"-x{dilation}") + \
        ("-heavy" if heavy else "") + ("-standby" if standby else "") + \
        ("-syncjoin" if mode == "torchft" and not ASYNC_JOIN else "")
    (RUNS / f"{strategy}-{mode}-seed{seed}{suffix}.json").write_text(json.dumps(run, indent=1) + "\n")
    print(f"{strategy} {mode}: {run['tokens']} tokens in {wall:.1f}s, final loss {run['final_loss']:.4f}, "
          f"{len(run['events'])} events, returns {run['returns']}", flush=True)
    return run


MACHINE = ""
"""``--machine``: the machine's name as the report shows it."""

STANDBY_CORE: int | None = None
"""``--standby-core``: the CPU replica 1's standbys start on (None: replica 1's own core)."""

ASYNC_JOIN = True
"""torchft: a returning replica joins asynchronously (``quietsync train``'s default; ``--no-async-join`` here passes
``--no-async-join`` to every replica: it computes its first step while the others wait)."""


def report(name: str = "goodput") -> None:
    runs = [json.loads(p.read_text()) for p in sorted(RUNS.glob("*.json"))]
    # a group: one job (strategy, replicas, steps); its runs: (mode, dilation, seed)
    by = {(r["strategy"], r.get("replicas", 2), r["max_steps"], r["mode"], r.get("dilation", 1), r["seed"]): r
          for r in runs}
    rows, table = [], []
    for strategy, n, steps in sorted({k[:3] for k in by}, key=lambda k: (list(STRATEGIES).index(k[0]), k[1], k[2])):
        group = {k[3:]: r for k, r in sorted(by.items()) if k[:3] == (strategy, n, steps)}
        plain = [r for (m, _, _), r in group.items() if m == "plain"]
        if not plain:
            continue
        ref = statistics.mean(r["tokens"] / r["wall_s"] for r in plain)
        losses = [r["final_loss"] for r in plain]
        for mode in MODES:
            for (m, dilation, _), r in group.items():
                if m != mode:
                    continue
                goodput = r["tokens"] / r["wall_s"] / ref
                # torchft against its own failure-free run (the same dilation): the failures' cost alone
                free = [f for (fm, fd, _), f in group.items() if (fm, fd) == ("torchft-free", dilation)]
                own = r["tokens"] / r["wall_s"] / statistics.mean(f["tokens"] / f["wall_s"] for f in free) \
                    if mode == "torchft" and free else None
                back = [x["training_after_s"] for x in r["returns"]]
                pause = [x["survivor_max_gap_s"] for x in r["returns"]]
                kills = sum(1 for k, _ in r["events"] if k == "kill")
                table.append({**{k: r[k] for k in ("strategy", "mode", "seed", "wall_s", "tokens", "final_loss",
                                                   "max_steps", "period_s", "down_s")},
                              "replicas": n, "cpus": r.get("cpus"), "dilation": dilation,
                              "finished": r.get("finished", True),
                              "goodput": goodput, "goodput_vs_torchft_free": own, "kills": kills,
                              "training_after_s": back, "survivor_pause_s": pause,
                              "plain_losses": losses})
                finished = r.get("finished", True)
                shown = mode if dilation == 1 else f"{mode}, clocks x{dilation}"
                if not finished:
                    shown += f" (stopped at {r['limit_s']:g} s: step {r['steps']} of {r['max_steps']} kept)"
                per_core = r.get("replicas_per_core")
                schedule = f"{r['period_s']:g} / {r['down_s']:g}" if mode in ("elastic", "torchft") else "-"
                rows.append([strategy, f"{n} ({per_core} per core)" if per_core else n, steps, shown, r["seed"],
                             schedule, kills,
                             r["wall_s"], r["tokens"], f"{goodput:.0%}",
                             f"{own:.0%}" if own is not None else "-", r["final_loss"] if finished else "-",
                             ", ".join(f"{x:.1f}" for x in back) or "-",
                             ", ".join(f"{x:.2f}" for x in pause) or "-"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"command": "benchmarks/bench_goodput.py (one --run per strategy and mode, then --report)", "rows": table}
    (RESULTS / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    notes = ("Replicas of 1 worker each, one thread each, a core each -- except rows marked 'k per core': more "
             "replicas than cores, each pinned to one core with k-1 others (every replica at 1/k of a core: k times "
             "slower machines), and while replica 1 is down a process spinning on its core holds its share, so the "
             "survivors sharing that core do not speed up -- tiny model, "
             "micro-batch 8 x 128 tokens, "
             "failure schedule (T / D s): replica 1 `kill -9` every T s from the job's start, started again D s "
             "later; 'clocks xk' (`--dilate`): k per core with the schedule, the Lighthouse's timeouts and the pause "
             "window multiplied by k -- the core-per-replica job slowed k times throughout (its seconds here are "
             "k times the core-per-replica run's; its goodput is that run's). Goodput: committed tokens per wall "
             "second (first process "
             "started to last ended) over the plain failure-free run's (mean over its seeds); vs torchft-free: a "
             "torchft run's over the failure-free torchft run's (what the failures cost; the plain run's workers and "
             "the torchft replicas are both started directly, without a launcher). "
             "back s: from replica 1's process start "
             "to its first committed step (elastic: to the first step of the whole world); pause s: the "
             "survivor's longest gap between two steps from that start to 10 s after (k times that where "
             "dilated).\n\nCommands: see "
             "`benchmarks/bench_goodput.py`'s docstring; per-run JSON in runs/goodput/.")
    notes += machines(runs) + phase_table(runs)
    write_markdown(name, "Goodput under a failure schedule: --elastic vs --fault-tolerance torchft",
                   ["strategy", "replicas", "steps", "mode", "seed", "T / D s", "kills", "wall s", "tokens",
                    "goodput",
                    "vs torchft-free", "final loss",
                    "back s",
                    "pause s"], rows, notes)
    plot(runs, name)
    print((RESULTS / f"{name}.md").read_text())


def machines(runs: list[dict[str, Any]]) -> str:
    """Markdown: the machines the runs were measured on (name, processor, CPUs, the cores each run was pinned to)."""
    seen = sorted({(r.get("machine") or "", r.get("cpu_model") or "", r.get("cpus") or 0,
                    ",".join(map(str, r["cores"])) if r.get("cores") else "") for r in runs} - {("", "", 0, "")})
    return "".join(f"\n\nMeasured on {m or 'a machine'}: {c or 'processor not recorded'}, {n} CPUs"
                   + (f" (runs pinned to cores {k})" if k else "") + "." for m, c, n, k in seen)


def phase_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: where each return's time went (torchft runs whose records hold the phases, :func:`join_phases`)."""
    lines = []
    for r in runs:
        for x in r["returns"]:
            ph = x.get("phases") or {}
            j, s = ph.get("joiner") or {}, ph.get("survivor") or {}
            if not j or not s:
                continue
            a = s["round_asked"]

            def ms(later: str, earlier: str, side: dict[str, Any]) -> str:
                return f"{1e3 * (side[later] - side[earlier]):.0f}" if later in side and earlier in side else "-"

            survivor = (f"{ms('round_quorum', 'round_asked', s)} / {ms('round_connected', 'round_quorum', s)} / "
                        f"{ms('round_serialized', 'round_connected', s)} / {ms('round_sent', 'round_serialized', s)}"
                        f" / {1e3 * (s['round_returned'] - a):.0f}")
            joiner = (f"{ms('round_received', 'round_recv_start', j)} / {ms('round_deserialized', 'round_received', j)}"
                      f" / {ms('round_applied', 'round_deserialized', j)}")
            setup = f"{j['loop_start']:.2f} / {j['model']:.2f} / {j.get('warm', float('nan')):.2f} / {j['ready']:.2f}"
            lines.append(f"| {r['strategy']} x{r.get('replicas', 2)} seed {r['seed']} | "
                         f"{x['survivor_median_step_s']:.3f} | "
                         f"{s['step_s']:.3f} | {survivor} | {1e3 * (s['step_end'] - s['round_returned']):.0f} | "
                         f"{setup} | {joiner} | "
                         f"{1e3 * (j['first_step'] - j['round_returned']):.0f} | {j['first_step']:.2f} |")
    if not lines:
        return ""
    return "\n".join([
        "\n\n## Where a return's time goes (torchft)\n",
        "Survivor: its median step, the step that held the join (from its previous step's end: the round, then its "
        "own step, which waits in its collective for the joiner), and the round's phases in ms (the Lighthouse's "
        "answer / the new group connected / its state taken and packed / sent / round total). Joiner, seconds "
        "from its process start: imports done / model built / warm-up done / asks to join; its heal in ms "
        "(transfer / unpack / applied); its first step (ms after its round returned) and when it ended (s).\n",
        "| run | survivor step s | join step s | survivor round ms: quorum / connect / pack / send / total | "
        "survivor step after the round ms | joiner s: imports / model / warm / asks | joiner heal ms: receive / "
        "unpack / apply | joiner first step ms | training at s |",
        "|---|---|---|---|---|---|---|---|---|", *lines])


def plot(runs: list[dict[str, Any]], name: str = "goodput") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = sorted((r for r in runs if r["mode"] in ("elastic", "torchft")),
                   key=lambda r: (r["strategy"], r.get("replicas", 2), r["max_steps"], r["mode"], r["seed"]))
    if not shown:
        return
    fig, axes = plt.subplots(len(shown), 1, figsize=(11, 2.4 * len(shown)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], shown):
        bins: dict[int, int] = {}
        present: dict[int, int] = {}
        for e in r["timeline"]:
            b = int(e["t"] // 2)
            bins[b] = bins.get(b, 0) + e["tokens"]
            if e["replicas"] is not None:
                present[b] = max(present.get(b, 0), e["replicas"])
        xs = sorted(bins)
        ax.plot([2 * x for x in xs], [bins[x] / 2 for x in xs], color="tab:blue", lw=1)
        ax.set_ylabel("tokens/s", color="tab:blue")
        ax2 = ax.twinx()
        ys = sorted(present)
        ax2.step([2 * x for x in ys], [present[x] for x in ys], where="post", color="tab:orange", lw=1)
        ax2.set_ylim(0, r.get("replicas", 2) + 0.5)
        ax2.set_ylabel("replicas", color="tab:orange")
        events = r["events"]
        for (k, a), nxt in zip(events, events[1:] + [("end", r["wall_s"])]):
            if k == "kill":
                ax.axvspan(a, nxt[1], color="0.85", zorder=0)
        dilated = f", clocks x{r['dilation']}" if r.get("dilation", 1) > 1 else ""
        ax.set_title(f"{r['strategy']} {r['mode']}{dilated}, {r.get('replicas', 2)} replicas, {r['max_steps']} steps, "
                     f"seed {r['seed']} (replica 1 down: grey)", fontsize=9)
    axes[-1, 0].set_xlabel("seconds since the job started")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)


def main() -> None:
    global RUNS, CORES, MACHINE, STANDBY_CORE, ASYNC_JOIN
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", nargs=2, metavar=("STRATEGY", "MODE"), help=f"one run: {list(STRATEGIES)} x {MODES}")
    p.add_argument("--report", action="store_true", help="write benchmarks/results/goodput.{md,json,png}")
    p.add_argument("--steps", type=int, default=0, help="--max-steps (default: per strategy, ~150 s failure-free)")
    p.add_argument("--period", type=float, default=60.0, help="T: seconds between kills of replica 1")
    p.add_argument("--down", type=float, default=20.0, help="D: seconds replica 1 stays down")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=2,
                   help="replica groups of one worker each (plain: workers; elastic: torchrun agents), a core each "
                        "(default 2)")
    p.add_argument("--limit", type=float, default=600.0,
                   help="seconds after which an elastic run that has not ended is stopped and recorded as unfinished")
    p.add_argument("--keep", type=Path, default=None,
                   help="a new folder to run in and keep (the processes' logs, metrics and checkpoints)")
    p.add_argument("--runs", type=Path, default=RUNS, help=f"folder of the per-run JSON (default {RUNS})")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=HEARTBEAT_TIMEOUT_MS,
                   help=f"the Lighthouse's heartbeat timeout of the torchft modes (default {HEARTBEAT_TIMEOUT_MS}, "
                        "quietsync's)")
    p.add_argument("--dilate", action="store_true",
                   help="torchft modes with more replicas than cores (k per core): multiply the schedule (--period, "
                        "--down), the Lighthouse's timeouts and the pause window by k, so the run stands for the "
                        "same job with a core per replica, slowed k times throughout")
    p.add_argument("--cores", default=None,
                   help="CPUs to pin the replicas to, one each in turn (e.g. 0-7): two jobs side by side on disjoint "
                        "cores of one machine (default: every CPU, pinned only with more replicas than CPUs)")
    p.add_argument("--report-name", default="goodput",
                   help="with --report: write benchmarks/results/NAME.{md,json,png} (default goodput)")
    p.add_argument("--machine", default="", help="the machine's name, recorded with each run for the report")
    p.add_argument("--heavy-env", action="store_true",
                   help="torchft modes: every replica process imports a heavy environment's packages first "
                        "(HEAVY_IMPORTS), as on a stock GPU image")
    p.add_argument("--standby-core", type=int, default=None,
                   help="with --standby: the CPU each standby starts on (default: replica 1's own core, which the "
                        "standby's start-up then shares with the replica it replaces)")
    p.add_argument("--standby", action="store_true",
                   help="torchft: replica 1 returns as a prepared standby (quietsync train --standby), activated at "
                        "each return")
    p.add_argument("--joins", type=Path, nargs="+", default=None, metavar="RUNS",
                   help="print the survivor's join steps of the torchft runs recorded under these --runs folders, "
                        "per join mode (--no-async-join or the default)")
    p.add_argument("--no-async-join", dest="async_join", action="store_false",
                   help="torchft: every replica runs with --no-async-join (a returning replica computes its first "
                        "step while the others wait in its average), to compare with the default")
    args = p.parse_args()
    RUNS, MACHINE, ASYNC_JOIN = args.runs, args.machine, args.async_join
    if args.cores is not None:
        try:
            CORES = parse_cores(args.cores)
        except ValueError as e:
            p.error(str(e))
        missing = sorted(set(CORES) - os.sched_getaffinity(0))
        if missing:
            p.error(f"--cores {args.cores}: CPU(s) {missing} are not available here "
                    f"(available: {sorted(os.sched_getaffinity(0))})")
    if args.run:
        strategy, mode = args.run
        if strategy not in STRATEGIES or mode not in MODES:
            p.error(f"--run STRATEGY MODE with STRATEGY in {list(STRATEGIES)} and MODE in {list(MODES)}")
        if args.replicas < 2:
            p.error(f"--replicas must be at least 2 (one to kill, one to go on), got {args.replicas}")
        cores = core_count()
        if args.replicas > cores and args.replicas % cores:
            p.error(f"--replicas {args.replicas} on {cores} cores: more replicas than cores run pinned the same number "
                    f"per core, so --replicas must be at most {cores} or a multiple of it")
        if args.heartbeat_timeout_ms < 1:
            p.error(f"--heartbeat-timeout-ms must be an integer >= 1, got {args.heartbeat_timeout_ms}")
        if args.keep is not None and args.keep.exists():
            p.error(f"--keep {args.keep}: already exists (give a new folder)")
        dilation = 1
        if args.dilate:
            if not mode.startswith("torchft"):
                p.error(f"--dilate applies to the torchft modes (torchft, torchft-free), not {mode}: plain has no "
                        "clock to scale, elastic's torchrun clocks are not scaled")
            if args.replicas <= cores:
                p.error(f"--dilate with --replicas {args.replicas} on {cores} cores: each replica has a core of its "
                        "own already (nothing to dilate)")
            dilation = args.replicas // cores
        if args.heavy_env and not mode.startswith("torchft"):
            p.error(f"--heavy-env applies to the torchft modes (torchft, torchft-free), not {mode}")
        if args.standby_core is not None:
            if not args.standby:
                p.error("--standby-core needs --standby")
            if args.standby_core not in os.sched_getaffinity(0):
                p.error(f"--standby-core {args.standby_core}: not a CPU available here "
                        f"(available: {sorted(os.sched_getaffinity(0))})")
            STANDBY_CORE = args.standby_core
        if args.standby and mode != "torchft":
            p.error(f"--standby applies to the torchft mode (replica 1's returns), not {mode}")
        steps = args.steps or DEFAULT_STEPS[strategy]
        run_one(strategy, mode, steps, args.period, args.down, args.seed, args.limit, args.replicas,
                args.keep, args.heartbeat_timeout_ms, dilation, args.heavy_env, args.standby)
    if args.report:
        report(args.report_name)
    if args.joins:
        print(join_table(args.joins))


def join_table(folders: list[Path]) -> str:
    """The survivor's step that holds each join, per join mode, from the torchft runs recorded under ``folders``
    (``--runs``): its length against the survivor's median step around the return, and the time it waited in that
    step's collective (``comm_s``: under ddp, the gradient average the joiner takes part in). Markdown."""
    rows: dict[str, list[tuple[float, float, float, float]]] = {"--no-async-join": [], "asynchronous (default)": []}
    for folder in folders:
        for path in sorted(Path(folder).glob("*-torchft-*.json")):
            run = json.loads(path.read_text())
            seen = set()
            for r in run["returns"]:
                surv, joiner = r.get("phases", {}).get("survivor", {}), r.get("phases", {}).get("joiner", {})
                if not surv or surv["step"] in seen or "round_applied" not in joiner:
                    continue  # a return that never trained reports the next one's join again
                seen.add(surv["step"])
                mode = "asynchronous (default)" if run.get("async_join", True) else "--no-async-join"
                rows[mode].append((surv["step_s"], r["survivor_median_step_s"], surv["comm_s"],
                                   surv["round_returned"] - surv["round_asked"]))
    lines = ["| join | returns | survivor's join step | over its median step: median (range) | waited in the step's "
             "collective: median (range) | its round (median) |", "|---|---|---|---|---|---|"]
    for mode, got in rows.items():
        if not got:
            continue
        ratio, wait = [a / b for a, b, _, _ in got], [c for _, _, c, _ in got]
        lines.append(f"| {mode} | {len(got)} | {min(a for a, *_ in got):.2f}–{max(a for a, *_ in got):.2f} s | "
                     f"{statistics.median(ratio):.2f} ({min(ratio):.2f}–{max(ratio):.2f}) | "
                     f"{statistics.median(wait):.3f} s ({min(wait):.3f}–{max(wait):.3f}) | "
                     f"{statistics.median(d for *_, d in got):.3f} s |")
    return "\n".join(lines)


DEFAULT_STEPS = {"ddp": 1500, "diloco": 1500}
"""--max-steps of each strategy (sized so that the plain failure-free run takes about 150 s here)."""


if __name__ == "__main__":
    main()
