"""What the budgets' agreement costs (issue 13, item 4): one all-reduce per committed step when
``--max-tokens``, ``--max-time-s`` or ``--target-loss`` is set (``quietsync.train.budgets``).

Two measurements, side by side in one run:

* **the agreement alone**: two spawned gloo workers call ``BudgetWatch.check`` back to back (the ``world x 3``
  float64 all-reduce on the non-finite guard's group, booked as idle); median microseconds per check over
  blocks of checks;
* **whole runs**: ``quietsync train`` on 2 local workers (tiny model, no link), each strategy with and
  without an agreed budget that is never reached (``--max-time-s 1e9``), in interleaved repeats; reported:
  seconds per step (``common.step_stats``), compute-busy fraction and micro-batches per step, and the step
  time with the agreement ÷ without. ACCO is the case to watch: its workers feed as many micro-batches as
  fit while communication runs, and the agreement after each commit makes the faster worker wait for the
  other's commit.

    python benchmarks/bench_budgets.py [--strategies zero1 acco] [--steps 40] [--repeats 2] [--checks 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import RESULTS, init_local_worker, run_train, step_stats, write_markdown  # noqa: E402

BLOCK = 100
"""Checks per timed block."""


def _agreement_worker(rank: int, world: int, port: int, checks: int, out: str) -> None:
    init_local_worker(rank, world, port, 1)
    import quietsync
    from quietsync.train.budgets import Budgets, BudgetWatch
    from quietsync.train.nonfinite import NonFiniteGuard

    s = quietsync.make_strategy("ddp", torch.nn.Linear(4, 4), torch.optim.SGD, lr=0.1)
    guard = NonFiniteGuard("stop", s)
    watch = BudgetWatch(Budgets(10**9, max_time_s=1e9), s, guard.group)
    for _ in range(BLOCK):  # warm-up
        watch.check(rank + 1, 0.0, None)
    blocks = []
    for _ in range(max(1, checks // BLOCK)):
        t0 = time.perf_counter()
        for _ in range(BLOCK):
            assert watch.check(rank + 1, 0.0, None) is None
        blocks.append((time.perf_counter() - t0) / BLOCK)
    if rank == 0:
        Path(out).write_text(json.dumps(blocks))
    guard.close()
    s.close()


def agreement_us(checks: int) -> tuple[float, float]:
    """(median, std) microseconds of one ``BudgetWatch.check`` on 2 local gloo workers."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "blocks.json"
        mp.start_processes(_agreement_worker, args=(2, port, checks, str(out)), nprocs=2, start_method="spawn")
        blocks = json.loads(out.read_text())
    return statistics.median(blocks) * 1e6, statistics.pstdev(blocks) * 1e6


def _job(data: Path, cache: Path, strategy: str, steps: int) -> list[str]:
    return ["--strategy", strategy, "--model", "tiny", "--nproc", "2", "--threads", "1", "--max-steps", str(steps),
            "--micro-batch-size", "4", "--seq-len", "64", "--vocab-size", "512", "--dataset", str(data),
            "--cache-dir", str(cache), "--eval-every", "0", "--eval-windows", "4"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", nargs="+", default=["zero1", "acco"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--checks", type=int, default=2000)
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    median_us, std_us = agreement_us(args.checks)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.train.conftest import synthetic_text

        data = tmp_path / "text.txt"
        data.write_text(synthetic_text(4000))
        for r in range(args.repeats):
            for strategy in args.strategies:
                for agreed in ((False, True) if r % 2 == 0 else (True, False)):
                    key = f"{strategy} {'with' if agreed else 'without'}"
                    out = tmp_path / f"{strategy}-{int(agreed)}-{r}"
                    flags = _job(data, tmp_path / "cache", strategy, args.steps)
                    if agreed:
                        flags += ["--max-time-s", "1e9"]
                    summary = run_train(out, *flags)
                    assert summary["stopped_by"] == "max_steps"
                    runs.setdefault(key, []).append(step_stats(summary))
    rows, raw = [], {}
    for strategy in args.strategies:
        med = {}
        for agreed in ("without", "with"):
            stats = runs[f"{strategy} {agreed}"]
            med[agreed] = {k: statistics.median(s[k] for s in stats) for k in stats[0]}
        raw[strategy] = {"runs": {a: runs[f"{strategy} {a}"] for a in ("without", "with")}, "median": med}
        rows.append([strategy, med["without"]["step_s"] * 1e3, med["with"]["step_s"] * 1e3,
                     med["with"]["step_s"] / med["without"]["step_s"], med["without"]["busy"], med["with"]["busy"],
                     med["without"]["micro_batches"], med["with"]["micro_batches"]])
    notes = (f"The agreement alone (`BudgetWatch.check`, 2 local gloo workers): median {median_us:.0f} µs per "
             f"check (std over blocks of {BLOCK}: {std_us:.0f} µs), {args.checks} checks.\n\n"
             f"Whole runs: `quietsync train`, 2 local workers × 1 thread, tiny model, 4×64-token micro-batches, no "
             f"link, {args.steps} steps, with vs without `--max-time-s 1e9` (never reached: the agreement runs after "
             f"every step); median over {args.repeats} interleaved repeats of per-worker `common.step_stats` (first 2 "
             f"steps skipped). Micro-batches are per worker per step. On a shared 2-core machine differences of a "
             f"few percent are noise. Reproduce: `python benchmarks/bench_budgets.py --strategies "
             f"{' '.join(args.strategies)} --steps {args.steps} --repeats {args.repeats} --checks {args.checks}`.")
    path = write_markdown("budgets", "The budgets' agreement: cost per committed step",
                          ["strategy", "step ms without", "step ms with", "with ÷ without", "busy without",
                           "busy with", "micro-batches/step without", "micro-batches/step with"], rows, notes)
    (RESULTS / "budgets.json").write_text(json.dumps({"args": vars(args), "agreement_us": {
        "median": median_us, "std": std_us}, "runs": raw}, indent=1))
    print(path.read_text())


if __name__ == "__main__":
    main()
