"""The planner judged by what a user wants: the measured time to a target loss (issue 27's goals).

The test set is the equal-loss benchmark (``benchmarks/bench_equal_loss.py`` → ``results/equal_loss.json``): every
setting of the planner's grid (and more) run to the same target held-out loss on each link, with its measured
training time to the target (evaluations subtracted), tokens and bytes. This benchmark does not re-run those: for
each link it

1. runs ``quietsync plan`` on the same job — model, 2 workers as 2 nodes with one torch thread each, micro-batch,
   AdamW lr and warm-up then constant lr, the link — with ``--target-loss`` (the equal-loss target) and
   ``--pilot-tokens N``, so its pilots really run and what they cost is measured (each plan alone on an otherwise
   idle machine, or under ``--wrap``); the shaped link is first probed from inside its two network
   namespaces (``quietsync plan`` there, no pilots) and the plan is then made with the α-β link the probe fitted
   (pilots launch local workers: not under the namespaces' torchrun-style ranks);
2. joins the plan's rows to the equal-loss records by setting (specs normalized by
   :func:`quietsync.plan.candidates.parse_candidate`);
3. judges (the goals): the recommended setting's measured time to target is the measured fastest's or within 10%
   (among every measured setting, and among the planner's grid); time to target predicted within 25% of measured
   (median) and none off by 2× (a setting predicted not to reach the target that reached it counts as off by more
   than 2×; one whose runs stopped at the equal-loss runs' caps without reaching it is measured as "at least the
   training seconds it ran" — a time cap counts wall seconds, evaluations included, so that is less than the cap —
   a prediction past that agrees with it, one short of it is off by at least that / predicted; a setting not run on
   a link, its bytes alone needing longer than the cap, is measured as at least the cap; a run carried on past the
   caps by ``bench_equal_loss_extend.py``, ``results/equal_loss_extended.json``, replaces its capped run's bound
   with what it measured); the pilots cost less than
   running the candidates to the target (the ratio), and at most 20% of the recommended setting's measured time to
   target wherever that is 5 minutes or more.

Writes ``results/time_to_target.{json,md}`` (``--quick``: ``time_to_target_quick.*`` from
``equal_loss_quick.json``).

    python benchmarks/bench_time_to_target.py --pilot-tokens 1000000          # every link of equal_loss.json
    python benchmarks/bench_time_to_target.py --quick --pilot-tokens 200000   # the quick equal-loss set
    python benchmarks/bench_time_to_target.py --pilot-tokens 400000 --work W --reuse  # W's plans, newer records
    python benchmarks/bench_time_to_target.py --pilot-tokens 400000 --work W --reuse-pilots  # new plans, W's pilots

``--reuse-pilots`` plans again (``quietsync plan --reuse-pilots``): a pilot the new plan asks for that ran to its
end in ``W`` with the same job and strategy flags is replayed (its recorded curve, its measured cost) and the
others run; pilots of plans made before pilots were recorded (``pilot.json``) are recorded first from that plan's
``plan.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ShapedLink, write_markdown  # noqa: E402

WITHIN = 0.10
"""A recommendation is right when its measured time to target is within 10% of the measured fastest's."""
MEDIAN_ERROR = 0.25
FIVE_MIN = 300.0


def norm(strategy: str, knobs: dict[str, Any]) -> str:
    from quietsync.plan.candidates import candidate

    return candidate(strategy, knobs).spec


def measured_by_setting(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Normalized spec → the equal-loss record of one link (mean over seeds; reached only if every seed did)."""
    out = {}
    for rec in results.values():
        spec = norm(rec["strategy"], rec["knobs"])
        t = rec.get("time_to_target_s")
        out[spec] = {"reached": bool(t), "time_s": t["mean"] if t else None,
                     "tokens": rec["tokens_to_target"]["mean"] if rec.get("tokens_to_target") else None,
                     "seeds": len(rec.get("seeds", [])), "equal_loss_spec": rec["spec"], **ran_without(rec)}
    return out


def with_extended(measured: dict[str, dict[str, Any]], link: str) -> dict[str, dict[str, Any]]:
    """``measured`` with the runs ``bench_equal_loss_extend.py`` carried on past the caps
    (``results/equal_loss_extended.json``) for settings whose one capped run did not reach the target: reached, its
    time and tokens; else a longer lower bound. Marked ``extended``."""
    from quietsync.plan.candidates import parse_candidate

    path = RESULTS / "equal_loss_extended.json"
    if not path.exists():
        return measured
    for run in json.loads(path.read_text())["runs"].values():
        if run["link"] != link:
            continue
        m = measured.get(parse_candidate(run["spec"]).spec)
        if m is None or m["reached"] or m["seeds"] != 1:
            continue
        if run["reached"]:
            m.update(reached=True, time_s=run["time_to_target_s"], tokens=run["tokens_to_target"], ran_s=None,
                     ran_tokens=None, extended=True)
        else:
            m.update(ran_s=run["train_time_s"], ran_tokens=run["tokens"], extended=True)
    return measured


def ran_without(rec: dict[str, Any]) -> dict[str, Any]:
    """For a setting that did not reach the target on every seed: what its runs show the time to target is at least
    — each seed's training seconds and tokens to the target where it got there, else where it stopped (a time or
    token cap) — as ``ran_s``/``ran_tokens`` (means over seeds); None where a seed was not run (skipped)."""
    if rec.get("time_to_target_s"):
        return {"ran_s": None, "ran_tokens": None}
    runs = rec.get("runs_detail") or []
    secs = [r.get("time_to_target_s") if r.get("reached") else r.get("train_time_s") for r in runs]
    toks = [r.get("tokens_to_target") if r.get("reached") else r.get("tokens") for r in runs]
    if not runs or any(v is None for v in secs + toks):
        return {"ran_s": None, "ran_tokens": None}
    return {"ran_s": statistics.fmean(secs), "ran_tokens": statistics.fmean(toks)}


def record_pilots(folder: Path) -> int:
    """Write ``pilot.json`` (what ``quietsync plan --reuse-pilots`` replays) into the pilot folders of the plan in
    ``folder`` from its ``plan.json``, for pilots that ran to their end and have none; returns how many."""
    from quietsync.plan.pilots import RECORD, ProcessRunner

    plan = folder / "plan.json"
    if not plan.exists():
        return 0
    runner = ProcessRunner([], [], folder / "pilots", None, lambda c: 1.0, lambda c: False)
    from quietsync.plan.candidates import parse_candidate

    n = 0
    for spec, curve in json.loads(plan.read_text()).get("pilots", {}).items():
        out = runner.folder(parse_candidate(spec))
        if curve.get("stopped") in ("budget", "target") and (out / "summary.json").exists() \
                and not (out / RECORD).exists():
            (out / RECORD).write_text(json.dumps(curve) + "\n")
            n += 1
    return n


def plan_argv(job: dict[str, Any], link: str | None, target: float, pilot_tokens: int, out: Path) -> list[str]:
    train = ["--lr", repr(job["lr"]), "--warmup-steps", str(job["warmup_steps"]), "--min-lr-ratio", "1.0",
             "--max-steps", "1000000", "--eval-windows", str(job["eval_windows"]), "--eval-every", "0"]
    argv = ["plan", "--model", job["model"], "--nproc", str(job["workers"]), "--nodes", str(job["workers"]),
            "--micro-batch-size", str(job["micro_batch_size"]), "--seq-len", str(job["seq_len"]),
            "--vocab-size", str(job["vocab_size"]), "--threads", "1", "--target-loss", repr(target),
            "--pilot-tokens", str(pilot_tokens), "--train-args", shlex.join(train), "--out", str(out), "--no-plot"]
    if link is not None:
        argv += ["--link", f"inter={link}"]
    return argv


def probe_shaped(job: dict[str, Any], work: Path) -> str:
    """The shaped link as ``quietsync plan``'s probe measures it from inside the namespaces: ``BW,LATENCY``."""
    out = work / "shaped-probe"
    with ShapedLink() as shaped:
        shaped.run(["plan", "--model", job["model"], "--micro-batch-size", str(job["micro_batch_size"]),
                    "--seq-len", str(job["seq_len"]), "--vocab-size", str(job["vocab_size"]), "--threads", "1",
                    "--only", "--strategies", "zero1", "--out", str(out), "--no-plot"], 1, timeout=900)
    fit = json.loads((out / "plan.json").read_text())["probe"]["fits"]["inter"]
    return f"{fit['bandwidth'] * 8 / 1e6:.6g}mbit,{fit['latency'] * 1e3:.6g}ms"


def run_plan(argv: list[str], wrap: list[str], timeout: float) -> float:
    """``quietsync plan ARGV`` in a child process under ``wrap`` (a command prefix); returns its wall seconds."""
    t0 = time.perf_counter()
    subprocess.run([*wrap, sys.executable, "-m", "quietsync", *argv], check=True, timeout=timeout)
    return time.perf_counter() - t0


def judge(plan: dict[str, Any], measured: dict[str, dict[str, Any]], grid: set[str],
          caps: tuple[float, float] = (math.inf, math.inf)) -> dict[str, Any]:
    """The goals on one link. ``caps``: the equal-loss runs' time (s) and token caps — a run that did not reach the
    target within them took longer (or more tokens): a prediction past a cap agrees with it, one short of the time
    cap is too fast by at least cap / predicted."""
    rows = {r["spec"]: r for r in plan["rows"]}
    rec = plan["advice"]["recommendations"][0]["spec"] if plan["advice"]["recommendations"] else None
    reached = {s: m for s, m in measured.items() if m["reached"]}
    fastest = min(reached, key=lambda s: reached[s]["time_s"]) if reached else None
    fastest_grid = min((s for s in reached if s in grid), key=lambda s: reached[s]["time_s"], default=None)
    rec_time = reached[rec]["time_s"] if rec in reached else None

    def within(best: str | None) -> bool:
        return rec_time is not None and best is not None and rec_time <= (1 + WITHIN) * reached[best]["time_s"]

    pairs = []
    for spec, row in rows.items():
        m = measured.get(spec)
        if m is None:
            continue
        sec = row.get("seconds") or {}
        pred = sec.get("value") if sec else None
        pred = None if pred is None or not math.isfinite(pred) else pred
        tokens = ((row.get("estimate") or {}).get("tokens") or {}).get("value")
        beyond = False  # predicted to reach the target only past the caps the measured run had
        if pred is None and not m["reached"]:
            ratio = 1.0  # both say: not reached
        elif not m["reached"]:
            # measured: at least the training seconds (tokens) its runs made without reaching it, or — a setting
            # not run on this link (skipped: its bytes alone need longer) — at least the caps
            floor_s = m.get("ran_s") or caps[0]
            floor_tokens = m.get("ran_tokens") or caps[1]
            beyond = pred >= floor_s or (tokens is not None and tokens >= floor_tokens)
            ratio = 1.0 if beyond else pred / floor_s  # too fast by at least this
        elif pred is None:
            ratio = math.inf  # predicted not to reach the target, measured reaching it
        else:
            ratio = pred / m["time_s"]
        pairs.append({"spec": spec, "predicted_s": pred, "measured_s": m["time_s"], "ratio": ratio,
                      "measured_at_least_s": None if m["reached"] else (m.get("ran_s") or caps[0]),
                      "extended": bool(m.get("extended")),
                      "predicted_low_s": sec.get("low"), "predicted_high_s": sec.get("high"),
                      "source": (row.get("estimate") or {}).get("source"), "beyond_caps": beyond,
                      "inside_interval": (pred is not None and m["reached"]
                                          and sec["low"] <= m["time_s"] <= sec["high"])})
    errors = [abs(math.log(p["ratio"])) if math.isfinite(p["ratio"]) else math.inf for p in pairs
              if p["predicted_s"] is not None and p["measured_s"] is not None]
    off2 = [p for p in pairs if not (0.5 <= p["ratio"] <= 2.0)]
    pilots = plan.get("pilots", {})
    pilot_s = sum(c["wall_s"] for c in pilots.values()) + ((plan.get("noise_scale") or {}).get("seconds") or 0.0)
    runs_s = sum(m["time_s"] for s, m in reached.items() if s in rows)
    return {
        "recommended": rec, "recommended_measured_s": rec_time, "recommended_run": rec in measured,
        "fastest": fastest, "fastest_s": reached[fastest]["time_s"] if fastest else None,
        "fastest_in_grid": fastest_grid,
        "recommended_ok": within(fastest), "recommended_ok_in_grid": within(fastest_grid),
        "pairs": pairs, "median_abs_error": math.expm1(statistics.median(errors)) if errors else None,
        "off_by_2x": [p["spec"] for p in off2],
        "pilot_s": pilot_s, "runs_to_target_s": runs_s,
        "pilot_over_runs": pilot_s / runs_s if runs_s else None,
        "pilot_over_recommended": pilot_s / rec_time if rec_time else None,
        "twenty_percent_applies": bool(rec_time and rec_time >= FIVE_MIN),
        "pilot_report": plan.get("pilot_report", []),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="judge against equal_loss_quick.json")
    ap.add_argument("--pilot-tokens", type=int, required=True, help="--pilot-tokens of every plan")
    ap.add_argument("--links", nargs="+", default=None, help="links of equal_loss.json to plan (default: all)")
    ap.add_argument("--wrap", default="",
                    help="command prefix each plan runs under, e.g. 'taskset -c 0,1' (default: none; run the "
                         "benchmark on an otherwise idle machine)")
    ap.add_argument("--work", default=None, help="folder for the plans (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true",
                    help="judge the plans already in --work against the current equal-loss records (no new plan)")
    ap.add_argument("--reuse-pilots", action="store_true",
                    help="plan again, replaying the pilots in --work that the new plans ask for unchanged")
    args = ap.parse_args()
    if args.reuse and args.reuse_pilots:
        ap.error("--reuse judges the plans in --work as they are; --reuse-pilots makes new ones: not both")
    source = RESULTS / ("equal_loss_quick.json" if args.quick else "equal_loss.json")
    if not source.exists():
        ap.error(f"{source} is missing: run benchmarks/bench_equal_loss.py first")
    data = json.loads(source.read_text())
    job = data["job"]
    links = args.links or list(data["results"])
    missing = [x for x in links if x not in data["results"]]
    if missing:
        ap.error(f"--links {' '.join(missing)}: not in {source.name} (its links: {', '.join(data['results'])})")
    wrap = shlex.split(args.wrap)
    from quietsync.plan.candidates import grid as canonical
    from quietsync.plan.candidates import parse_candidate

    grid = {parse_candidate(s).spec for s in canonical()}
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-ttt-"))
    out: dict[str, Any] = {"source": str(source.relative_to(RESULTS.parent.parent)), "job": job,
                           "pilot_tokens": args.pilot_tokens, "links": {}, "command": " ".join(sys.argv)}
    t0 = time.perf_counter()
    for link in links:
        spec_link = data["links"].get(link)
        folder = work / f"plan-{link}"
        if args.reuse and (folder / "plan.json").exists():
            old = json.loads((folder / "verdict.json").read_text()) if (folder / "verdict.json").exists() else {}
            plan_s, plan_link = old.get("plan_s"), old.get("plan_link")
        else:
            shaped = spec_link is None or str(spec_link).startswith("tc ")
            old = json.loads((folder / "verdict.json").read_text()) if (folder / "verdict.json").exists() else {}
            if args.reuse_pilots and old.get("plan_link"):
                plan_link = old["plan_link"]  # the link the pilots ran through (a shaped link's earlier probe)
            else:
                plan_link = probe_shaped(job, work) if shaped else spec_link
            argv = plan_argv(job, plan_link, job["target"], args.pilot_tokens, folder)
            if args.reuse_pilots:
                print(f"== {link}: {record_pilots(folder)} pilots recorded from the earlier plan.json", flush=True)
                argv.append("--reuse-pilots")
            print(f"== {link}: quietsync plan --link inter={plan_link}", flush=True)
            plan_s = run_plan(argv, wrap, 7200)
            (folder / "verdict.json").write_text(json.dumps({"plan_s": plan_s, "plan_link": plan_link}))
        plan = json.loads((folder / "plan.json").read_text())
        verdict = judge(plan, with_extended(measured_by_setting(data["results"][link]), link), grid,
                        (float(job.get("time_s", math.inf)), float(job.get("tokens", math.inf))))
        verdict.update(plan_s=plan_s, plan_link=plan_link, load=os.getloadavg()[0])
        out["links"][link] = verdict
        print(json.dumps({k: v for k, v in verdict.items() if k not in ("pairs", "pilot_report")}, default=str),
              flush=True)
    v = list(out["links"].values())
    errs = [p for x in v for p in x["pairs"] if p["predicted_s"] is not None and p["measured_s"] is not None]
    med = statistics.median(abs(math.log(p["ratio"])) for p in errs) if errs else None
    out["summary"] = {
        "recommended_ok": sum(x["recommended_ok"] for x in v), "recommended_ok_in_grid":
            sum(x["recommended_ok_in_grid"] for x in v), "links": len(v),
        "recommended_not_run": [link for link, x in out["links"].items() if not x.get("recommended_run", True)],
        "median_abs_error": math.expm1(med) if med is not None else None, "measured_pairs": len(errs),
        "off_by_2x": sum(len(x["off_by_2x"]) for x in v), "pairs": sum(len(x["pairs"]) for x in v),
        "pilot_over_runs": [x["pilot_over_runs"] for x in v],
        "pilot_over_recommended_where_5min": [x["pilot_over_recommended"] for x in v if x["twenty_percent_applies"]],
        "wall_s": time.perf_counter() - t0,
    }
    name = "time_to_target_quick" if args.quick else "time_to_target"
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    write_report(name, out)


def _measured(p: dict[str, Any]) -> str:
    past = " (run on past the caps)" if p.get("extended") else ""
    if p["measured_s"] is None and p.get("measured_at_least_s") is not None:
        return f"≥ {_s(p['measured_at_least_s'])}{past}"
    return _s(p["measured_s"]) + past


def _s(v: float | None) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{v:.3g}"


def write_report(name: str, out: dict[str, Any]) -> Path:
    s = out["summary"]
    table = []
    for link, x in out["links"].items():
        run = x.get("recommended_run", True)  # a pick the equal-loss runs have no record of is not judged

        def mark(ok: bool, run: bool = run) -> str:
            return ("✓" if ok else "✗") if run else "not run"

        table.append([link, f"`{x['recommended']}`", _s(x["recommended_measured_s"]), f"`{x['fastest']}`",
                      _s(x["fastest_s"]), mark(x["recommended_ok"]), mark(x["recommended_ok_in_grid"]),
                      f"{x['median_abs_error']:.0%}" if x["median_abs_error"] is not None else "—",
                      len(x["off_by_2x"]), f"{x['pilot_s']:.0f}",
                      f"{x['pilot_over_runs']:.2f}" if x["pilot_over_runs"] else "—",
                      f"{x['pilot_over_recommended']:.2f}" if x["pilot_over_recommended"] else "—"])
    pairs = "\n".join(
        f"- {link}: " + "; ".join(f"`{p['spec']}` {_s(p['predicted_s'])} / {_measured(p)} s"
                                  f" ({p['source']})" for p in sorted(x["pairs"], key=lambda p: p["spec"]))
        for link, x in out["links"].items())
    bounds = [f"`{p['spec']}` at {link} ({_s(p['predicted_s'])} s predicted, ≥ {_s(p['measured_at_least_s'])} s: "
              + ("agrees with the bound" if 0.5 <= p["ratio"] <= 2.0 else "off by 2× even against it") + ")"
              for link, x in out["links"].items() for p in x["pairs"]
              if p.get("measured_at_least_s") is not None and p["predicted_s"] is not None]
    notes = (f"Plans of the equal-loss job ({out['source']}: model `{out['job']['model']}`, target "
             f"{out['job']['target']:g}) with `--pilot-tokens {out['pilot_tokens']:,}`. Recommended right (within "
             f"{WITHIN:.0%} of the measured fastest to target) on {s['recommended_ok']} of {s['links']} links "
             f"({s['recommended_ok_in_grid']} among the planner's grid)"
             + (f"; the pick at {', '.join(s['recommended_not_run'])} has no equal-loss run yet (not judged)"
                if s.get("recommended_not_run") else "") + "; time to target predicted within "
             f"{s['median_abs_error']:.0%} (median |error|) over the {s.get('measured_pairs', s['pairs'])} settings "
             f"with a measured time (of {s['pairs']} judged), {s['off_by_2x']} off by 2× or "
             f"more (including reached/not-reached disagreements)."
             + (f" Judged against a lower bound only — their runs stopped at a cap (600 s of wall time, evaluations "
                f"included, or 8 M tokens) without reaching the target, so the measured time is at least the "
                f"training seconds they ran (≥ below): {'; '.join(bounds)}." if bounds else "")
             + f" Pilots over running the candidates to the target: "
             f"{', '.join(f'{r:.2f}' for r in s['pilot_over_runs'] if r)}; over the recommended setting's time where "
             f"that is ≥ 5 min: {', '.join(f'{r:.2f}' for r in s['pilot_over_recommended_where_5min']) or 'none'}."
             f"\n\nPredicted / measured time to target (s) per setting:\n\n{pairs}\n\nReproduce: "
             f"`python {out['command']}`.") if s["median_abs_error"] is not None else "no pairs"
    return write_markdown(name, "quietsync plan: recommendations and time to target against the equal-loss runs",
                          ["link", "recommended", "its measured s", "measured fastest", "fastest s", "rec ok",
                           "rec ok (grid)", "median |err|", "off 2×", "pilot s", "pilots / runs", "pilots / rec"],
                          table, notes)


if __name__ == "__main__":
    main()
