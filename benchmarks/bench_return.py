"""A returning replica's start-up, phase by phase, and the survivor's pause around its return (issue 43).

A 2-replica ``--fault-tolerance torchft`` job (the goodput benchmark's job: ddp, tiny model, one thread per
replica), replica 1 killed (``SIGKILL``, at its step ``--kill-step``) and brought back as MODE:

* ``fresh`` -- a new process, as a scheduler restarts one;
* ``fresh-heavy`` -- the same with a heavy environment's imports first (``bench_goodput.HEAVY_IMPORTS``);
* ``standby`` / ``standby-heavy`` -- a ``--standby`` process started beside the job, which has imported, built
  and warmed its model before the kill, activated (its file created) once replica 1 is dead.

For each return: the seconds from its start (fresh: its process's start; standby: its activation) to each mark of
its timeline (``loop_start`` imports done, ``manager``, ``data``, ``model``, ``warm``, ``ready``, ``joined``) and
to its first committed step, and the survivor's longest gap between two steps from the moment the returning
replica asked to join (its ``ready`` mark: the kill's detection came before) to 5 s after its first step, beside
the survivor's median step before the kill, and the survivor's round that took it in (its phases). The modes run
interleaved, ``--repeats`` times each, so their ratios are measured side by side::

    python benchmarks/bench_return.py --repeats 2

writes ``benchmarks/results/return.{md,json}``.
"""

from __future__ import annotations

import argparse
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

from bench_goodput import HEAVY_IMPORTS, OFFLINE, job_flags, records  # noqa: E402
from common import PY_MAIN, RESULTS, write_markdown  # noqa: E402

from tests.train.conftest import synthetic_text  # noqa: E402

MODES = ("fresh", "fresh-heavy", "standby", "standby-heavy")
MARKS = ("loop_start", "manager", "data", "model", "warm", "standby", "activated", "ready", "joined")


def _wait(predicate, timeout: float, what: str) -> None:  # noqa: ANN001 - a callable
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:g}s")
        time.sleep(0.05)


def one_return(mode: str, root: Path, kill_step: int, window_s: float = 5.0) -> dict[str, Any]:
    """One job, one return of replica 1 as ``mode``; its timeline and the survivor's pause."""
    from quietsync.faults.lighthouse import LighthouseConfig, start_lighthouse

    out = root / f"run-{mode}-{time.time_ns()}"
    server = start_lighthouse(LighthouseConfig(bind="127.0.0.1:0"))
    address = f"127.0.0.1:{server.address().rpartition(':')[2]}"
    heavy, standby = mode.endswith("heavy"), mode.startswith("standby")
    flags = [*job_flags(root, out, "ddp", 1_000_000, 0), "--fault-tolerance", "torchft", "--lighthouse", address,
             "--nodes", "2", "--nproc", "1"]
    env = {**os.environ, **OFFLINE, "GLOO_SOCKET_IFNAME": "lo"}
    procs: list[subprocess.Popen] = []

    def launch(k: int, more: list[str], prefix: str = "", extra: dict[str, str] | None = None,
               preexec=None) -> subprocess.Popen:  # noqa: ANN001 - a preexec_fn
        log = open(root / f"{out.name}.replica{k}.{len(procs)}.log", "w")
        proc = subprocess.Popen([sys.executable, "-c", prefix + PY_MAIN, "train", *flags, "--replica-group", str(k),
                                 *more], stdout=log, stderr=subprocess.STDOUT, env={**env, **(extra or {})},
                                preexec_fn=preexec)
        log.close()
        procs.append(proc)
        return proc

    try:
        launch(0, [])
        first = launch(1, [], extra={"QUIETSYNC_FT_KILL": f"step:{kill_step}"})
        activate = root / f"{out.name}.activate"
        if standby:
            launch(1, ["--standby", str(activate)], HEAVY_IMPORTS if heavy else "")
            log = root / f"{out.name}.replica1.2.log"
            _wait(lambda: "standing by" in log.read_text(), 600, "the standby did not stand by")
        first.wait(600)
        at = time.time()
        if standby:
            activate.write_text("")
        else:
            launch(1, [], HEAVY_IMPORTS if heavy else "")
        back = lambda: [r for r in records(out) if r["rank"] == 1 and r["unix_s"] > at]  # noqa: E731
        _wait(back, 600, f"replica 1 ({mode}) did not train again")
        mine = min(back(), key=lambda r: r["unix_s"])
        _wait(lambda: any(r["rank"] == 0 and r["unix_s"] > mine["unix_s"] + window_s for r in records(out)), 600,
              "the survivor stopped")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(10)
        server.shutdown()
    marks = mine["start"]
    origin = marks.get("activated") or marks.get("process_start") or at
    timeline = {k: round(marks[k] - origin, 3) for k in MARKS if marks.get(k) and marks[k] >= origin}
    timeline["first_step"] = round(mine["unix_s"] - origin, 3)
    asked = marks["ready"]  # the survivor's pause is around the join: the kill's detection came before
    survivor = sorted(r["unix_s"] for r in records(out) if r["rank"] == 0 and asked <= r["unix_s"] <= mine["unix_s"]
                      + window_s)
    gaps = [b - a for a, b in zip(survivor, survivor[1:])]
    before = sorted(r["unix_s"] for r in records(out) if r["rank"] == 0 and r["unix_s"] < at)
    steady = [b - a for a, b in zip(before, before[1:])][-20:]
    rounds = next((r.get("rounds") for r in sorted(records(out), key=lambda r: r["unix_s"])
                   if r["rank"] == 0 and r["unix_s"] >= mine["unix_s"] - 1 and r.get("rounds")), None)
    return {"mode": mode, "training_after_s": round(mine["unix_s"] - at, 3), "timeline": timeline,
            "process_started_before_s": round(at - marks["process_start"], 3) if standby else 0.0,
            "survivor_max_gap_s": round(max(gaps, default=float("nan")), 4),
            "survivor_median_step_s": round(statistics.median(steady), 4) if steady else None,
            "survivor_round": rounds[-1] if rounds else None, "load_average": os.getloadavg()}


def report(runs: list[dict[str, Any]]) -> None:
    rows = []
    for r in runs:
        t = r["timeline"]
        rows.append([r["mode"], f"{r['training_after_s']:.2f}", *(f"{t[k]:.2f}" if k in t else "–" for k in
                                                                  ("loop_start", "data", "model", "warm", "ready",
                                                                   "joined", "first_step")),
                     f"{r['survivor_max_gap_s']:.3f}", f"{r['survivor_median_step_s']:.3f}",
                     " ".join(f"{x:.2f}" for x in r["load_average"])])
    header = ["mode", "trains after s", "imports done", "data", "model built", "warm", "ready", "joined",
              "first step", "survivor's longest gap s", "its median step s", "load"]
    notes = (f"`{' '.join(['python', *sys.argv])}` (2 replicas, ddp, tiny model, one thread each; seconds from the "
             "return's start: a fresh process's start, a standby's activation; load: the 1/5/15-minute load "
             f"averages of this {os.cpu_count()}-core machine at the return's end)")
    write_markdown("return", "A returning replica's start-up and the survivor's pause", header, rows, notes)
    (RESULTS / "return.json").write_text(json.dumps(runs, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--kill-step", type=int, default=30, help="replica 1 dies at this step (default 30)")
    args = p.parse_args()
    if args.repeats < 1 or args.kill_step < 1:
        p.error("--repeats and --kill-step must be integers >= 1")
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-return-") as tmp:
        root = Path(tmp)
        (root / "text.txt").write_text(synthetic_text(6000))
        prepare = subprocess.run([sys.executable, "-c", PY_MAIN, "train", *job_flags(root, root / "prep", "ddp", 1, 0),
                                  "--nproc", "1"], capture_output=True, text=True, timeout=600,
                                 env={**os.environ, **OFFLINE})
        if prepare.returncode:
            raise RuntimeError(prepare.stderr[-3000:])
        for _ in range(args.repeats):
            for mode in args.modes:
                run = one_return(mode, root, args.kill_step)
                print(json.dumps(run), flush=True)
                runs.append(run)
    report(runs)


if __name__ == "__main__":
    main()
