"""``demo --adapt`` (top-k re-picked from the measured link) against static DeMo at the k it starts from, on a link
that drops from 100 to 10 Mbit/s for the middle third of the run.

Arms (2 workers, one per node, one torch thread each, tiny model, the same seed; every arm runs for the same
training seconds ``T`` and evaluates the committed model every ``--eval-every`` steps):

1. ``static drop``: ``--topk K`` fixed, on ``100mbit@0s,10mbit@T/3,100mbit@2T/3``;
2. ``adapt drop``: ``--adapt --topk K`` on the same schedule (K is kept while the link carries it: its first
   decision, on the 100 Mbit/s stretch, logs no change).

The target is the lowest eval loss both arms reach (the pair's equal-loss target); time to target is the training
seconds at which the eval curve crosses it, interpolated linearly between the two evaluations around it (the loss
still falls steeply at the end of a short run: the first evaluation at or under it would round both arms to their
last evaluation). Each repeat runs the pair in the other order than the one before (a load that drifts falls on
both), or with ``--together`` both arms at once (the same load on both, each slower); absolute seconds move with
the machine's load (``uptime`` is recorded).

    python benchmarks/bench_adapt_demo.py --seconds 120 --topk 256 --repeats 2   # results/adapt_demo.{md,json}
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_adapt import arm, changes, costs, drop_link, evals  # noqa: E402
from common import RESULTS  # noqa: E402


def crossing(run: dict, target: float) -> float | None:
    """Training seconds at which ``run``'s eval curve first reaches ``target`` (linear between evaluations)."""
    points = [(t, loss) for t, loss, _ in evals(run)]
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if l1 <= target:
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1) if l0 > target else t0
    return None


def pair(static: dict, adapt: dict) -> dict:
    """Equal-loss target of two arms and their times to it; ``ratio`` = static's time / adapt's."""
    target = max(min(loss for _, loss, _ in evals(static)), min(loss for _, loss, _ in evals(adapt)))
    a, b = crossing(static, target), crossing(adapt, target)
    return {"a": static["name"], "b": adapt["name"], "target": target, "a_s": a, "b_s": b,
            "ratio": a / b if a and b else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=90.0, help="training seconds of every arm (T)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--topk", type=int, default=128, help="K: the static arm's k and the adapt arm's start")
    ap.add_argument("--max-steps", type=int, default=2000, help="the lr schedule's length (runs stop by time)")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--together", action="store_true", help="run the two arms of a pair at the same time")
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_adapt_demo_"))
    T = args.seconds
    base = ["--strategy", "demo", "--model", "tiny", "--nproc", "2", "--threads", "1", "--seed", str(args.seed),
            "--max-time-s", f"{T:g}", "--max-steps", str(args.max_steps), "--warmup-steps", "20",
            "--eval-every", str(args.eval_every), "--eval-windows", "24", "--overwrite", "--topk", str(args.topk),
            "--link", drop_link(T)]
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    print(f"work {work}; {uptime[0]}", flush=True)
    pairs, runs = [], []
    for i in range(args.repeats):
        order = [("static drop", []), ("adapt drop", ["--adapt"])][:: 1 if i % 2 == 0 else -1]
        names = {what: what if i == 0 else f"{what} #{i + 1}" for what, _ in order}
        if args.together:  # both arms under the same load at once (each is a subprocess: threads suffice)
            with ThreadPoolExecutor(2) as pool:
                futures = {what: pool.submit(arm, work, names[what], [*base, *knobs]) for what, knobs in order}
                got = {what: f.result() for what, f in futures.items()}
        else:
            got = {what: arm(work, names[what], [*base, *knobs]) for what, knobs in order}
        runs += [got["static drop"], got["adapt drop"]]
        pairs.append(pair(got["static drop"], got["adapt drop"]))  # ratio: static's time / adapt's
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    rows = [{"name": r["name"], **costs(r, T), "last_eval": evals(r)[-1][1],
             "changes": [(c["step"], c["old"], c["new"]) for c in changes(r)]} for r in runs]
    result = {"flags": base, "uptime": uptime, "pairs": pairs, "arms": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "adapt_demo.json").write_text(json.dumps(result, indent=1))
    lines = ["# demo --adapt on a link that drops (benchmarks/bench_adapt_demo.py)", "",
             f"`python benchmarks/bench_adapt_demo.py --seconds {T:g} --topk {args.topk} --repeats {args.repeats}"
             f"{' --together' if args.together else ''}`; "
             f"load: {uptime[0]} / {uptime[1]}", "",
             "| arm | steps | idle s (middle third) | last eval | k changes (step, old, new) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['steps']} | {r['idle_s']:.1f} ({r['idle_middle_third_s']:.1f}) | "
              f"{r['last_eval']:.4f} | {r['changes']} |" for r in rows]
    lines += ["", "| pair | target | static s | adapt s | static / adapt |", "|---|---|---|---|---|"]
    lines += [f"| {p['a']} / {p['b']} | {p['target']:.4f} | {p['a_s']:.1f} | {p['b_s']:.1f} | "
              f"{p['ratio'] if p['ratio'] is None else round(p['ratio'], 3)} |" for p in pairs]
    (RESULTS / "adapt_demo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
