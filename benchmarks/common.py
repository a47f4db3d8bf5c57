"""Shared benchmark plumbing: run ``quietsync train`` jobs side by side and read what they wrote.

Benchmarks report **ratios measured in one run**, never absolute times as targets. Every job is a real
``quietsync train`` run (real collectives, real model, emulated link), launched as a subprocess so each gets
fresh worker processes; results are read back from ``summary.json`` and ``metrics-rank{R}.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
PY_MAIN = "import sys; from quietsync.commands.main import main; sys.exit(main())"
"""``python -c PY_MAIN ARGS`` runs ``quietsync ARGS`` with this interpreter."""


OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
"""The Hugging Face libraries told not to reach the network (the benchmarks run on offline machines)."""


def run_train(out: Path, *flags: str, timeout: float = 1800) -> dict[str, Any]:
    """Run ``quietsync train --out OUT FLAGS...`` (offline: :data:`OFFLINE`); return its summary plus per-rank step
    records."""
    cmd = [sys.executable, "-c", PY_MAIN, "train", "--out", str(out), "--no-progress", "--no-plot", "--no-export",
           *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **OFFLINE})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(flags)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    summary["process_s"] = time.perf_counter() - t0
    ranks = []
    for path in sorted(out.glob("metrics-rank*.jsonl")):
        ranks.append([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    summary["records"] = ranks
    return summary


def step_stats(summary: dict[str, Any], skip: int = 2) -> dict[str, float]:
    """Per-step numbers averaged over workers, skipping the first ``skip`` (warm-up) steps."""
    per_rank = []
    for records in summary["records"]:
        steps = [r for r in records if "event" not in r]
        times = [b["time_s"] - a["time_s"] for a, b in zip(steps, steps[1:])][skip:]
        body = steps[skip + 1:]
        if not times or not body:
            continue
        wall = sum(times)
        per_rank.append({
            "step_s": wall / len(times),
            "busy": sum(r["compute_s"] for r in body) / wall,
            "idle_s": statistics.mean(r["idle_s"] for r in body),
            "comm_s": statistics.mean(r["comm_s"] for r in body),
            "bytes_sent": statistics.mean(r["bytes_sent"] for r in body),
            "micro_batches_per_s": sum(r["micro_batches"] for r in body) / wall,
            "micro_batches": statistics.mean(r["micro_batches"] for r in body),
        })
    return {k: statistics.mean(p[k] for p in per_rank) for k in per_rank[0]}


def cpu_model() -> str:
    """The processor's model name (Linux ``/proc/cpuinfo``; '' elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return ""


def cpu_description() -> str:
    """The processor as a report names it: model, widest vector extension and L2 cache per core (Linux; what it
    cannot read is left out), e.g. ``AMD EPYC (avx512, L2 1024K)``."""
    details = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.partition(":")[2].split())
                details += [name for name, flag in (("avx512", "avx512f"), ("avx2", "avx2"), ("neon", "asimd"))
                            if flag in flags][:1]
                break
    with contextlib.suppress(OSError):
        details.append("L2 " + Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip())
    return (cpu_model() or "unknown CPU") + (f" ({', '.join(details)})" if details else "")


def write_markdown(name: str, title: str, header: list[str], rows: list[list[Any]], notes: str = "") -> Path:
    """Write ``results/NAME.md`` with a table (and return its path)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    lines = [f"# {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(v) for v in row) + " |")
    if notes:
        lines += ["", notes.strip()]
    path = RESULTS / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def init_local_worker(rank: int, world: int, port: int, threads: int) -> None:
    """In a spawned benchmark worker: torchrun's environment on loopback, ``threads`` torch threads, and
    torch.distributed's default gloo group."""
    import os

    import torch
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "GLOO_SOCKET_IFNAME": "lo"})
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)


# ---------------------------------------------------------------------------------------------- settings
def flags_of(knobs: dict[str, Any]) -> list[str]:
    """``{"sync_every": 4, "sign": False}`` → ``["--sync-every", "4", "--no-sign"]``."""
    out = []
    for k, v in knobs.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        else:
            out += [flag, repr(v) if isinstance(v, float) else str(v)]
    return out


def spec_of(name: str, knobs: dict[str, Any]) -> str:
    """``quietsync plan --strategies`` spelling."""
    return name + (":" + ",".join(f"{k}={v}" for k, v in knobs.items()) if knobs else "")


def key_of(name: str, knobs: dict[str, Any]) -> str:
    """:func:`spec_of` with the knobs sorted by name (one spelling per setting)."""
    return spec_of(name, dict(sorted(knobs.items())))


# ---------------------------------------------------------------------------------------------- shaped link
class ShapedLink:
    """Two network namespaces joined by a veth pair, each end shaped with ``tc tbf`` (needs root; no netem)."""

    _port = 29610

    def __init__(self, rate: str = "100mbit", burst: str = "64kb", latency: str = "400ms") -> None:
        self.ns = ("qsplan0", "qsplan1")
        self.dev = ("qsplanv0", "qsplanv1")
        self.ip = ("10.78.0.1", "10.78.0.2")
        self.rate, self.burst, self.latency = rate, burst, latency

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def __enter__(self) -> ShapedLink:
        self.__exit__()
        for ns in self.ns:
            self._ip("netns", "add", ns)
        self._ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for ns, dev, ip in zip(self.ns, self.dev, self.ip):
            self._ip("link", "set", dev, "netns", ns)
            self._ip("netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            self._ip("netns", "exec", ns, "ip", "link", "set", dev, "up")
            self._ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
            self._ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                     "burst", self.burst, "latency", self.latency)
        return self

    def __exit__(self, *exc: Any) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def describe(self) -> str:
        return f"tc tbf rate {self.rate} burst {self.burst} latency {self.latency} on a veth pair between two netns"

    def set_rate(self, rate: str) -> None:
        """Change both ends' ``tbf`` rate now (``tc qdisc change``; later packets get the new rate)."""
        for ns, dev in zip(self.ns, self.dev):
            self._ip("netns", "exec", ns, "tc", "qdisc", "change", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", self.burst, "latency", self.latency)
        self.rate = rate

    def run(self, args: list[str], workers_per_node: int, timeout: float, port: int | None = None,
            rate_schedule: list[tuple[float, str]] | None = None,
            started: Callable[[], bool] | None = None) -> list[tuple[float, str]]:
        """Run ``quietsync ARGS`` on 2 nodes (one per namespace) × ``workers_per_node``, torchrun-style env (one
        torch thread per worker); ``port``: the rendezvous port (default: a new one per call of this process).

        ``rate_schedule``: ``[(seconds, rate), ...]`` -- change the real link's rate (:meth:`set_rate`) that many
        seconds after the workers were started (or, with ``started``, after it first returns True: e.g. once the
        run's first metrics record exists, so the schedule follows training time, not set-up's), mid-run. Returns
        the changes made, as ``(seconds, rate)`` from that moment.
        """
        world = 2 * workers_per_node
        if port is None:
            ShapedLink._port += 1
            port = ShapedLink._port
        procs = []
        env_base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        for node in range(2):
            for local in range(workers_per_node):
                rank = node * workers_per_node + local
                env = {**env_base, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                       "LOCAL_WORLD_SIZE": str(workers_per_node), "MASTER_ADDR": self.ip[0],
                       "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": self.dev[node], "QUIETSYNC_BACKEND": "gloo",
                       "OMP_NUM_THREADS": "1"}
                cmd = ["ip", "netns", "exec", self.ns[node], sys.executable, "-c", PY_MAIN, *args]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True))
        t_start = time.monotonic()
        deadline = t_start + timeout
        changed: list[tuple[float, str]] = []
        stop = threading.Event()

        def change_rates() -> None:  # on a thread: the workers' pipes are read below meanwhile
            t0 = t_start
            if started is not None and rate_schedule:
                while not started():
                    if stop.wait(0.2):
                        return
                t0 = time.monotonic()
            for at, rate in sorted(rate_schedule or []):
                if stop.wait(max(0.0, t0 + at - time.monotonic())):
                    return
                self.set_rate(rate)
                changed.append((round(time.monotonic() - t0, 3), rate))

        changer = threading.Thread(target=change_rates, daemon=True)
        changer.start()
        outs = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                outs.append(out)
        finally:
            stop.set()
            changer.join()
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"shaped-link run {' '.join(args[:3])} failed:\n" + "\n".join(o[-2000:] for o in outs))
        return changed


def read_run(out: Path) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    summary["records"] = [[json.loads(x) for x in p.read_text().splitlines() if x.strip()]
                          for p in sorted(out.glob("metrics-rank*.jsonl"), key=lambda p: int(p.stem[12:]))]
    return summary
