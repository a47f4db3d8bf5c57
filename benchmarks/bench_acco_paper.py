"""ACCO the way paper 003 measures it (§4.3, Fig. 4, Fig. 9 / App. C): equal batch per committed step.

"1 step of gradient accumulation for DDP, and none for ACCO as our method naturally accumulates over 1
step": ``zero1`` with ``--accumulation 2`` against ``acco`` with one micro-batch per stage (adaptive: a worker
that finishes its micro-batch before the communication ends computes more, and those extra micro-batches are
counted in the tokens). Same model, data, seed, lr schedule and number of committed steps.

Links are set from a calibration run so that zero1's communication of one step takes about 1× and 3× one
micro-batch's compute (the paper's Fig. 4 regime is ≈ 1×); each is run with homogeneous workers and with the
last worker 4× slower (it sleeps 3× its measured compute after every micro-batch, as in App. C).

Reported per setting: time and tokens to a target held-out loss (the lowest loss both runs reach), final
loss, tokens, micro-batches per step, compute-busy fraction; curves of held-out loss against time and
against tokens. 4 local gloo workers share this machine's 2 cores, tiny GPT-Neo, 8×128 micro-batches.

    python benchmarks/bench_acco_paper.py [--steps 60] [--eval-every 5]

Options to separate the effects: ``--nproc 2`` (two workers on the two cores: each its own core, so a
worker's idle time is really idle), ``--ratios 1`` / ``--no-slow`` (one setting), ``--deterministic`` (a
third run: acco with exactly 1 micro-batch per stage, the overlap without extras), ``--trace`` (each run's
trace.json and timeline kept under benchmarks/results/NAME-trace/), ``--name`` (results file stem),
``--repeats N`` (every setting N times with seeds 0..N−1; the table gets the mean ± std of acco ÷ zero1),
``--slow-only`` (only the settings with a 4× slower worker), ``--no-straggler-run`` (a third run: adaptive acco
with ``--straggler-factor 0``, i.e. every worker computes in both stages, the pre-straggler-rule behaviour).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import RESULTS, run_train, step_stats, write_markdown

from quietsync.commands.compare import eval_curve

NPROC = 4
BASE = ["--model", "tiny", "--eval-windows", "8"]
RUNS = {"zero1 (accumulation 2)": ["--strategy", "zero1", "--accumulation", "2"],
        "acco (1 micro-batch per stage, adaptive)": ["--strategy", "acco", "--min-accumulation", "1"]}


DETERMINISTIC = {"acco (exactly 1 micro-batch per stage)": ["--strategy", "acco", "--deterministic-accumulation", "1"]}
NO_STRAGGLER = {"acco (adaptive, no straggler rule)": ["--strategy", "acco", "--min-accumulation", "1",
                                                       "--straggler-factor", "0"]}


def calibrate(tmp: Path, base: list[str]) -> tuple[float, float]:
    """(seconds of zero1's communication per step at 100 Mbit/s, seconds of one micro-batch's compute)."""
    s = run_train(tmp / "calibrate", *base, "--strategy", "zero1", "--accumulation", "2", "--max-steps", "6",
                  "--link", "inter=100mbit,1ms", "--eval-every", "0")
    st = step_stats(s)
    steps = [r for r in s["records"][0] if "event" not in r][2:]
    compute = sum(r["compute_s"] for r in steps) / sum(r["micro_batches"] for r in steps)
    return st["idle_s"], compute


def curve(summary: dict[str, Any]) -> list[dict[str, float]]:
    """Rank 0's evaluations with the tokens of all workers at that step (as ``quietsync compare`` counts)."""
    return eval_curve(summary["records"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=NPROC)
    ap.add_argument("--ratios", type=int, nargs="+", default=[1, 3], help="zero1 comm ÷ one micro-batch")
    ap.add_argument("--no-slow", action="store_true", help="homogeneous workers only")
    ap.add_argument("--slow-only", action="store_true", help="only the settings with a 4x slower worker")
    ap.add_argument("--no-straggler-run", action="store_true",
                    help="add adaptive acco with --straggler-factor 0 (every worker computes in both stages)")
    ap.add_argument("--deterministic", action="store_true", help="add acco at exactly 1 micro-batch per stage")
    ap.add_argument("--trace", action="store_true", help="keep each run's trace.json and timeline.png")
    ap.add_argument("--name", default="acco_paper")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every setting, seeds 0..N-1")
    args = ap.parse_args()
    nproc = args.nproc
    base = ["--nproc", str(nproc), *BASE]
    runs_spec = {**RUNS, **(DETERMINISTIC if args.deterministic else {}),
                 **(NO_STRAGGLER if args.no_straggler_run else {})}
    trace_dir = RESULTS / f"{args.name}-trace"
    out: dict[str, Any] = {}
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        comm_100, compute = calibrate(tmp, [*base, "--seed", "0"])
        out["calibration"] = {"zero1_comm_s_per_step_at_100mbit": comm_100, "micro_batch_compute_s": compute}
        print("calibration", out["calibration"], flush=True)
        for ratio in args.ratios:
            mbit = max(1, round(100 * comm_100 / (ratio * compute)))
            link = f"inter={mbit}mbit,1ms"
            settings = {"homogeneous": [], "one worker 4x slower": ["--slow-worker", f"{nproc - 1}:4"]}
            if args.no_slow:
                settings.pop("one worker 4x slower")
            if args.slow_only:
                settings.pop("homogeneous")
            for (setting, extra), seed in [(item, seed) for item in settings.items()
                                           for seed in range(args.repeats)]:
                key = f"comm≈{ratio}× compute ({link}), {setting}" + (f", seed {seed}" if args.repeats > 1 else "")
                extra = [*extra, "--seed", str(seed)]
                runs = {}
                for label, flags in runs_spec.items():
                    run_dir = ((trace_dir / f"r{len(out)}-{len(runs)}") if args.trace
                               else tmp / f"r{len(out)}-{len(runs)}")
                    s = run_train(run_dir, *base, *flags, *extra, "--link", link, *(["--trace"] if args.trace else []),
                                  "--max-steps", str(args.steps), "--eval-every", str(args.eval_every))
                    runs[label] = {"curve": curve(s), "wall_s": s["wall_s"], "tokens": s["tokens"],
                                   "last_eval_loss": s["last_eval_loss"], "stats": step_stats(s),
                                   "micro_batches_per_step": s["micro_batches"] / s["steps"]}
                    print(key, label, runs[label]["wall_s"], runs[label]["last_eval_loss"], flush=True)
                target = max(min(e["loss"] for e in r["curve"]) for r in runs.values())
                for r in runs.values():
                    hit = next(e for e in r["curve"] if e["loss"] <= target)
                    r["time_to_target_s"], r["tokens_to_target"] = hit["time_s"], hit["tokens"]
                z, a = list(runs.values())[:2]
                for label, r in list(runs.items())[2:]:
                    print(f"{key} {label}: {r['time_to_target_s']:.1f} s to target "
                          f"({r['time_to_target_s'] / z['time_to_target_s']:.2f}× zero1), "
                          f"busy {r['stats']['busy']:.2f}")
                rows.append([key, target, z["time_to_target_s"], a["time_to_target_s"],
                             a["time_to_target_s"] / z["time_to_target_s"], z["tokens_to_target"],
                             a["tokens_to_target"], z["micro_batches_per_step"], a["micro_batches_per_step"],
                             z["stats"]["busy"], a["stats"]["busy"], z["last_eval_loss"], a["last_eval_loss"]])
                out[key] = {"target": target, "runs": runs}
    if args.repeats > 1:  # mean ± std over seeds of each setting's acco ÷ zero1 time to target
        by_setting: dict[str, list[float]] = {}
        for row in rows:
            by_setting.setdefault(row[0].rsplit(", seed", 1)[0], []).append(row[4])
        for setting, ratios in by_setting.items():
            rows.append([f"{setting}: mean ± std over {len(ratios)} seeds", "", "", "",
                         f"{statistics.mean(ratios):.2f} ± {statistics.stdev(ratios):.2f}", "", "", "", "", "", "", "",
                         ""])
        out["repeats"] = {k: v for k, v in by_setting.items()}
        extra_ratios: dict[tuple[str, str], list[float]] = {}  # the extra runs' time ÷ zero1's, per setting
        for key, v in out.items():
            if key in ("calibration", "repeats"):
                continue
            z = next(iter(v["runs"].values()))["time_to_target_s"]
            for label, r in list(v["runs"].items())[2:]:
                extra_ratios.setdefault((key.rsplit(", seed", 1)[0], label), []).append(r["time_to_target_s"] / z)
        repeats_note = " ".join(
            f"{label} ÷ zero1, {setting}: {statistics.mean(v):.2f} ± {statistics.stdev(v):.2f} "
            f"({', '.join(f'{x:.3f}' for x in v)})." for (setting, label), v in extra_ratios.items())
    else:
        repeats_note = ""
    extra_runs = {k: {label: {"time_to_target_s": r["time_to_target_s"], "tokens_to_target": r["tokens_to_target"],
                              "busy": r["stats"]["busy"], "wall_s": r["wall_s"]}
                      for label, r in list(v["runs"].items())[2:]}
                  for k, v in out.items() if k not in ("calibration", "repeats")}
    notes = (f"{nproc} workers (each its own node on the emulated link), tiny GPT-Neo, 8×128 micro-batches, "
             f"{args.steps} committed steps each, evaluation every {args.eval_every} steps (times and tokens to "
             "target are quantised to it). Calibration: zero1's communication per step at 100 Mbit/s = "
             f"{comm_100:.2f} s, one micro-batch = {compute:.2f} s of compute. The target is the lowest held-out "
             f"loss both runs reach. {nproc} processes share this machine's cores. Reproduce: "
             f"`python benchmarks/bench_acco_paper.py {' '.join(sys.argv[1:])}`. {repeats_note}"
             + (f" Extra runs (time and tokens to the same target): {json.dumps(extra_runs, ensure_ascii=False)}"
                if any(extra_runs.values()) else ""))
    path = write_markdown(
        args.name, "ACCO vs ZeRO-1 at equal batch per step (paper 003 §4.3)",
        ["setting", "target loss", "zero1 s to target", "acco s to target", "acco ÷ zero1 time",
         "zero1 tokens to target", "acco tokens to target", "zero1 micro-batches/step", "acco micro-batches/step",
         "zero1 busy", "acco busy", "zero1 final loss", "acco final loss"], rows, notes)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(out, indent=1))
    _plot(out, args.name)
    print(path.read_text())


def _plot(out: dict[str, Any], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in out if k not in ("calibration", "repeats") and "seed" not in k or k.endswith("seed 0")]
    fig, axes = plt.subplots(2, len(keys), figsize=(4.2 * len(keys), 7), squeeze=False)
    for col, key in enumerate(keys):
        for label, r in out[key]["runs"].items():
            short = label.split(" (")[0] + (" ×1" if "exactly" in label else "")
            axes[0][col].plot([e["time_s"] for e in r["curve"]], [e["loss"] for e in r["curve"]], ".-", label=short)
            axes[1][col].plot([e["tokens"] for e in r["curve"]], [e["loss"] for e in r["curve"]], ".-", label=short)
        for row in (0, 1):
            axes[row][col].axhline(out[key]["target"], color="k", lw=0.6, ls="--")
        axes[0][col].set_title(key, fontsize=8)
        axes[0][col].set_xlabel("seconds")
        axes[1][col].set_xlabel("tokens (all workers)")
    axes[0][0].set_ylabel("held-out loss")
    axes[1][0].set_ylabel("held-out loss")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)


if __name__ == "__main__":
    main()
