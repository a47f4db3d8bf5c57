"""Adaptive inner steps with one slow worker: time to an equal-loss target against the same method synchronous.

One worker is made ``--slow`` times slower (``--slow-worker 1:F``: it sleeps F − 1 times its measured compute after
every micro-batch, as the ACCO paper's heterogeneity experiments and Async Local-SGD emulate a slower device). The
synchronous method waits for it at every outer sync; ``--inner-steps adaptive`` gives it ``round(H / F)`` inner steps
per round while the fast worker takes H, and weighs the outer average by tokens.

1. The target: the **homogeneous** synchronous runs (no slow worker), one per seed, ``--steps`` steps; the target
   is the highest of their final held-out losses (a loss every homogeneous seed reaches), their spread is the seed
   spread.
2. Per seed, side by side (started together, so both see the same load on the shared machine): the synchronous and
   the adaptive run with the slow worker, each stopped by ``--target-loss`` (evaluated every ``--eval-every``
   steps; at most ``--cap`` × ``--steps`` steps). Time to target = the training clock at the first evaluation at
   or below it (setup excluded); tokens to target likewise.

A constant learning rate after a fixed 4-step warm-up (``--min-lr-ratio 1 --warmup-steps 4``) so that a run's
curve does not depend on its step cap. Every worker has one torch thread.

    python benchmarks/bench_uneven.py [--method diloco] [--sync-every 16] [--steps 96] [--slow 3] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import RESULTS, run_train, write_markdown

from quietsync.commands.compare import eval_curve


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _flags(args: argparse.Namespace, seed: int) -> list[str]:
    return ["--strategy", args.method, "--sync-every", str(args.sync_every), "--model", args.model,
            "--nproc", str(args.nproc), "--threads", "1", "--eval-every", str(args.eval_every),
            "--eval-windows", str(args.eval_windows), "--min-lr-ratio", "1", "--warmup-steps", "4",
            "--seed", str(seed)]


def _time_to(summary: dict[str, Any], target: float) -> dict[str, Any]:
    curve = eval_curve(summary["records"])
    hit = next((e for e in curve if e["loss"] <= target), None)
    return {"reached": hit is not None, "time_s": hit["time_s"] if hit else None,
            "tokens": hit["tokens"] if hit else None, "step": hit["step"] if hit else None,
            "loss": hit["loss"] if hit else curve[-1]["loss"], "curve": curve, "steps": summary["steps"],
            "wall_s": summary["wall_s"], "tokens_total": summary["tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="diloco", choices=["diloco", "localsgd"])
    ap.add_argument("--sync-every", type=int, default=16)
    ap.add_argument("--steps", type=int, default=96, help="steps of the homogeneous runs (multiple of H)")
    ap.add_argument("--eval-every", type=int, default=16)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--slow", type=float, default=3.0, help="slow-down factor of worker 1")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--cap", type=int, default=4, help="slow runs stop at cap x --steps steps at the latest")
    ap.add_argument("--name", default="uneven")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="run each seed's synchronous and adaptive runs one after the other (every other seed in the "
                         "other order) instead of side by side: half the processes per core where the cores are few")
    args = ap.parse_args()
    load = {"start": uptime()}
    print(load["start"], flush=True)
    with tempfile.TemporaryDirectory(prefix="quietsync-uneven-") as tmp_s:
        tmp = Path(tmp_s)
        with ThreadPoolExecutor(len(args.seeds)) as pool:
            homog = dict(zip(args.seeds, pool.map(lambda s: run_train(
                tmp / f"homog-{s}", *_flags(args, s), "--max-steps", str(args.steps)), args.seeds)))
        finals = {s: h["last_eval_loss"] for s, h in homog.items()}
        target = max(finals.values())
        print(f"homogeneous final losses {finals}: target {target:.4f}", flush=True)
        load["after_homogeneous"] = uptime()
        slow = ["--slow-worker", f"1:{args.slow:g}", "--target-loss", f"{target:.6f}",
                "--max-steps", str(args.cap * args.steps)]
        pairs: dict[int, dict[str, Any]] = {}
        for i, s in enumerate(args.seeds):
            # side by side: the same load on both; one at a time: fewer processes per core, the order alternating
            with ThreadPoolExecutor(1 if args.one_at_a_time else 2) as pool:
                runs = [("sync", []), ("adaptive", ["--inner-steps", "adaptive"])]
                if args.one_at_a_time and i % 2:
                    runs.reverse()
                futures = {label: pool.submit(run_train, tmp / f"{label}-{s}", *_flags(args, s), *slow, *extra)
                           for label, extra in runs}
                sync_f, adapt_f = futures["sync"], futures["adaptive"]
                sync, adapt = _time_to(sync_f.result(), target), _time_to(adapt_f.result(), target)
            plans = sorted({r["extra"].get("round_inner_steps") for r in adapt_f.result()["records"][1]
                            if "event" not in r and "extra" in r})
            pairs[s] = {"sync": sync, "adaptive": adapt, "slow_worker_inner_steps_per_round": plans,
                        "speedup": (sync["time_s"] / adapt["time_s"]) if sync["reached"] and adapt["reached"]
                        else None, "uptime": uptime()}
            print(f"seed {s}: sync {sync['time_s']} s, adaptive {adapt['time_s']} s to {target:.4f} "
                  f"-> {pairs[s]['speedup']}x; {pairs[s]['uptime']}", flush=True)
    load["end"] = uptime()
    speedups = [p["speedup"] for p in pairs.values() if p["speedup"] is not None]
    result = {"args": vars(args), "homogeneous_final_loss": finals, "target": target, "pairs": pairs,
              "speedup_mean": statistics.mean(speedups) if speedups else None, "load": load,
              "homogeneous_curves": {s: eval_curve(h["records"]) for s, h in homog.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    rows = []
    for s, p in pairs.items():
        for label in ("sync", "adaptive"):
            r = p[label]
            rows.append([s, f"{args.method} {label}", r["time_s"], r["tokens"], r["step"], r["loss"],
                         r["tokens"] / r["time_s"] if r["reached"] else None,
                         p["speedup"] if label == "adaptive" else ""])
    spread = f"{min(finals.values()):.4f} to {max(finals.values()):.4f}"
    extra = (f"{' --nproc ' + str(args.nproc) if args.nproc != 2 else ''}"
             f"{' --one-at-a-time' if args.one_at_a_time else ''}"
             f"{' --name ' + args.name if args.name != 'uneven' else ''}")
    how = "one after the other" if args.one_at_a_time else "side by side"
    notes = (f"`python benchmarks/bench_uneven.py --method {args.method} --sync-every {args.sync_every} --steps "
             f"{args.steps} --eval-every {args.eval_every} --slow {args.slow:g} --seeds "
             f"{' '.join(map(str, args.seeds))}{extra}`: {args.nproc} workers (one torch thread each), model "
             f"{args.model}, worker 1 {args.slow:g}x slower (sleep), constant lr after a 4-step warm-up. Target = "
             f"the highest final held-out loss of the homogeneous synchronous runs at {args.steps} steps "
             f"(seeds {', '.join(map(str, args.seeds))}: {spread}) = {target:.4f}. Each seed's synchronous and "
             f"adaptive runs ran {how}; time = training clock at the first evaluation at or below the "
             f"target (every {args.eval_every} steps). Slow worker's inner steps per round under adaptive: "
             f"{ {s: p['slow_worker_inner_steps_per_round'] for s, p in pairs.items()} }. Mean speed-up "
             f"(sync time / adaptive time): {result['speedup_mean']}. Load (`uptime`): {load}.")
    write_markdown(args.name, "Adaptive inner steps with one slow worker (time to an equal-loss target)",
                   ["seed", "run", "s to target", "tokens to target", "step", "loss at target", "tokens/s",
                    "speed-up"], rows, notes)
    print((RESULTS / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
