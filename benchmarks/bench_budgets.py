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

Local methods (localsgd, diloco) agree only every H steps and after evaluations (``Strategy.meeting_period``);
``--old-src DIR`` adds a third variant, the agreed budget with the package imported from ``DIR`` (the code before
that change: an agreement after every inner step), ``--job equal-loss`` runs bench_goodput's/the equal-loss
job's micro-batches (8 × 128 tokens) instead of 4 × 64, and ``--name`` writes ``results/NAME.{md,json}``::

    python benchmarks/bench_budgets.py --strategies localsgd diloco --steps 400 --repeats 2 --checks 200 \
        --job equal-loss --old-src OLD/src --name budgets_local
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
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
    watch = BudgetWatch(Budgets(10**9, max_time_s=1e9), s)
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


def _job(data: Path, cache: Path, strategy: str, steps: int, job: str = "small") -> list[str]:
    mb, seq = ("8", "128") if job == "equal-loss" else ("4", "64")
    return ["--strategy", strategy, "--model", "tiny", "--nproc", "2", "--threads", "1", "--max-steps", str(steps),
            "--micro-batch-size", mb, "--seq-len", seq, "--vocab-size", "512", "--dataset", str(data),
            "--cache-dir", str(cache), "--eval-every", "0", "--eval-windows", "4"]


@contextlib.contextmanager
def _package_from(src: Path | None) -> Iterator[None]:
    """Within: ``quietsync train`` children import the package from ``src`` (None: as installed)."""
    saved = os.environ.get("PYTHONPATH")
    if src is not None:
        os.environ["PYTHONPATH"] = str(src)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", nargs="+", default=["zero1", "acco"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--checks", type=int, default=2000)
    ap.add_argument("--job", choices=["small", "equal-loss"], default="small")
    ap.add_argument("--old-src", type=Path, default=None,
                    help="also run the agreed budget with the package from this src folder (the code before a change)")
    ap.add_argument("--name", default="budgets", help="results/NAME.{md,json} (default budgets)")
    args = ap.parse_args()
    variants = ("without", "with") + (("with, code before",) if args.old_src else ())
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
                for variant in (variants if r % 2 == 0 else variants[::-1]):
                    out = tmp_path / f"{strategy}-{variants.index(variant)}-{r}"
                    flags = _job(data, tmp_path / "cache", strategy, args.steps, args.job)
                    if variant != "without":
                        flags += ["--max-time-s", "1e9"]
                    with _package_from(args.old_src if variant == "with, code before" else None):
                        summary = run_train(out, *flags)
                    assert summary["stopped_by"] == "max_steps"
                    runs.setdefault(f"{strategy} {variant}", []).append(step_stats(summary))
    rows, raw = [], {}
    for strategy in args.strategies:
        med = {}
        for variant in variants:
            stats = runs[f"{strategy} {variant}"]
            med[variant] = {k: statistics.median(s[k] for s in stats) for k in stats[0]}
        raw[strategy] = {"runs": {a: runs[f"{strategy} {a}"] for a in variants}, "median": med}
        for variant in variants[1:]:
            rows.append([strategy if variant == "with" else f"{strategy} ({variant})", med["without"]["step_s"] * 1e3,
                         med[variant]["step_s"] * 1e3, med[variant]["step_s"] / med["without"]["step_s"],
                         med["without"]["busy"], med[variant]["busy"], med["without"]["micro_batches"],
                         med[variant]["micro_batches"]])
    notes = (f"The agreement alone (`BudgetWatch.check`, 2 local gloo workers): median {median_us:.0f} µs per "
             f"check (std over blocks of {BLOCK}: {std_us:.0f} µs), {args.checks} checks.\n\n"
             f"Whole runs: `quietsync train`, 2 local workers × 1 thread, tiny model, "
             f"{'8×128' if args.job == 'equal-loss' else '4×64'}-token micro-batches, no "
             f"link, {args.steps} steps, with vs without `--max-time-s 1e9` (never reached: the agreement runs after "
             f"every step -- for localsgd and diloco every H steps, and after evaluations, since 15b3bec); median "
             f"over {args.repeats} interleaved repeats of per-worker `common.step_stats` (first 2 steps skipped). "
             f"Micro-batches are per worker per step. On a shared 2-core machine differences of a "
             f"few percent are noise. Reproduce: `python benchmarks/bench_budgets.py --strategies "
             f"{' '.join(args.strategies)} --steps {args.steps} --repeats {args.repeats} --checks {args.checks}"
             f"{' --job ' + args.job if args.job != 'small' else ''}"
             f"{' --old-src OLD/src' if args.old_src else ''}"
             f"{' --name ' + args.name if args.name != 'budgets' else ''}`"
             f"{' (OLD: a checkout of the code before local methods agreed every H steps)' if args.old_src else ''}"
             f"; {time.strftime('%Y-%m-%d')}.")
    path = write_markdown(args.name, "The budgets' agreement: cost per committed step",
                          ["strategy", "step ms without", "step ms with", "with ÷ without", "busy without",
                           "busy with", "micro-batches/step without", "micro-batches/step with"], rows, notes)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                                   for k, v in vars(args).items()}, "agreement_us": {
        "median": median_us, "std": std_us}, "runs": raw}, indent=1))
    print(path.read_text())


if __name__ == "__main__":
    main()
