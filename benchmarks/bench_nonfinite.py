"""What the non-finite check costs local methods per inner step: ``--on-nonfinite stop`` against ``skip``.

Under ``skip`` the workers agree on one flag before every round commits (a gloo all-reduce on the trainer's own
group, not link-emulated, not metered; its wait is idle time), and so did ``stop`` before local methods were
given a check on the worker alone (``Strategy.local_rounds``, :mod:`quietsync.train.nonfinite`): for localsgd and
diloco, whose inner steps are local, that agreement is a barrier on every inner step. With no non-finite value
in the run, ``skip`` runs exactly the code path ``stop`` ran before the change, so the pair measures it side by
side on the same code; ``--old-src DIR`` adds a third variant, ``stop`` with the package imported from ``DIR``
(e.g. a ``git archive`` of main before the change), to show it.

The job is bench_goodput's (tiny model, micro-batch 8×128, vocab 512, one thread per worker, 2 workers: a core
each on this 2-core machine), H = K = 20, ``--max-steps`` inner steps, no evaluation during training. Variants
run in ABBA order per strategy so drift of a shared machine hits both alike. Reported per variant (workers
averaged, the first 2 steps left out): wall time per inner step, its compute part, the rest ("beyond compute":
communication, the agreement's wait, the loop's own work), and the idle time per step.

    python benchmarks/bench_nonfinite.py [--steps 600]

Writes ``benchmarks/results/nonfinite.{md,json}``.
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

from common import RESULTS, run_train, step_stats, write_markdown  # noqa: E402

from tests.train.conftest import synthetic_text  # noqa: E402

STRATEGIES = {"localsgd": ["--strategy", "localsgd", "--sync-every", "20"],
              "diloco": ["--strategy", "diloco", "--sync-every", "20"]}


def job_flags(root: Path, steps: int) -> list[str]:
    return ["--model", "tiny", "--nproc", "2", "--max-steps", str(steps), "--micro-batch-size", "8", "--seq-len",
            "128", "--vocab-size", "512", "--dataset", str(root / "text.txt"), "--cache-dir", str(root / "cache"),
            "--eval-every", "0", "--eval-windows", "8", "--threads", "1", "--seed", "0"]


def run_variant(root: Path, strategy: str, variant: str, steps: int, old_src: Path | None, k: int) -> dict:
    policy = "skip" if variant == "skip" else "stop"
    saved = os.environ.get("PYTHONPATH")
    if variant == "stop-before":
        os.environ["PYTHONPATH"] = str(old_src)
    try:
        summary = run_train(root / f"{strategy}-{variant}-{k}", *STRATEGIES[strategy], *job_flags(root, steps),
                            "--on-nonfinite", policy)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    stats = step_stats(summary)
    row = {"strategy": strategy, "variant": variant, "repeat": k, "train_wall_s": summary["wall_s"],
           "step_ms": 1e3 * stats["step_s"], "compute_ms": 1e3 * stats["step_s"] * stats["busy"],
           "beyond_compute_ms": 1e3 * stats["step_s"] * (1 - stats["busy"]), "idle_ms": 1e3 * stats["idle_s"],
           "final_loss": summary["last_eval_loss"]}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    p.add_argument("--old-src", type=Path, default=None,
                   help="also run stop with the package from this src folder (the code before the change)")
    args = p.parse_args()
    order = ["skip", "stop", "stop", "skip"]
    if args.old_src is not None:
        order = ["stop-before", "skip", "stop", "stop", "skip", "stop-before"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-nonfinite-") as tmp:
        root = Path(tmp)
        (root / "text.txt").write_text(synthetic_text(6000))
        for strategy in args.strategies:
            seen: dict[str, int] = {}
            for variant in order:
                seen[variant] = seen.get(variant, 0) + 1
                rows.append(run_variant(root, strategy, variant, args.steps, args.old_src, seen[variant]))
    table = []
    for strategy in args.strategies:
        for variant in dict.fromkeys(order):
            mine = [r for r in rows if r["strategy"] == strategy and r["variant"] == variant]
            table.append([strategy, variant, len(mine)] + [statistics.mean(r[k] for r in mine) for k in
                         ("step_ms", "compute_ms", "beyond_compute_ms", "idle_ms", "train_wall_s")])
    label = {"skip": "skip (= stop before the change)", "stop": "stop (checked on each worker)",
             "stop-before": "stop, code before the change"}
    notes = (f"{args.steps} inner steps, 2 workers (one thread each), tiny model, H = K = 20; ABBA order, "
             "means over the repeats; `beyond compute` = wall per step - compute per step. Command: "
             f"`python benchmarks/bench_nonfinite.py --steps "
             f"{args.steps}{' --old-src DIR' if args.old_src else ''}`; load average at the end "
             f"{os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d')}.")
    write_markdown("nonfinite", "Non-finite check: per-inner-step cost under stop and skip",
                   ["strategy", "--on-nonfinite", "runs", "wall ms/step", "compute ms/step",
                    "beyond compute ms/step", "idle ms/step", "training wall s"],
                   [[r[0], label[r[1]], *r[2:]] for r in table], notes)
    (RESULTS / "nonfinite.json").write_text(json.dumps({"rows": rows, "args": {"steps": args.steps}}, indent=1)
                                             + "\n")


if __name__ == "__main__":
    main()
