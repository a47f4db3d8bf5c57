"""`quietsync compare`: several strategies on the same work, side by side.

Runs `quietsync train` once per strategy with the same job flags (model, data, seed, steps, links,
slow worker, budgets), each into ``OUT/<label>``, then writes the files below. A non-empty ``OUT`` is refused unless
``--overwrite`` is given (then each run replaces its own outputs, see :mod:`quietsync.train.outputs`):

* ``OUT/compare.json`` and ``OUT/compare.md``: one row per strategy (final eval loss, what stopped it, wall
  time, tokens, micro-batches per step, tokens/s, bytes sent per step and per 1k tokens — both of the training
  steps, the initial parameter broadcast named below the table — compute / idle / comm seconds per worker,
  compute-busy fraction, and with ``--target-loss X`` the training time and tokens at which the held-out loss
  first reached X);
* ``OUT/compare.png``: eval loss vs wall-clock time and vs tokens (all workers), bytes sent per step per
  group, and the per-worker compute / idle time of each run;
* ``OUT/timelines.png`` (with ``--trace``): every run's timeline (a few steps from the middle of the run, one
  row per worker and lane) side by side, on one time scale.

With ``--predict`` the runs are first predicted by ``quietsync plan`` (:mod:`quietsync.plan.compare_predict`: the
same model, micro-batch, workers and links, calibrated on this machine), and the predictions are printed (and saved
in ``compare.json`` under ``predicted``) beside the measurements; with ``--target-loss X --pilot-tokens N`` the plan
runs pilots of the compared settings first, so each run's predicted time and tokens to the target are printed beside
the measured ones and ``compare.png`` draws its predicted curve dashed.

The budgets (``--max-steps``, ``--max-tokens``, ``--max-time-s``, ``--target-loss``; see
:mod:`quietsync.train.budgets`) go to every run, each stopping at the first it reaches. An equal token budget
(``--max-tokens``, with ``--max-steps`` large enough never to be reached first) is the fair comparison: strategies
that take more micro-batches per step (DDP with accumulation, ACCO) would otherwise see more data. Runs that end
with different token counts are not an equal-budget comparison: the table says so. ``--no-stop-at-target``
keeps ``--target-loss`` for the report only.

A strategy may carry its own flags: ``--strategies zero1 ddp:accumulation=2`` (``NAME[:FIELD=VALUE,...]``,
field names as in the strategy's ``--help``, dashes or underscores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..cli.figures import pyplot, save_figure
from ..cli.flags import OneLineParser
from ..cli.spec import parse_strategy_spec
from ..plan import plan
from ..plan.strategies_spec import parse_spec
from ..train.args import parse_train_args
from ..train.metrics import read_jsonl
from ..train.outputs import COMPARE_OUTPUTS, compare_out_problem, remove_outputs
from ..train.run_job import run_job


def _step_bytes_by_group(run: Path) -> dict[str, dict[str, int]]:
    """Bytes of the committed steps per group, summed over the workers' metrics files of ``run``."""
    totals: dict[str, dict[str, int]] = {}
    for path in run.glob("metrics-rank*.jsonl"):
        for r in read_jsonl(path):
            if "event" in r:  # an evaluation record: bytes_by_group is in step records only
                continue
            for group, v in r["bytes_by_group"].items():
                t = totals.setdefault(group, {"sent": 0, "recv": 0})
                t["sent"] += v["sent"]
                t["recv"] += v["recv"]
    return totals


def eval_curve(records_by_rank: list[list[dict[str, Any]]]) -> list[dict[str, float]]:
    """Rank 0's eval records (the first list) with ``tokens``: the tokens of all workers at that step."""
    tokens: dict[int, int] = {}
    for records in records_by_rank:
        for e in records:
            if e.get("event") == "eval":
                tokens[e["step"]] = tokens.get(e["step"], 0) + e["tokens_total"]
    return [{"step": e["step"], "loss": e["loss"], "time_s": e["time_s"], "tokens": tokens[e["step"]]}
            for e in records_by_rank[0] if e.get("event") == "eval"]


def _eval_curve(run: Path) -> list[dict[str, float]]:
    # by rank number (rank10 after rank9): eval_curve reads rank 0's records first
    paths = sorted(run.glob("metrics-rank*.jsonl"), key=lambda p: int(p.stem.removeprefix("metrics-rank")))
    return eval_curve([read_jsonl(path) for path in paths])


def _micro_batches_per_step(run: Path) -> float:
    """Micro-batches of all workers per committed step."""
    total, steps = 0, set()
    for path in run.glob("metrics-rank*.jsonl"):
        for r in read_jsonl(path):
            if "event" not in r:
                total += r["micro_batches"]
                steps.add(r["step"])
    return total / max(1, len(steps))


def _rows(out: Path, labels: list[str], target_loss: float | None = None) -> list[dict[str, Any]]:
    rows = []
    for label in labels:
        s = json.loads((out / label / "summary.json").read_text())
        world = max(1, s["world_size"])
        curve = _eval_curve(out / label)
        hit = next((e for e in curve if e["loss"] is not None and target_loss is not None and e["loss"] <= target_loss),
                   None)
        # the steps' bytes, as MB sent/step counts them: bytes_sent holds the initial parameter broadcast too
        step_bytes = s["bytes_sent_per_step"] * s["steps"]
        rows.append({
            "label": label, "strategy": s["strategy"], "workers": world, "steps": s["steps"],
            "stopped_by": s.get("stopped_by"),
            "first_eval_loss": s["first_eval_loss"], "last_eval_loss": s["last_eval_loss"],
            "wall_s": s["wall_s"], "tokens": s["tokens"], "tokens_per_s": s["tokens_per_s"],
            "micro_batches_per_step": _micro_batches_per_step(out / label),
            "bytes_sent_per_step": s["bytes_sent_per_step"],
            "mb_sent_per_1k_tokens": step_bytes / max(1, s["tokens"]) * 1000 / 1e6,
            "bytes_sent_outside_steps": round(s["bytes_sent"] - step_bytes),
            "target_loss": target_loss,
            "time_to_target_s": hit["time_s"] if hit else None,
            "tokens_to_target": hit["tokens"] if hit else None,
            "compute_s_per_worker": s["compute_s"] / world, "idle_s_per_worker": s["idle_s"] / world,
            "comm_s_per_worker": s["comm_s"] / world, "compute_fraction": s["compute_fraction"],
            "step_bytes_by_group": _step_bytes_by_group(out / label),
            "eval_curve": curve,
        })
    return rows


def _markdown(rows: list[dict[str, Any]]) -> str:
    target = rows[0]["target_loss"] if rows else None
    head = ("| run | eval loss first → last | stopped by | steps | wall s | tokens | micro-batches/step | tokens/s "
            "| MB sent/step (all workers) | MB sent/1k tokens | compute s/worker | idle s/worker | comm s/worker "
            "| compute-busy |")
    cols = 14
    if target is not None:
        # "loss" named: "time to 7" read as seven seconds
        head += f" s to loss {target:g} | tokens to loss {target:g} |"
        cols += 2
    lines = [head, "|" + "---|" * cols]
    for r in rows:
        line = (
            f"| {r['label']} | {r['first_eval_loss']:.3f} → {r['last_eval_loss']:.3f} | {r['stopped_by']} | "
            f"{r['steps']} | {r['wall_s']:.1f} | "
            f"{r['tokens']:,} | {r['micro_batches_per_step']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['bytes_sent_per_step'] / 1e6:.2f} | {r['mb_sent_per_1k_tokens']:.3f} | "
            f"{r['compute_s_per_worker']:.1f} | "
            f"{r['idle_s_per_worker']:.1f} | {r['comm_s_per_worker']:.1f} | {r['compute_fraction']:.1%} |"
        )
        if target is not None:
            reached = r["time_to_target_s"] is not None
            line += (f" {r['time_to_target_s']:.1f} | {r['tokens_to_target']:,} |" if reached
                     else " not reached | — |")
        lines.append(line)
    outside = [f"{r['label']} {r['bytes_sent_outside_steps'] / 1e6:.3g} MB" for r in rows
               if r.get("bytes_sent_outside_steps")]
    if outside:
        lines += ["", "MB sent: the training steps' bytes (all workers); what was sent outside them — the initial "
                  f"parameter broadcast — is left out ({', '.join(outside)})."]
    # runs stopped by the target trained to it, not to a budget: their tokens are the tokens-to-target column
    tokens = [r["tokens"] for r in rows if r["stopped_by"] != "target_loss"]
    # 1% slack: a token budget ends after the step that reaches it, so equal budgets differ a little
    if len(tokens) > 1 and max(tokens) > 1.01 * min(tokens):
        lines += ["", f"Note: the runs used different token budgets ({', '.join(f'{t:,}' for t in tokens)}): compare "
                  "them at equal tokens (loss vs tokens in compare.png), not at equal steps."]
    return "\n".join(lines) + "\n"


def plot_compare(out: Path, rows: list[dict[str, Any]]) -> Path:
    """Draw ``OUT/compare.png`` (loss vs time, bytes per step by group, compute/idle per worker)."""
    plt = pyplot()

    fig, (ax_loss, ax_tokens, ax_bytes, ax_busy) = plt.subplots(1, 4, figsize=(21, 4.5), constrained_layout=True)
    for r in rows:
        curve = r["eval_curve"]
        (line,) = ax_loss.plot([e["time_s"] for e in curve], [e["loss"] for e in curve], "o-", ms=3, label=r["label"])
        ax_tokens.plot([e["tokens"] for e in curve], [e["loss"] for e in curve], "o-", ms=3, label=r["label"],
                       color=line.get_color())
        predicted = (r.get("predicted") or {}).get("curve")
        if predicted:  # the plan's predicted curve, dashed in the run's colour
            ax_loss.plot([e["time_s"] for e in predicted], [e["loss"] for e in predicted], "--", lw=1,
                         color=line.get_color(), label=f"{r['label']} (predicted)")
            ax_tokens.plot([e["tokens"] for e in predicted], [e["loss"] for e in predicted], "--", lw=1,
                           color=line.get_color())
    ax_loss.set(xlabel="wall-clock seconds (training)", ylabel="held-out loss", title="loss vs time")
    ax_tokens.set(xlabel="tokens (all workers)", ylabel="held-out loss", title="loss vs tokens")
    for ax in (ax_loss, ax_tokens):
        ax.grid(alpha=0.3)
        ax.legend()
        if rows and rows[0]["target_loss"] is not None:
            ax.axhline(rows[0]["target_loss"], color="grey", ls="--", lw=1)
    labels = [r["label"] for r in rows]
    groups = sorted({g for r in rows for g in r["step_bytes_by_group"]})
    bottom = [0.0] * len(rows)
    for g in groups:
        vals = [r["step_bytes_by_group"].get(g, {}).get("sent", 0) / max(1, r["steps"]) / 1e6 for r in rows]
        ax_bytes.bar(labels, vals, bottom=bottom, label=g)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_bytes.set(ylabel="MB sent per step (all workers)", title="bytes per step")
    if groups:
        ax_bytes.legend()
    compute = [r["compute_s_per_worker"] for r in rows]
    idle = [r["idle_s_per_worker"] for r in rows]
    ax_busy.bar(labels, compute, label="compute")
    ax_busy.bar(labels, idle, bottom=compute, label="idle (blocked on comm)")
    for i, r in enumerate(rows):
        ax_busy.text(i, compute[i] + idle[i], f"{r['compute_fraction']:.0%} busy", ha="center", va="bottom")
    ax_busy.set(ylabel="seconds per worker", title="busy time")
    ax_busy.legend()
    for ax in (ax_bytes, ax_busy):
        ax.tick_params(axis="x", rotation=20)
    return save_figure(fig, out, "compare.png")


def compare_main(argv: list[str]) -> int:
    """``quietsync compare --strategies A B ... [job flags]``."""
    parser = OneLineParser(
        prog="quietsync compare",
        description="Run several strategies on the same job (any `quietsync train` job flag) and compare them. "
                    "The budgets (--max-steps, --max-tokens, --max-time-s, --target-loss) go to every run, which "
                    "stops at the first it reaches. An equal token budget is the fair comparison: give --max-tokens "
                    "(and a --max-steps no run reaches first), else strategies that take more micro-batches per "
                    "step see more data.",
        epilog="Job flags are those of `quietsync train --help`; results in OUT/compare.{md,json,png} "
               "(and OUT/timelines.png with --trace).",
    )
    parser.add_argument("--strategies", nargs="+", required=True, metavar="NAME[:FIELD=VALUE,...]",
                        help="strategies to run, e.g. zero1 ddp:accumulation=2")
    parser.add_argument("--out", default="runs/compare", help="output folder (default: runs/compare)")
    parser.add_argument("--target-loss", type=float, default=None, metavar="X",
                        help="stop each run at its first evaluation (every --eval-every steps) with a held-out "
                             "loss <= X, and report its training time and tokens to it")
    parser.add_argument("--predict", action="store_true",
                        help="first predict every run with quietsync plan (the same model, micro-batch, workers and "
                             "links; calibrated here), then print the predictions beside the measurements")
    parser.add_argument("--pilot-tokens", type=int, default=None, metavar="N",
                        help="with --predict and --target-loss: pilot runs of up to N tokens first (quietsync plan "
                             "--pilot-tokens), so each run's time and tokens to the target are predicted too")
    parser.add_argument("--stop-at-target", action=argparse.BooleanOptionalAction, default=True,
                        help="with --target-loss: stop each run there (default); --no-stop-at-target only reports "
                             "the time and tokens to it, the runs go on to their other budgets")
    args, job = parser.parse_known_args(argv)
    # written so that NaN fails too
    if args.target_loss is not None and not (args.target_loss > 0 and args.target_loss < float("inf")):
        parser.error(f"--target-loss must be a finite number > 0, got {args.target_loss}")
    if args.pilot_tokens is not None and (args.pilot_tokens < 1 or not args.predict or args.target_loss is None):
        parser.error(f"--pilot-tokens must be an integer >= 1 given with --predict and --target-loss, got "
                     f"{args.pilot_tokens}" + ("" if args.predict and args.target_loss is not None else
                                               " without them"))
    if "--strategy" in job or "--resume" in job:
        parser.error("--strategy and --resume are set per run by quietsync compare; use --strategies")
    try:
        specs = [parse_strategy_spec(s) for s in args.strategies]
        for spec in args.strategies:  # each spec's knobs against its strategy's config: an error names the spec
            parse_spec(spec)
    except ValueError as e:
        text = str(e)
        parser.error(text if text.startswith("--") else f"--{text}")
    labels = [label for _, label, _ in specs]
    if len(set(labels)) != len(labels):
        parser.error(f"--strategies has duplicate runs: {' '.join(labels)}")
    out = Path(args.out)
    runs = []
    for name, label, flags in specs:  # check every run's flags before starting the first
        run_argv = [*job, "--strategy", name, *flags, "--out", str(out / label)]
        if args.target_loss is not None and args.stop_at_target:
            run_argv += ["--target-loss", repr(args.target_loss)]  # repr: the float reaches the run unchanged
        runs.append((label, parse_train_args(run_argv)))
    problem = compare_out_problem(out, runs[0][1][0].overwrite)  # a job flag: the same in every run
    if problem is not None:
        parser.error(problem)
    plan_config = None
    if args.predict:
        from ..plan.compare_predict import plan_config as make_plan_config

        try:
            plan_config = make_plan_config(runs[0][1], args.strategies, args.target_loss, args.pilot_tokens, out)
        except ValueError as e:
            parser.error(f"--predict: {e}")
    # under torchrun every worker runs compare: one per machine clears the old outputs
    if runs[0][1][0].overwrite and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        remove_outputs(out, COMPARE_OUTPUTS)
    predicted = None
    if plan_config is not None:

        print("== quietsync compare: predicting (quietsync plan)", flush=True)
        predicted = plan(plan_config)
    for label, (cfg, strategy_config, nodes) in runs:
        print(f"== quietsync compare: {label}", flush=True)
        rc = run_job(cfg, strategy_config, nodes, nproc_given="--nproc" in job)
        if rc != 0:
            print(f"quietsync compare: error: run {label} failed (exit {rc})", file=sys.stderr)
            return rc
    # under torchrun every worker ran the runs; rank 0 alone writes the report
    if "RANK" in os.environ and os.environ.get("RANK") != "0":
        return 0
    rows = _rows(out, labels, args.target_loss)
    if predicted is not None:
        from ..plan.compare_predict import predicted_markdown, predictions

        horizon = max((r["tokens"] for r in rows), default=0)
        preds = predictions(predicted, args.strategies, rows[0]["workers"] if rows else 1, horizon)
        for row, spec in zip(rows, args.strategies):
            if spec in preds:
                row["predicted"] = preds[spec]
    (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = _markdown(rows) + (predicted_markdown(rows) if predicted is not None else "")
    (out / "compare.md").write_text(table)
    plot_compare(out, rows)
    if any(cfg.trace for _, (cfg, _, _) in runs):
        from ..train.trace import plot_timelines

        plot_timelines([(r["label"], out / r["label"], r["steps"]) for r in rows], out / "timelines.png")
    print(table, end="")
    timelines = ", timelines.png" if (out / "timelines.png").exists() else ""
    print(f"results in {os.path.abspath(out)} (compare.md, compare.json, compare.png{timelines})")
    return 0
