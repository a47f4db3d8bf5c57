"""What ``--check-replicas-every N`` costs a run: the fingerprint of every parameter, and one agreement per check.

Two parts, side by side in one run:

* the fingerprint alone (:func:`quietsync.train.replicas.fingerprint_row`), one thread, on the ``tiny`` and ``10m``
  models: milliseconds per check and parameters per second (median of 7 after one warm-up);
* a whole run: ``quietsync train`` with 2 workers (one thread each), ``ddp``, tiny model, micro-batch 8×128,
  ``--check-replicas-every`` 0 (the run's end only) against 1 (every step: the dearest setting) and 10, in ABBA
  order so that drift of a shared machine hits every variant alike. Reported: wall time per step (workers
  averaged, the first 2 steps left out) and its ratio to the run without periodic checks.

    python benchmarks/bench_replica_check.py [--steps 200]

Writes ``benchmarks/results/replica_check.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from common import RESULTS, cpu_description, run_train, step_stats, write_markdown  # noqa: E402

from tests.train.conftest import synthetic_text  # noqa: E402


def fingerprint_costs() -> list[dict]:
    import torch

    from quietsync.models import build_model
    from quietsync.train.replicas import fingerprint_row

    torch.set_num_threads(1)
    rows = []
    for name in ("tiny", "10m"):
        model = build_model(name, 4096, seed=0)
        n = sum(p.numel() for p in model.parameters())
        fingerprint_row(model)
        times = []
        for _ in range(7):
            t = time.perf_counter()
            fingerprint_row(model)
            times.append(time.perf_counter() - t)
        ms = 1e3 * statistics.median(times)
        rows.append({"model": name, "parameters": n, "ms": ms, "params_per_s": n / ms * 1e3})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def job_flags(root: Path, steps: int) -> list[str]:
    return ["--strategy", "ddp", "--model", "tiny", "--nproc", "2", "--max-steps", str(steps),
            "--micro-batch-size", "8", "--seq-len", "128", "--vocab-size", "512", "--dataset", str(root / "text.txt"),
            "--cache-dir", str(root / "cache"), "--eval-every", "0", "--eval-windows", "8", "--threads", "1",
            "--seed", "0"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    costs = fingerprint_costs()
    order = ["0", "1", "10", "10", "1", "0"]
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-replica-check-") as tmp:
        root = Path(tmp)
        (root / "text.txt").write_text(synthetic_text(6000))
        for k, every in enumerate(order):
            summary = run_train(root / f"every{every}-{k}", *job_flags(root, args.steps),
                                "--check-replicas-every", every)
            if summary["replicas"]["differ"]:
                raise RuntimeError(f"the workers differ: {summary['replicas']}")
            row = {"every": int(every), "step_ms": 1e3 * step_stats(summary)["step_s"], "wall_s": summary["wall_s"]}
            runs.append(row)
            print(json.dumps(row), flush=True)
    base = statistics.mean(r["step_ms"] for r in runs if r["every"] == 0)
    table = [[c["model"], c["parameters"], c["ms"], c["params_per_s"] / 1e9] for c in costs]
    whole = []
    for every in dict.fromkeys(int(e) for e in order):
        mine = [r["step_ms"] for r in runs if r["every"] == every]
        whole.append([every if every else "0 (end only)", len(mine), statistics.mean(mine),
                      statistics.mean(mine) / base])
    command = f"`python benchmarks/bench_replica_check.py --steps {args.steps}`"
    notes = (f"The whole run: {args.steps} steps, ddp, 2 workers (one thread each), tiny model, micro-batch 8×128; "
             f"ABBA order, means over the repeats. Command: {command}; {cpu_description()}; load average at the end "
             f"{os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d')}.")
    path = write_markdown("replica_check", "Replica check: the fingerprint's cost, and a run's with checks",
                          ["model", "parameters", "fingerprint ms (one thread)", "G parameters/s"], table)
    lines = ["", "| --check-replicas-every | runs | wall ms/step | vs end only |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row) + " |" for row in whole]
    path.write_text(path.read_text() + "\n".join(lines) + "\n\n" + notes + "\n")
    (RESULTS / "replica_check.json").write_text(json.dumps({"fingerprint": costs, "runs": runs,
                                                            "args": {"steps": args.steps}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
