"""ACCO with one worker 4× slower against ZeRO-1, run side by side (paper 003 §4.6 / App. C, Fig. 9).

Per seed, three ``quietsync train`` jobs start **at the same time** on this machine, so they share whatever
load it carries: ``zero1 --accumulation 2``, ``acco`` (adaptive, one micro-batch per stage at least, the
straggler rule on: the default ``--straggler-factor 2``) and ``acco --straggler-factor 0`` (every worker
computes in both stages). The last worker is made 4× slower as in the paper (it sleeps 3× each micro-batch's
measured compute). Same model, data, seed, learning-rate schedule and committed steps; equal batch per
committed step as ``bench_acco_paper.py`` (zero1 accumulates 2, acco's stages hold 1 + adaptive extras).

Reported per seed: time to the target held-out loss (the lowest loss all three runs reach) ÷ zero1's, seconds
per committed step, micro-batches per committed step, and how many of acco's estimate stages the slow worker
left empty; then mean ± std over seeds.

    python benchmarks/bench_acco_slow.py [--seeds 0 1 2] [--steps 30] [--link inter=342mbit,1ms]

Without ``--link`` the link is calibrated as ``bench_acco_paper.py`` does (zero1's communication per step ≈ one
micro-batch's compute, measured now, on this machine's load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from bench_acco_paper import calibrate
from common import RESULTS, run_train, step_stats, write_markdown

from quietsync.commands.compare import eval_curve

RUNS = {"zero1": ["--strategy", "zero1", "--accumulation", "2"],
        "acco": ["--strategy", "acco", "--min-accumulation", "1"],
        "acco, straggler rule off": ["--strategy", "acco", "--min-accumulation", "1", "--straggler-factor", "0"]}


def _side_by_side(tmp: Path, base: list[str]) -> dict[str, dict[str, Any]]:
    """Start every run of ``RUNS`` at once; return their summaries."""
    out: dict[str, Any] = {}
    errors: list[BaseException] = []

    def one(label: str, flags: list[str]) -> None:
        try:
            out[label] = run_train(tmp / label.replace(" ", "_").replace(",", ""), *base, *flags)
        except BaseException as e:  # noqa: BLE001 - re-raised below, after every run ended
            errors.append(e)

    threads = [threading.Thread(target=one, args=item) for item in RUNS.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _empty_estimate_stages(summary: dict[str, Any], slow: int) -> tuple[int, int]:
    """(estimate stages the slow worker left empty, estimate stages) from rank 0's committed steps: each step's
    ``stage_micro_batches`` lists the estimate stage's counts, then stage 1's."""
    empty = total = 0
    for r in summary["records"][0]:
        stages = r.get("extra", {}).get("stage_micro_batches") if "event" not in r else None
        if stages and len(stages) == 2:
            total += 1
            empty += stages[0][slow] == 0
    return empty, total


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--link", default=None, help="e.g. inter=342mbit,1ms (default: calibrated, comm ≈ 1× compute)")
    ap.add_argument("--name", default="acco_slow")
    args = ap.parse_args()
    base = ["--nproc", "2", "--model", "tiny", "--eval-windows", "8", "--slow-worker", "1:4"]
    out: dict[str, Any] = {"seeds": {}}
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        link = args.link
        if link is None:
            comm, compute = calibrate(tmp, ["--nproc", "2", "--model", "tiny", "--eval-windows", "8", "--seed", "0"])
            link = f"inter={max(1, round(100 * comm / compute))}mbit,1ms"
            out["calibration"] = {"zero1_comm_s_per_step_at_100mbit": comm, "micro_batch_compute_s": compute}
        out["link"] = link
        for seed in args.seeds:
            load_before = _load()
            runs = _side_by_side(tmp / f"seed{seed}", [*base, "--seed", str(seed), "--link", link,
                                                       "--max-steps", str(args.steps),
                                                       "--eval-every", str(args.eval_every)])
            curves = {k: eval_curve(s["records"]) for k, s in runs.items()}
            target = max(min(e["loss"] for e in c) for c in curves.values())
            seed_out: dict[str, Any] = {"target": target, "load_before": load_before, "load_after": _load()}
            for label, s in runs.items():
                hit = next(e for e in curves[label] if e["loss"] <= target)
                empty, stages = _empty_estimate_stages(s, 1)
                seed_out[label] = {"time_to_target_s": hit["time_s"], "steps_to_target": hit.get("step"),
                                   "wall_s": s["wall_s"], "final_loss": s["last_eval_loss"],
                                   "s_per_step": step_stats(s)["step_s"],
                                   "micro_batches_per_step": s["micro_batches"] / s["steps"],
                                   "empty_estimate_stages": [empty, stages], "curve": curves[label]}
            z = seed_out["zero1"]["time_to_target_s"]
            for label in RUNS:
                seed_out[label]["vs_zero1"] = seed_out[label]["time_to_target_s"] / z
            out["seeds"][seed] = seed_out
            r = seed_out
            rows.append([seed, f"{target:.3f}", f"{z:.0f}", f"{r['acco']['vs_zero1']:.2f}",
                         f"{r['acco, straggler rule off']['vs_zero1']:.2f}",
                         " / ".join(f"{r[k]['s_per_step']:.2f}" for k in RUNS),
                         " / ".join(f"{r[k]['micro_batches_per_step']:.1f}" for k in RUNS),
                         "{} of {}".format(*r["acco"]["empty_estimate_stages"]),
                         f"{load_before} → {seed_out['load_after']}"])
            print(rows[-1], flush=True)
    summary = {}
    for label in ("acco", "acco, straggler rule off"):
        v = [s[label]["vs_zero1"] for s in out["seeds"].values()]
        summary[label] = (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
    rows.append([f"mean ± std ({len(args.seeds)} seeds)", "", "",
                 "{:.2f} ± {:.2f}".format(*summary["acco"]),
                 "{:.2f} ± {:.2f}".format(*summary["acco, straggler rule off"]), "", "", "", ""])
    out["summary"] = {k: {"mean": m, "std": s} for k, (m, s) in summary.items()}
    notes = (f"2 workers, the last 4× slower (`--slow-worker 1:4`), tiny GPT-Neo, 8×128 micro-batches, link {link}, "
             f"{args.steps} committed steps, evaluation every {args.eval_every} (times to target quantised to it). "
             "The three runs of a seed start at the same time and share the machine's load (load averages "
             "1/5/15 min before → after each seed in the last column). Reproduce: "
             f"`python benchmarks/bench_acco_slow.py {' '.join(sys.argv[1:])}`.")
    path = write_markdown(
        args.name, "ACCO with one worker 4× slower vs ZeRO-1, side by side (paper 003 §4.6)",
        ["seed", "target loss", "zero1 s to target", "acco ÷ zero1", "acco (rule off) ÷ zero1",
         "s per step zero1 / acco / rule off", "micro-batches per step zero1 / acco / rule off",
         "slow worker's empty estimate stages", "load before → after"], rows, notes)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=1))
    print(path.read_text())


if __name__ == "__main__":
    main()
