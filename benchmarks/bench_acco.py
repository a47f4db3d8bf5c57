"""ACCO, DPU and WP benchmarks (issue 3): hiding, training dynamics, wall clock to a fixed loss.

Every job is a real ``quietsync train`` run (4 local gloo workers, each its own "node", so every collective
crosses the emulated ``inter`` link; the tiny GPT-Neo preset on the embedded corpus). Ratios are measured
side by side in one invocation, never absolute times as targets.

1. ``hiding``   — zero1 vs ddp vs acco at a link where zero1's communication takes 1–2x its compute:
                  compute-busy fraction, micro-batches/s, bytes per committed step.
2. ``dynamics`` — paper 003 Sec. 4.3 in miniature: ddp vs dpu (no / few / many non-delayed warm-up steps)
                  vs wp vs acco, deterministic accumulation so every run sees the same tokens; held-out and
                  training loss against tokens.
3. ``wallclock`` — time to a fixed held-out loss, acco vs zero1 under the slow link, then again with one
                  worker 4x slower (paper Fig. 9 / App. C).

    python benchmarks/bench_acco.py [--part hiding|dynamics|wallclock|all]

Writes ``results/acco_<part>.md`` / ``.json`` / ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from common import RESULTS, run_train, step_stats, write_markdown

NPROC = 4
BASE = ["--nproc", str(NPROC), "--model", "tiny", "--seed", "0"]


def _plot(path: Path, draw) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- 1. hiding
def hiding(tmp: Path, args: argparse.Namespace) -> None:
    link = args.link
    runs = {"zero1": [], "ddp": [], "acco": []}
    summaries = {}
    for rep in range(args.repeats):
        for name in runs:
            s = run_train(tmp / f"hiding-{name}-{rep}", *BASE, "--strategy", name, "--max-steps", str(args.steps),
                          "--link", link, "--eval-every", "0", "--eval-windows", "4")
            stats = step_stats(s)
            stats["bytes_per_step"] = s["bytes_sent_per_step"] / NPROC
            runs[name].append(stats)
            summaries[name] = s
            print("hiding", name, rep, stats, flush=True)
    agg = {n: {k: statistics.mean(r[k] for r in v) for k in v[0]} for n, v in runs.items()}
    z = agg["zero1"]
    zero1_compute = z["busy"] * z["step_s"]
    comm_over_compute = z["idle_s"] / zero1_compute
    rows = []
    for n, a in agg.items():
        rows.append([n, a["busy"], a["micro_batches_per_s"], a["micro_batches_per_s"] / z["micro_batches_per_s"],
                     a["micro_batches"], a["step_s"], a["idle_s"], a["bytes_per_step"] / 1e6])
    path = write_markdown(
        "acco_hiding", f"Hiding communication — {NPROC} workers, emulated {link}, tiny model",
        ["strategy", "compute-busy fraction", "micro-batches/s (per worker)", "vs zero1",
         "micro-batches / step (per worker)", "step s", "idle s / step", "MB sent / worker / step"], rows,
        notes=(f"zero1's blocking communication (idle time) is {comm_over_compute:.2f}x its compute per step at "
               f"this link. {args.repeats} repeat(s) x {args.steps} steps, first 2 skipped; 4 workers share 2 "
               "CPU cores. ACCO sends twice ZeRO-1's bytes per committed step (two reduce-scatters and two "
               "all-gathers) but its committed step holds more micro-batches. Reproduce: "
               f"`python benchmarks/bench_acco.py --part hiding --steps {args.steps} --link {link}`."),
    )
    (RESULTS / "acco_hiding.json").write_text(json.dumps({"link": link, "agg": agg,
                                                          "zero1_comm_over_compute": comm_over_compute}, indent=2))

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
        names = list(agg)
        axes[0].bar(names, [agg[n]["busy"] for n in names], color=["#888", "#aaa", "#c60"])
        axes[0].set_ylim(0, 1.05)
        axes[0].set_title("compute-busy fraction")
        axes[1].bar(names, [agg[n]["micro_batches_per_s"] for n in names], color=["#888", "#aaa", "#c60"])
        axes[1].set_title("micro-batches / s / worker")
        fig.suptitle(f"{NPROC} workers, {link}")
        return fig

    _plot(RESULTS / "acco_hiding.png", draw)
    print(path.read_text())


# --------------------------------------------------------------------------------------------- 2. dynamics
def dynamics(tmp: Path, args: argparse.Namespace) -> None:
    steps = args.dyn_steps
    few, many = max(1, steps // 20), max(2, steps // 4)
    common = [*BASE, "--max-steps", str(steps), "--micro-batch-size", "4", "--seq-len", "64",
              "--eval-every", str(max(1, steps // 20)), "--eval-windows", "16", "--lr", str(args.lr)]
    # 2 micro-batches per worker per committed step for everyone: same tokens at the same step
    configs = {
        "ddp": ["--strategy", "ddp", "--accumulation", "2"],
        "dpu (no warm-up)": ["--strategy", "dpu", "--deterministic-accumulation", "2"],
        f"dpu ({few} warm-up)": ["--strategy", "dpu", "--deterministic-accumulation", "2",
                                 "--sync-warmup-steps", str(few)],
        f"dpu ({many} warm-up)": ["--strategy", "dpu", "--deterministic-accumulation", "2",
                                  "--sync-warmup-steps", str(many)],
        "wp": ["--strategy", "wp", "--deterministic-accumulation", "2"],
        "acco": ["--strategy", "acco", "--deterministic-accumulation", "1"],
    }
    curves: dict[str, dict[str, Any]] = {}
    for label, flags in configs.items():
        s = run_train(tmp / f"dyn-{len(curves)}", *common, *flags)
        rec0 = s["records"][0]
        evals = [r for r in rec0 if r.get("event") == "eval"]
        train = [r for r in rec0 if "event" not in r]
        by_step: dict[int, list[float]] = {}
        for rank in s["records"]:
            for r in rank:
                if "event" not in r:
                    by_step.setdefault(r["step"], []).append(r["loss"])
        curves[label] = {
            "eval_tokens": [r["tokens_total"] * NPROC for r in evals],
            "eval_loss": [r["loss"] for r in evals],
            "train_tokens": [r["tokens_total"] * NPROC for r in train],
            "train_loss": [statistics.mean(by_step[r["step"]]) for r in train],
            "tokens": s["tokens"],
        }
        print("dynamics", label, curves[label]["eval_loss"][-1], flush=True)
    ref = curves["ddp"]
    rows = []
    for label, c in curves.items():
        gap = [a - b for a, b in zip(c["eval_loss"], ref["eval_loss"])]
        rows.append([label, c["tokens"], c["eval_loss"][-1], c["eval_loss"][-1] - ref["eval_loss"][-1],
                     max(gap), statistics.mean(gap[1:]) if len(gap) > 1 else 0.0])
    path = write_markdown(
        "acco_dynamics",
        f"Training dynamics — {NPROC} workers, {steps} steps, same tokens (paper 003 Sec. 4.3 in miniature)",
        ["run", "tokens", "final held-out loss", "final - ddp", "max gap to ddp (over evals)",
         "mean gap to ddp"], rows,
        notes=(f"Tiny GPT-Neo on the embedded corpus, AdamW lr {args.lr} with the trainer's warm-up + cosine "
               "schedule, 2 micro-batches of 4x64 tokens per worker per committed step for every run (ACCO: 1 "
               "per stage), deterministic accumulation, no emulated link (the dynamics do not depend on it). "
               "Gap = held-out loss minus ddp's at the same evaluation. Reproduce: "
               f"`python benchmarks/bench_acco.py --part dynamics --dyn-steps {steps}`."),
    )
    (RESULTS / "acco_dynamics.json").write_text(json.dumps(curves, indent=2))

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for label, c in curves.items():
            axes[0].plot(c["eval_tokens"], c["eval_loss"], marker=".", label=label)
            axes[1].plot(c["train_tokens"], c["train_loss"], lw=0.8, label=label)
        axes[0].set_title("held-out loss (committed θ)")
        axes[1].set_title("training loss (mean over workers)")
        for ax in axes:
            ax.set_xlabel("tokens")
            ax.set_ylabel("loss")
        axes[0].legend(fontsize=7)
        return fig

    _plot(RESULTS / "acco_dynamics.png", draw)
    print(path.read_text())


# --------------------------------------------------------------------------------------------- 3. wall clock
def _time_to(evals: list[dict], target: float) -> tuple[float | None, int | None]:
    for r in evals:
        if r["loss"] <= target:
            return r["time_s"], r["tokens_total"] * NPROC
    return None, None


def wallclock(tmp: Path, args: argparse.Namespace) -> None:
    link = args.link
    settings = {"homogeneous": [], "one worker 4x slower": ["--slow-worker", f"{NPROC - 1}:4"]}
    out: dict[str, Any] = {}
    rows = []
    for setting, extra in settings.items():
        evals = {}
        for name in ("zero1", "acco"):
            s = run_train(tmp / f"wall-{name}-{len(out)}", *BASE, "--strategy", name,
                          "--max-steps", str(args.wall_steps), "--link", link, "--eval-every", "5",
                          "--eval-windows", "8", *extra)
            evals[name] = [r for r in s["records"][0] if r.get("event") == "eval"]
            out[f"{setting}/{name}"] = {"evals": evals[name], "wall_s": s["wall_s"],
                                        "step": step_stats(s)}
            print("wallclock", setting, name, s["wall_s"], evals[name][-1]["loss"], flush=True)
        target = max(min(r["loss"] for r in evals["zero1"]), min(r["loss"] for r in evals["acco"]))
        tz, kz = _time_to(evals["zero1"], target)
        ta, ka = _time_to(evals["acco"], target)
        out[f"{setting}/target"] = target
        rows.append([setting, target, tz, ta, (tz / ta) if tz and ta else None, kz, ka,
                     out[f"{setting}/zero1"]["step"]["busy"], out[f"{setting}/acco"]["step"]["busy"]])
    path = write_markdown(
        "acco_wallclock", f"Wall clock to a fixed held-out loss — acco vs zero1, {NPROC} workers, emulated {link}",
        ["setting", "target held-out loss", "zero1 s", "acco s", "speed-up (zero1 s / acco s)",
         "zero1 tokens", "acco tokens", "zero1 busy", "acco busy"], rows,
        notes=(f"Both run {args.wall_steps} committed steps with the same schedule; the target is the lowest "
               "held-out loss both reach; time is the training loop's clock at the first evaluation at or below "
               "it (evaluation every 5 steps, so times are quantised to 5 steps). The slow worker sleeps 3x its "
               "measured compute after every micro-batch (paper App. C). Reproduce: "
               f"`python benchmarks/bench_acco.py --part wallclock --wall-steps {args.wall_steps}`."),
    )
    (RESULTS / "acco_wallclock.json").write_text(json.dumps(out, indent=2))

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
        for ax, setting in zip(axes, settings):
            for name in ("zero1", "acco"):
                ev = out[f"{setting}/{name}"]["evals"]
                ax.plot([r["time_s"] for r in ev], [r["loss"] for r in ev], marker=".", label=name)
            ax.axhline(out[f"{setting}/target"], color="k", lw=0.6, ls="--")
            ax.set_title(setting)
            ax.set_xlabel("seconds")
        axes[0].set_ylabel("held-out loss")
        axes[0].legend()
        return fig

    _plot(RESULTS / "acco_wallclock.png", draw)
    print(path.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["hiding", "dynamics", "wallclock", "all"], default="all")
    ap.add_argument("--link", default="inter=50mbit,5ms")
    ap.add_argument("--steps", type=int, default=10, help="steps of the hiding runs")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dyn-steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wall-steps", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for part, fn in (("hiding", hiding), ("dynamics", dynamics), ("wallclock", wallclock)):
            if args.part in (part, "all"):
                fn(Path(tmp), args)


if __name__ == "__main__":
    main()
