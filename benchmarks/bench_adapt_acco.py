"""``acco --adapt`` (the cap on micro-batches per stage re-picked from the measured link) against static ACCO at the
cap it starts from, on a link that drops from 100 to 10 Mbit/s for the middle third of the run.

Arms (2 workers, one per node, one torch thread each, tiny model, the same seed; both run for the same training
seconds ``T``, **at the same time** -- the same load on both, each slower -- and evaluate the committed model every
``--eval-every`` steps):

1. ``static drop``: ``--max-accumulation C`` (default 4: the capped row of the plan's ACCO grid), on
   ``100mbit@0s,10mbit@T/3,100mbit@2T/3``;
2. ``adapt drop``: ``--max-accumulation C --adapt --adapt-max-accumulation B`` on the same schedule.

Reported side by side: the time to the pair's equal-loss target (the lowest eval loss both reach, interpolated
between evaluations: ``bench_adapt_demo.pair``), the seconds idle on the network overall and in the drop's third,
tokens (micro-batches) per second, and every change of the cap. Absolute seconds move with the machine's load
(``uptime`` is recorded before and after).

    python benchmarks/bench_adapt_acco.py --seconds 60                               # results/adapt_acco.*
    python benchmarks/bench_adapt_acco.py --seconds 60 --seed 1 --name adapt_acco_seed1  # ~1.5 min each
    python benchmarks/bench_adapt_acco.py --seconds 60 --steady --name adapt_acco_steady  # a steady link
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_adapt import arm, changes, costs, drop_link, evals  # noqa: E402
from bench_adapt_demo import pair  # noqa: E402
from common import RESULTS  # noqa: E402


def micro_batches(run: dict[str, Any], seconds: float) -> dict[str, float]:
    """Rank 0's micro-batches in all the committed steps (both workers') and in the drop's third."""
    steps = [r for r in run["records"][0] if "event" not in r]
    total = sum(r["extra"].get("global_micro_batches", 0) for r in steps)
    middle = sum(r["extra"].get("global_micro_batches", 0) for r in steps
                 if seconds / 3 <= r["time_s"] < 2 * seconds / 3)
    return {"micro_batches": total, "micro_batches_middle_third": middle}


def _s(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="training seconds of every arm (T)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cap", type=int, default=4, help="C: the static arm's cap and the adapt arm's start")
    ap.add_argument("--bound", type=int, default=64, help="B: the largest cap the adapt arm may pick")
    ap.add_argument("--max-steps", type=int, default=2000, help="the lr schedule's length (runs stop by time)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--steady", action="store_true",
                    help="a steady 100 Mbit/s link instead of the drop: what --adapt costs where nothing changes")
    ap.add_argument("--name", default="adapt_acco", help="results/NAME.{md,json}")
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_adapt_acco_"))
    T = args.seconds
    base = ["--strategy", "acco", "--model", "tiny", "--nproc", "2", "--threads", "1", "--seed", str(args.seed),
            "--max-time-s", f"{T:g}", "--max-steps", str(args.max_steps), "--warmup-steps", "20",
            "--eval-every", str(args.eval_every), "--eval-windows", "8", "--overwrite",
            "--max-accumulation", str(args.cap), "--link", "inter=100mbit" if args.steady else drop_link(T)]
    link = "steady" if args.steady else "drop"
    arms = [(f"static {link}", []), (f"adapt {link}", ["--adapt", "--adapt-max-accumulation", str(args.bound)])]
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    print(f"work {work}; {uptime[0]}", flush=True)
    with ThreadPoolExecutor(2) as pool:  # both arms under the same load at once (each is a subprocess)
        futures = {what: pool.submit(arm, work, what, [*base, *knobs]) for what, knobs in arms}
        got = {what: f.result() for what, f in futures.items()}
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    static, adapt = got[f"static {link}"], got[f"adapt {link}"]
    result_pair = pair(static, adapt)  # ratio: static's time / adapt's
    rows = [{"name": r["name"], **costs(r, T), **micro_batches(r, T), "last_eval": evals(r)[-1][1],
             "changes": [(c["step"], c["old"], c["new"]) for c in changes(r)]} for r in (static, adapt)]
    result = {"flags": base, "uptime": uptime, "pair": result_pair, "arms": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    p = result_pair
    what = "a steady 100 Mbit/s link" if args.steady else "a link that drops"
    lines = [f"# acco --adapt on {what} (benchmarks/bench_adapt_acco.py)", "",
             f"`python benchmarks/bench_adapt_acco.py --seconds {T:g} --seed {args.seed} --cap {args.cap} --bound "
             f"{args.bound}{' --steady' if args.steady else ''} --name {args.name}`; "
             f"both arms at once; load: {uptime[0]} / {uptime[1]}", "",
             "| arm | steps | micro-batches (middle third) | idle s (middle third) | last eval | cap changes "
             "(step, old, new) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['steps']} | {r['micro_batches']} ({r['micro_batches_middle_third']}) | "
              f"{r['idle_s']:.1f} ({r['idle_middle_third_s']:.1f}) | {r['last_eval']:.4f} | {r['changes']} |"
              for r in rows]
    lines += ["", "| pair | target | static s | adapt s | static / adapt |", "|---|---|---|---|---|",
              f"| {p['a']} / {p['b']} | {p['target']:.4f} | {_s(p['a_s'])} | {_s(p['b_s'])} | "
              f"{p['ratio'] if p['ratio'] is None else round(p['ratio'], 3)} |"]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
