"""``--adapt`` against the best static setting the plan picks at the start, on a link that drops and on a steady one.

Issue 42's goal: a link that drops from 100 to 10 Mbit/s for the middle third of the run -- ``diloco --adapt``
reaches the target loss at least 1.3x sooner than the best static setting the plan picks at the start, and on a
steady link costs at most 5%.

**``--objective time_to_target``** (the default; ``results/adapt_plan.{md,json}``). The static setting is the
plan's own pick at the start: ``quietsync plan`` on the start link (``--link inter=100mbit --no-probe``, 2 workers
as 2 nodes, one thread each, the arms' micro-batch and sequence length), ranking ``--only`` DiLoCo at
``H = --sync-every × 1, 2, 4, 8, 16`` by predicted time to ``--target-loss``, with pilots of ``--pilot-tokens``
(``--train-args`` the arms' own flags at seed ``--plan-seed``); the row of least predicted time is the static H.
The adapt arms start from it with ``--adapt --adapt-objective time_to_target``, the candidates the rows the plan
predicts to reach the target and ``--adapt-tokens`` each row's predicted tokens to the target (over the least):
the controller minimizes the plan's objective on the link it measures. Per seed (``--seeds``, none of them the
plan's), four arms, every other seed in the other order: ``static steady`` / ``adapt steady`` on a steady
100 Mbit/s link, ``static drop`` / ``adapt drop`` on ``100mbit@0s,10mbit@T/3,100mbit@2T/3``. Beside each drop
pair, the **ceiling** of any adapt there: the static arm's steps per second outside the drop over inside it, ``f``,
gives ``3 / (2 + 1/f)`` -- the ratio an adapt that kept the fast link's speed and loss per token through the drop
would reach when the target is the static run's end (the last third runs at the same speed in both).

    python benchmarks/bench_adapt.py --sync-every 4 --seconds 75 --seeds 1,2,3,4 --target-loss 5.2  # adapt_plan.*
    python benchmarks/bench_adapt.py --sync-every 8 --seconds 75 --seeds 1,2 --target-loss 5.2 \
        --pilot-tokens 262144 --results adapt_plan_h8                                            # adapt_plan_h8.*

**``--objective overhead``** (``results/adapt.{md,json}``, ``adapt_H_bits.*``): the controller's overhead rule
against the H that same rule picks first on the steady link. Arms (2 workers, one per node, one torch thread each,
tiny model, the same seed; every arm runs for the same training seconds ``T`` and evaluates the committed model
every ``--eval-every`` steps):

1. ``adapt steady``: ``--adapt`` from ``--sync-every`` on a steady 100 Mbit/s link. The first H it moves to (or
   the starting one if it keeps it) is the **static** setting of the arms below: the H the cost model's rule
   picks for this link and this machine's measured step (the plan at the start, for this knob).
2. ``static steady``: that H, fixed, on the steady link.
3. ``static drop``: that H, fixed, on ``100mbit@0s,10mbit@T/3,100mbit@2T/3``.
4. ``adapt drop``: ``--adapt`` on the same schedule.
5. ``static drop, adapt's largest H``: the largest H ``adapt drop`` took, fixed from the start (is adapting better
   than just picking the low-bandwidth setting throughout?).

The target is the lowest eval loss every arm of a pair reaches (the pair's equal-loss target); time to target is
the training seconds of the first evaluation at or under it. Ratios are side by side in one run; absolute seconds
move with the machine's load (``uptime`` is recorded).

``--real-link`` runs the drop arms on a real link instead of the emulation: two network namespaces joined by a
veth pair shaped by ``tc tbf`` (needs root), whose rate the benchmark changes mid-run (``tc qdisc change``)
``T/3`` and ``2T/3`` after training started (the run's first metrics record appeared).

    python benchmarks/bench_adapt.py --objective overhead --seconds 150              # results/adapt.{md,json}
    python benchmarks/bench_adapt.py --objective overhead --seconds 150 --real-link  # the drop under tc, adapt_tc.*
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY_MAIN, RESULTS, ShapedLink, read_run, run_train, write_markdown  # noqa: E402


def job_flags(args: argparse.Namespace, seconds: float) -> list[str]:
    return ["--strategy", "diloco", "--model", "tiny", "--nproc", "2", "--threads", "1", "--seed", str(args.seed),
            "--micro-batch-size", str(args.micro_batch_size), "--seq-len", str(args.seq_len),
            "--max-time-s", f"{seconds:g}", "--max-steps", str(args.max_steps), "--warmup-steps", "20",
            "--eval-every", str(args.eval_every), "--eval-windows", "24", "--overwrite"]


def drop_link(seconds: float) -> str:
    return f"inter=100mbit@0s,10mbit@{seconds / 3:.1f}s,100mbit@{2 * seconds / 3:.1f}s"


def arm_table(runs: list[dict[str, Any]], seconds: float) -> list[str]:
    """Markdown lines of each arm's steps, idle seconds (all, the middle third), median step compute and MB sent."""
    lines = ["", "", "| arm | steps | idle s (all) | idle s (middle third) | median step compute s | MB sent |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        c = costs(r, seconds)
        lines.append(f"| {r['name']} | {c['steps']} | {c['idle_s']:.1f} | {c['idle_middle_third_s']:.1f} | "
                     f"{c['median_step_compute_s']:.3f} | {c['mb_sent']:.1f} |")
    return lines


def evals(run: dict[str, Any]) -> list[tuple[float, float, int]]:
    """``(training seconds, eval loss, step)`` of rank 0's evaluations."""
    return [(r["time_s"], r["loss"], r["step"]) for r in run["records"][0] if r.get("event") == "eval"]


def changes(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r["extra"]["adapt"] for r in run["records"][0] if isinstance(r.get("extra"), dict)
            and "adapt" in r["extra"]]


def costs(run: dict[str, Any], seconds: float) -> dict[str, float]:
    """Rank 0's load-robust numbers: seconds idle on the network in all and in the drop's window (the middle third of
    the training seconds), the median step's compute seconds, MB sent."""
    steps = [r for r in run["records"][0] if "event" not in r]
    window = [r for r in steps if seconds / 3 <= r["time_s"] < 2 * seconds / 3]
    return {"steps": len(steps), "idle_s": sum(r["idle_s"] for r in steps),
            "idle_middle_third_s": sum(r["idle_s"] for r in window),
            "median_step_compute_s": statistics.median(r["compute_s"] for r in steps) if steps else 0.0,
            "mb_sent": sum(r["bytes_sent"] for r in steps) / 1e6}


def time_to(run: dict[str, Any], target: float) -> float | None:
    return next((t for t, loss, _ in evals(run) if loss <= target), None)


def arm(work: Path, name: str, flags: list[str], real: tuple[ShapedLink, list[tuple[float, str]]] | None = None,
        reuse: bool = False) -> dict[str, Any]:
    out = work / name.replace(" ", "_").replace(",", "").replace("'", "").replace("#", "")
    t0 = time.perf_counter()
    if reuse and (out / "summary.json").exists():  # an arm an earlier run of this command finished
        run = read_run(out)
    elif real is None:
        run = run_train(out, *flags)
    else:
        shaped, schedule = real
        i = flags.index("--nproc")  # one worker per namespace, torchrun-style: no local workers
        metrics = out / "metrics-rank0.jsonl"  # its first record (the step-0 evaluation): training has started
        made = shaped.run(["train", "--out", str(out), "--no-progress", "--no-plot", "--no-export",
                           *flags[:i], *flags[i + 2:]], 1, timeout=1800, rate_schedule=schedule,
                          started=lambda: metrics.exists() and metrics.stat().st_size > 0)
        run = read_run(out)
        run["tc_changes"] = made
    run["process_s"] = time.perf_counter() - t0
    run["name"], run["flags"] = name, flags
    print(f"  {name}: {run['steps']} steps, last eval {evals(run)[-1][1]:.4f}, changes "
          f"{[(c['step'], c['old'], c['new']) for c in changes(run)]}", flush=True)
    return run


def pair(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Equal-loss target of two arms and their times to it; ``ratio`` = a's time / b's."""
    target = max(min(loss for _, loss, _ in evals(a)), min(loss for _, loss, _ in evals(b)))
    ta, tb = time_to(a, target), time_to(b, target)
    return {"a": a["name"], "b": b["name"], "target": target, "a_s": ta, "b_s": tb,
            "ratio": ta / tb if ta and tb else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=150.0, help="training seconds of every arm (T)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sync-every", type=int, default=16, help="H the adapt arms start from")
    ap.add_argument("--max-steps", type=int, default=2000, help="the lr schedule's length (runs stop by time)")
    ap.add_argument("--eval-every", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--real-link", action="store_true", help="the drop arms on a tc-shaped veth link (root)")
    ap.add_argument("--static-sync-every", type=int, default=None,
                    help="skip the steady arms and use this static H (e.g. an earlier run's)")
    ap.add_argument("--adapt-knobs", default="H", help="what the adapt arms re-pick: H, bits or H,bits")
    ap.add_argument("--work", default=None)
    ap.add_argument("--repeats", type=int, default=1, help="drop (and steady) pairs, each other one in reverse order")
    ap.add_argument("--reuse", action="store_true",
                    help="read the arms an earlier run left in --work instead of running them again")
    ap.add_argument("--objective", choices=("time_to_target", "overhead"), default="time_to_target",
                    help="time_to_target: static = the plan's pick (module docstring); overhead: the rule's own")
    ap.add_argument("--seeds", default="1,2", help="time_to_target: the arms' seeds, comma-separated")
    ap.add_argument("--plan-seed", type=int, default=0, help="time_to_target: the plan's pilots' seed")
    ap.add_argument("--target-loss", type=float, default=5.4, help="time_to_target: the plan's target")
    ap.add_argument("--pilot-tokens", type=int, default=131072, help="time_to_target: the plan's pilot budget")
    ap.add_argument("--results", default="adapt_plan", help="time_to_target: results/NAME.{md,json}")
    args = ap.parse_args()
    if args.objective == "time_to_target":
        overhead_only = [f for f, on in (("--real-link", args.real_link), ("--static-sync-every",
                         args.static_sync_every is not None), ("--adapt-knobs", args.adapt_knobs != "H"),
                         ("--repeats", args.repeats != 1)) if on]
        if overhead_only:
            ap.error(f"{overhead_only[0]} is a flag of --objective overhead (time_to_target: --seeds, the plan's H)")
        return main_plan(args)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_adapt_"))
    T = args.seconds
    base = job_flags(args, T)
    adapt = ["--adapt", "--sync-every", str(args.sync_every), "--adapt-knobs", args.adapt_knobs]
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    print(f"work {work}; {uptime[0]}", flush=True)

    def named(what: str, i: int) -> str:
        return what if i == 0 else f"{what} #{i + 1}"

    steadies: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (adapt, static) per repeat
    if args.static_sync_every is None:
        first = arm(work, "adapt steady", [*base, *adapt, "--link", "inter=100mbit"], reuse=args.reuse)
        picks = changes(first)
        h_static, static = args.sync_every, ["--sync-every", str(args.sync_every)]
        if picks:  # the first pick: H, a dtype, or "H/dtype" (adapt_knobs H,bits)
            knob, new = picks[0]["knob"], str(picks[0]["new"])
            h_part, _, dtype = new.partition("/") if "/" in new else (
                (str(args.sync_every), "", new) if knob == "pseudo_grad_dtype" else (new, "", ""))
            h_static = int(h_part)
            static = ["--sync-every", h_part] + (["--pseudo-grad-dtype", dtype] if dtype else [])
        steadies.append((first, arm(work, "static steady", [*base, *static, "--link", "inter=100mbit"],
                                    reuse=args.reuse)))
    else:  # the steady pair of an earlier run stands: only the drop arms
        h_static = args.static_sync_every
        static = ["--sync-every", str(h_static)]
    real = None
    if args.real_link:
        schedule = [(0.0, "100mbit"), (T / 3, "10mbit"), (2 * T / 3, "100mbit")]  # from training's start
        shaped = ShapedLink().__enter__()
        real = (shaped, schedule)
        drop = []
    else:
        drop = ["--link", drop_link(T)]
    drops: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (static, adapt) per repeat
    try:
        for i in range(args.repeats):
            # every other repeat runs the pair in the other order (a load that drifts falls on both)
            order = [("static drop", static), ("adapt drop", adapt)][:: 1 if i % 2 == 0 else -1]
            got = {what: arm(work, named(what, i), [*base, *knobs, *drop], real, reuse=args.reuse)
                   for what, knobs in order}
            drops.append((got["static drop"], got["adapt drop"]))
            if i == 0:
                adapt_drop = got["adapt drop"]
                # a change of H and bits logs "H/dtype": the H part (the largest-H arm keeps the static dtype)
                h_large = max([int(str(c["new"]).split("/")[0]) for c in changes(adapt_drop)
                               if c["knob"] != "pseudo_grad_dtype"] or [h_static])
                large_drop = arm(work, "static drop, adapt's largest H",
                                 [*base, "--sync-every", str(h_large), *drop], real, reuse=args.reuse)
            if i > 0 and args.static_sync_every is None:
                order = [("static steady", static), ("adapt steady", adapt)][:: 1 if i % 2 == 1 else -1]
                got = {what: arm(work, named(what, i), [*base, *knobs, "--link", "inter=100mbit"],
                                 reuse=args.reuse) for what, knobs in order}
                steadies.append((got["adapt steady"], got["static steady"]))
    finally:
        if real is not None:
            real[0].__exit__()
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())

    runs = [r for pr in steadies for r in pr] + [r for pr in drops for r in pr] + [large_drop]
    drop_pairs = [pair(a, b) for a, b in drops]
    steady_pairs = [pair(a, b) for a, b in steadies]
    large_pair = pair(large_drop, adapt_drop)

    def median_ratio(pairs: list[dict[str, Any]]) -> float | None:
        ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
        return statistics.median(ratios) if ratios else None

    name = ("adapt_tc" if args.real_link else "adapt") + ("" if args.adapt_knobs == "H" else "_"
                                                          + args.adapt_knobs.replace(",", "_"))
    link = "tc tbf on a veth pair, 100 -> 10 -> 100 Mbit/s" if args.real_link else drop_link(T)
    result = {
        "goal": "static/adapt time to target >= 1.3 on the drop; adapt/static <= 1.05 on the steady link",
        "adapt_knobs": args.adapt_knobs,
        "seconds": T, "seed": args.seed, "repeats": args.repeats, "static_sync_every": h_static,
        "largest_adapted_sync_every": h_large, "drop_link": link, "uptime": uptime,
        "drop": drop_pairs, "drop_median_ratio": median_ratio(drop_pairs),
        "steady": steady_pairs, "steady_median_ratio": median_ratio(steady_pairs),
        "drop_vs_largest_static": large_pair,
        "runs": [{"name": r["name"], "flags": r["flags"], "steps": r["steps"], "wall_s": r["wall_s"],
                  "setup_s": r["setup_s"], "evals": evals(r), "changes": changes(r), **costs(r, T),
                  "tc_changes": r.get("tc_changes")} for r in runs],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    cmd = "python benchmarks/bench_adapt.py " + " ".join(sys.argv[1:])
    rows = []
    for pairs, what in ((drop_pairs, "drop: static / adapt"), (steady_pairs, "steady: adapt / static"),
                        ([large_pair], "drop: static largest H / adapt")):
        for p in pairs:
            rows.append([what, p["a"], p["b"], f"{p['target']:.4f}", p["a_s"], p["b_s"], p["ratio"]])
        if len(pairs) > 1:
            rows.append([what + ", median", "", "", "", "", "", median_ratio(pairs)])
    changes_text = "; ".join(f"step {c['step']}: H {c['old']}→{c['new']} ({c['why']})"
                             for c in changes(adapt_drop))
    notes = (f"Command: `{cmd}`. Seed {args.seed}; 2 workers (one per node), tiny model, T = {T:g} training "
             f"seconds per arm. Static H = {h_static} (the first H adapt moved to on the steady link, from "
             f"{args.sync_every}); drop link: {link}. "
             f"adapt on the drop changed: {changes_text or 'nothing'}. Load: {uptime[0]} / {uptime[-1]}.")
    per_arm = arm_table(runs, T)
    write_markdown(name, "diloco --adapt against the static H picked at the start",
                   ["pair", "a", "b", "target loss", "a s", "b s", "a / b"], rows, notes + "\n".join(per_arm))
    print(json.dumps({k: result[k] for k in ("drop_median_ratio", "steady_median_ratio", "drop", "steady",
                                             "drop_vs_largest_static")}, indent=1))


def thirds(run: dict[str, Any], seconds: float) -> float:
    """Rank 0's steps per second outside the middle third of the training seconds over inside it (``f``)."""
    times = [r["time_s"] for r in run["records"][0] if "event" not in r]
    mid = sum(1 for t in times if seconds / 3 <= t < 2 * seconds / 3)
    out = sum(1 for t in times if t < seconds / 3 or 2 * seconds / 3 <= t < seconds)
    return (out / 2) / mid if mid else float("inf")


def plan_at_start(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``quietsync plan`` on the start link for DiLoCo at each H of the chain (module docstring); its rows as
    ``{H: (predicted seconds, predicted tokens, source)}``, the pick and the command."""
    from quietsync.plan.strategies_spec import parse_spec
    from quietsync.strategies.registry import strategy_config

    chain = [args.sync_every * 2 ** k for k in range(5)]
    train_args = (f"--seed {args.plan_seed} --max-steps {args.max_steps} --warmup-steps 20 --eval-windows 24")
    flags = ["plan", "--model", "tiny", "--nproc", "2", "--nodes", "2", "--threads", "1", "--micro-batch-size",
             str(args.micro_batch_size), "--seq-len", str(args.seq_len), "--link", "inter=100mbit", "--no-probe",
             "--only", "--strategies", *[f"diloco:sync_every={h}" for h in chain], "--target-loss",
             f"{args.target_loss:g}", "--pilot-tokens", str(args.pilot_tokens), "--train-args", train_args,
             "--out", str(work / "plan"), "--no-plot"]
    path = work / "plan" / "plan.json"
    if not (args.reuse and path.exists()):
        proc = subprocess.run([sys.executable, "-c", PY_MAIN, *flags], capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"the plan failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = {}
    for r in json.loads(path.read_text())["rows"]:
        name, knobs = parse_spec(r["spec"])
        if name == "diloco" and r.get("seconds"):
            rows[int(strategy_config(name, knobs).sync_every)] = (
                float(r["seconds"]["value"]), float(r["estimate"]["tokens"]["value"]), r["estimate"]["source"])
    pick = min(rows, key=lambda h: rows[h][0])
    command = "quietsync " + " ".join(f"'{f}'" if " " in f else f for f in flags[:-3])
    return {"rows": rows, "pick": pick, "command": command}


def main_plan(args: argparse.Namespace) -> None:
    """The time_to_target flow (module docstring)."""
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_adapt_"))
    work.mkdir(parents=True, exist_ok=True)
    T = args.seconds
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    earlier = RESULTS / f"{args.results}.json"
    if args.reuse and earlier.exists():  # the arms read back ran under the load an earlier invocation recorded
        uptime = json.loads(earlier.read_text()).get("uptime", []) + uptime
    print(f"work {work}; {uptime[-1]}", flush=True)
    plan = plan_at_start(args, work)
    rows, h_static = plan["rows"], plan["pick"]
    reach = sorted(h for h, (sec, tok, _) in rows.items() if tok < float("inf") and sec < float("inf"))
    least = min(rows[h][1] for h in reach)
    tokens = ",".join(f"{h}:{rows[h][1] / least:.4g}" for h in reach)
    print(f"  plan: static H = {h_static}; adapt tokens {tokens}", flush=True)
    static = ["--sync-every", str(h_static)]
    adapt = ["--adapt", "--sync-every", str(h_static), "--adapt-sync-every", ",".join(map(str, reach)),
             "--adapt-objective", "time_to_target", "--adapt-tokens", tokens]
    seeds = [int(x) for x in args.seeds.split(",")]
    pairs: dict[str, list[dict[str, Any]]] = {"drop": [], "steady": []}
    runs = []
    for i, seed in enumerate(seeds):
        args.seed = seed
        base = job_flags(args, T)
        for link, label in (([drop_link(T)], "drop"), (["inter=100mbit"], "steady")):
            order = [("static", static), ("adapt", adapt)][:: 1 if i % 2 == 0 else -1]
            got = {what: arm(work, f"{what} {label} seed {seed}", [*base, *knobs, "--link", *link],
                             reuse=args.reuse) for what, knobs in order}
            runs += list(got.values())
            p = pair(got["static"], got["adapt"]) if label == "drop" else pair(got["adapt"], got["static"])
            p["seed"] = seed
            if label == "drop":
                f = thirds(got["static"], T)
                p["static_f"], p["ceiling"] = f, 3 / (2 + 1 / f)
                p["adapt_f"] = thirds(got["adapt"], T)
            pairs[label].append(p)
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())

    def median(label: str) -> float | None:
        r = [p["ratio"] for p in pairs[label] if p["ratio"] is not None]
        return statistics.median(r) if r else None

    result = {"goal": "static/adapt time to target >= 1.3 on the drop; adapt/static <= 1.05 on the steady link",
              "seconds": T, "seeds": seeds, "plan_seed": args.plan_seed, "plan_command": plan["command"],
              "plan_rows": {str(h): {"seconds": v[0], "tokens": v[1], "source": v[2]} for h, v in rows.items()},
              "static_sync_every": h_static, "adapt_flags": adapt, "drop_link": drop_link(T), "uptime": uptime,
              "drop": pairs["drop"], "drop_median_ratio": median("drop"),
              "steady": pairs["steady"], "steady_median_ratio": median("steady"),
              "runs": [{"name": r["name"], "flags": r["flags"], "steps": r["steps"], "wall_s": r["wall_s"],
                        "evals": evals(r), "changes": changes(r), **costs(r, T)} for r in runs]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.results}.json").write_text(json.dumps(result, indent=1) + "\n")
    table = []
    for label, what in (("drop", "drop: static / adapt"), ("steady", "steady: adapt / static")):
        for p in pairs[label]:
            table.append([what, p["seed"], f"{p['target']:.4f}", p["a_s"], p["b_s"], p["ratio"],
                          p.get("static_f", ""), p.get("ceiling", "")])
        table.append([what + ", median", "", "", "", "", median(label), "", ""])
    plan_rows = "; ".join(f"H = {h}: {rows[h][0]:.3g} s, {rows[h][1]:,.0f} tokens ({rows[h][2]})"
                          for h in sorted(rows))
    changes_text = " / ".join(
        f"{r['name']}: " + (", ".join(f"step {c['step']} H {c['old']}→{c['new']} ({c['why']})" for c in changes(r))
                            or "no change") for r in runs if r["name"].startswith("adapt"))
    argv = sys.argv[1:]
    if "--work" in argv:  # the folder is this machine's: W
        argv[argv.index("--work") + 1] = "W"
    cmd = "python benchmarks/bench_adapt.py " + " ".join(argv)
    notes = (f"Command: `{cmd}`. 2 workers (one per node, one torch thread each), tiny model, T = {T:g} training "
             f"seconds per arm, seeds {args.seeds}; drop link {drop_link(T)}.\n\n"
             f"The plan at the start (`{plan['command']}`, pilots at seed {args.plan_seed}), predicted time and "
             f"tokens to {args.target_loss:g}: {plan_rows}. Static H = {h_static} (the least predicted time); adapt: "
             f"`{' '.join(adapt)}`.\n\n"
             "f = the static drop arm's steps/s outside the drop over inside it; ceiling = 3 / (2 + 1/f), what an "
             "adapt that lost nothing in the drop would reach against a target at the static run's end.\n\n"
             f"Changes: {changes_text}.\n\nLoad (`uptime`, 2 cores shared with other jobs; each invocation's start and "
             f"end): {' / '.join(uptime)}.")
    per_arm = arm_table(runs, T)
    write_markdown(args.results, "diloco --adapt (time to target) against the plan's static pick at the start",
                   ["pair", "seed", "target loss", "a s", "b s", "a / b", "f", "ceiling"], table,
                   notes + "\n".join(per_arm))
    print(json.dumps({k: result[k] for k in ("drop_median_ratio", "steady_median_ratio", "drop", "steady")},
                     indent=1, default=str))


if __name__ == "__main__":
    main()
