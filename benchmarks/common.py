"""Shared benchmark plumbing: run ``quietsync train`` jobs side by side and read what they wrote.

Benchmarks report **ratios measured in one run**, never absolute times as targets. Every job is a real
``quietsync train`` run (real collectives, real model, emulated link), launched as a subprocess so each gets
fresh worker processes; results are read back from ``summary.json`` and ``metrics-rank{R}.jsonl``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def run_train(out: Path, *flags: str, timeout: float = 1800) -> dict[str, Any]:
    """Run ``quietsync train --out OUT FLAGS...``; return its summary plus per-rank step records."""
    cmd = [sys.executable, "-c", "import sys; from quietsync.train.cli import main; sys.exit(main())",
           "train", "--out", str(out), "--no-progress", "--no-plot", "--no-export", *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
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
