"""The planner's speed model checked against measured runs: predicted vs measured bytes and step time.

For each setting — a topology (2 workers as 2 nodes; 2 nodes × 2 workers) and a link (emulated by the transport
at about 10, 100 and 1000 Mbit/s; or **really shaped**: two network namespaces joined by a veth pair with
``tc qdisc ... tbf rate 100mbit burst 64kb latency 400ms``, which the transport knows nothing about, so the
planner must measure it with its probe) — the benchmark

1. runs ``quietsync plan`` for the model and micro-batch (calibration and probe in the launched workers), with
   every strategy of the run set as a row;
2. runs ``quietsync train`` for every strategy of the run set, a few steps each;
3. compares, per strategy: bytes per step per group of every worker against the schedule (exact equality),
   step time (predicted vs measured: the mean over the steps after the warm-up), tokens per second.

Recommendations are judged by what a user wants — the measured time to a target loss — in
``benchmarks/bench_time_to_target.py``, on the equal-loss runs; throughput alone does not say which setting
reaches a loss first (a setting that grows its batch with a slow link has the most tokens/s and needs the most
tokens).

It also prints what-if predictions for a 1B-parameter GPT-style model on 4 nodes of 8 GPUs over 100 Gbit and
1 Gbit, with the assumptions.

Speed numbers mean something only on an otherwise idle machine; on a shared one (other jobs on the cores) the
calibration and the runs see different loads. Results: ``benchmarks/results/plan.{json,md}`` (``--quick``:
``plan_quick.*``).

    python benchmarks/bench_plan.py --quick        # 2 workers, one emulated link, 4 strategies, the shaped link
    python benchmarks/bench_plan.py                # everything (long: run it on an idle machine)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import RESULTS, ShapedLink, read_run, run_train, step_stats, write_markdown  # noqa: E402

INTRA = "intra=10gbit,0.05ms"

FULL_SET: list[tuple[str, dict[str, Any]]] = [
    ("ddp", {}), ("zero1", {}), ("fsdp", {}), ("acco", {}), ("dpu", {}), ("wp", {}),
    ("demo", {}), ("demo", {"replicator": "random"}), ("flexdemo", {}),
    ("localsgd", {"sync_every": 4}), ("diloco", {"sync_every": 4}),
    ("diloco", {"sync_every": 4, "fragments": 2, "overlap_delay": 2}), ("cdp", {}),
]
QUICK_SET: list[tuple[str, dict[str, Any]]] = [("zero1", {}), ("acco", {}), ("demo", {}), ("diloco", {"sync_every": 4})]


# ---------------------------------------------------------------------------------------------- one setting
def bytes_exact(records_by_rank: list[list[dict]], name: str, knobs: dict, w: Any, world: int, nodes: int) -> bool:
    """Whether every worker's bytes per step per group equal the schedule's (transfers on a communication
    worker — diloco with overlap_delay — compared as totals; cdp from its second step)."""
    from quietsync.plan.schedules import schedule
    from quietsync.topology import Topology

    for rank, records in enumerate(records_by_rank):
        topo = Topology(rank, world, nodes)
        sched = schedule(name, w, topo, knobs)
        steps = [r for r in records if "event" not in r]
        got = [{g: v for g, v in r["bytes_by_group"].items() if v["sent"] or v["recv"]} for r in steps]
        want = [{g: v for g, v in sched.bytes_at(r["step"], topo).items() if v["sent"] or v["recv"]} for r in steps]
        if name == "cdp":
            got, want = got[1:], want[1:]
        if knobs.get("overlap_delay"):
            # an overlapped sync launched at step s is metered in one of steps s .. s+τ: the running total must lie
            # between the schedule's totals τ steps ago and now, and equal it whenever no sync is in flight
            tau = knobs["overlap_delay"]

            def cum(xs: list[dict], k: int) -> dict:
                return {g: sum(x.get(g, {}).get("sent", 0) for x in xs[:max(0, k)])
                        for g in ("world", "shard", "replicate")}

            launches = [k + 1 for k, x in enumerate(want) if x]
            for k in range(1, len(got) + 1):
                lo, hi, mine = cum(want, k - tau), cum(want, k), cum(got, k)
                if any(not lo[g] <= mine[g] <= hi[g] for g in mine):
                    return False
                if not any(k - tau < s_ <= k for s_ in launches) and mine != hi:
                    return False
        elif got != want:
            return False
    return True


def run_setting(label: str, model: str, mbs: int, seq: int, nproc: int, nodes: int, links: list[str], steps: int,
                run_set: list[tuple[str, dict]], work: Path, shaped: ShapedLink | None) -> dict[str, Any]:
    """Plan, then run every strategy of ``run_set``; compare bytes and step times."""
    import quietsync
    from quietsync.plan.config import PlanConfig
    from quietsync.plan.planner import build_workload

    threads = max(1, (os.cpu_count() or 1) // nproc)  # as the local launcher gives each of nproc workers
    base = ["--model", model, "--micro-batch-size", str(mbs), "--seq-len", str(seq), "--threads", str(threads)]
    specs = [common.spec_of(n, k) for n, k in run_set]
    t0 = time.perf_counter()
    plan_out = work / f"{label}-plan"
    if shaped is None:
        result = quietsync.plan.plan(model=model, micro_batch_size=mbs, seq_len=seq, nproc=nproc, nodes=nodes,
                                     link=links, strategies=specs, threads=threads)
        plan_json = result.to_dict()
        result.save(plan_out, plot=True)
    else:
        shaped.run(["plan", *base, "--strategies", *specs, "--out", str(plan_out), "--no-plot"],
                   nproc // nodes, timeout=900)
        plan_json = json.loads((plan_out / "plan.json").read_text())
    plan_s = time.perf_counter() - t0
    rows = {common.key_of(r["strategy"], r["knobs"]): r for r in plan_json["rows"]}
    runs = list(run_set)
    cfg = PlanConfig(model=model, micro_batch_size=mbs, seq_len=seq, nproc=nproc, nodes=nodes)
    w, _ = build_workload(cfg, real=False)
    measured = []
    for name, knobs in runs:
        period = int(knobs.get("sync_every", 64 if name == "diloco" else 8 if name == "localsgd" else 1))
        run_steps = max(steps, 2 + 2 * period + int(knobs.get("overlap_delay", 0)))  # two whole periods measured
        out = work / f"{label}-{common.key_of(name, knobs).replace(':', '_').replace(',', '_').replace('=', '')}"
        flags = [*base, "--strategy", name, *common.flags_of(knobs), "--max-steps", str(run_steps), "--eval-every", "0",
                 "--overwrite"]
        if shaped is None:
            summary = run_train(out, "--nproc", str(nproc), "--nodes", str(nodes),
                                *[f for link in links for f in ("--link", link)], *flags)
        else:
            shutil.rmtree(out, ignore_errors=True)
            shaped.run(["train", "--out", str(out), "--no-progress", "--no-plot", "--no-export", *flags],
                       nproc // nodes, timeout=1800)
            summary = read_run(out)
        stats = step_stats(summary, skip=2)
        pred = rows.get(common.key_of(name, knobs))
        tokens_per_mb = mbs * seq
        m_tokens_s = stats["micro_batches_per_s"] * nproc * tokens_per_mb
        measured.append({
            "strategy": name, "knobs": knobs, "label": pred["label"] if pred else common.spec_of(name, knobs),
            "predicted_step_s": pred["step_s"] if pred else None, "measured_step_s": stats["step_s"],
            "step_error": (pred["step_s"] / stats["step_s"] - 1) if pred else None,
            # time per token: the step time per token each run really had (adaptive stages vary their batch)
            "token_time_error": (m_tokens_s / pred["tokens_per_s"] - 1) if pred else None,
            "predicted_tokens_per_s": pred["tokens_per_s"] if pred else None, "measured_tokens_per_s": m_tokens_s,
            "predicted_busy": pred["compute_busy"] if pred else None, "measured_busy": stats["busy"],
            "predicted_micro_batches": pred["micro_batches"] if pred else None,
            "measured_micro_batches": stats["micro_batches"] * nproc,
            "bytes_exact": bytes_exact(summary["records"], name, knobs, w, nproc, nodes),
        })
    return {
        "setting": label, "nproc": nproc, "nodes": nodes, "links": links if shaped is None else [shaped.describe()],
        "plan_links": plan_json["cluster"]["links"], "plan_s": plan_s, "diagnosis": plan_json["advice"]["diagnosis"],
        "runs": measured,
    }


def what_if_1b() -> list[dict[str, Any]]:
    """Predictions for a 1B-parameter model on 4 nodes × 8 GPUs over 100 Gbit and 1 Gbit."""
    import quietsync

    out = []
    for inter in ("100gbit,10us", "1gbit,100us"):
        r = quietsync.plan.plan(what_if=True, model="1b", nodes=4, workers_per_node=8, seq_len=2048,
                                micro_batch_size=4, link=[f"inter={inter}", "intra=900gbit,2us"], device_memory="80GB")
        out.append({"inter": inter, "markdown": r.markdown(), "plan": r.to_dict()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 workers, one emulated link, 4 strategies, shaped link")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=None, help="committed steps per run (default 14; quick 8)")
    ap.add_argument("--links", nargs="+", default=None, help="emulated inter links (default 10, 100, 1000 Mbit)")
    ap.add_argument("--shaped", action=argparse.BooleanOptionalAction, default=True,
                    help="also the tc-tbf shaped link between two network namespaces (needs root)")
    ap.add_argument("--name", default=None, help="results name (default plan, or plan_quick)")
    ap.add_argument("--only", nargs="+", default=None, metavar="STRATEGY",
                    help="run only these strategies of the run set (the plan still ranks every strategy)")
    ap.add_argument("--topologies", nargs="+", default=None, metavar="WORKERSxNODES",
                    help="worker x node counts (default 2x2 4x2; quick 2x2)")
    args = ap.parse_args()
    quick = args.quick
    steps = args.steps or (8 if quick else 14)
    links = args.links or (["100mbit,5ms"] if quick else ["10mbit,5ms", "100mbit,5ms", "1000mbit,1ms"])
    if args.topologies:
        try:
            topologies = [tuple(int(x) for x in t.lower().split("x")) for t in args.topologies]
        except ValueError:
            ap.error(f"--topologies takes WORKERSxNODES, e.g. 2x2 4x2, got {' '.join(args.topologies)}")
    else:
        topologies = [(2, 2)] if quick else [(2, 2), (4, 2)]
    run_set = QUICK_SET if quick else FULL_SET
    if args.only:
        run_set = [(n, k) for n, k in run_set if n in args.only]
        if not run_set:
            ap.error(f"--only: none of {' '.join(args.only)} is in the run set")
    name = args.name or ("plan_quick" if quick else "plan")
    settings = []
    load = [os.getloadavg()[0]]  # how shared the machine was (the planner's accuracy needs an idle one)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        work = Path(tmp)
        for nproc, nodes in topologies:
            for link in links:
                link_flags = [f"inter={link}"] + ([INTRA] if nproc > nodes else [])
                rs = [(n, k) for n, k in run_set if n != "flexdemo" or nproc > nodes]
                label = f"{nodes}x{nproc // nodes} inter={link}"
                print(f"== {label}", flush=True)
                settings.append(run_setting(label, args.model, args.micro_batch_size, args.seq_len, nproc, nodes,
                                            link_flags, steps, rs, work, None))
        if args.shaped:
            if os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None:
                print("== shaped link skipped: needs root, ip and tc", flush=True)
            else:
                shaped_sets = topologies
                with ShapedLink() as shaped:
                    for nproc, nodes in shaped_sets:
                        rs = [(n, k) for n, k in run_set if n != "flexdemo" or nproc > nodes]
                        label = f"{nodes}x{nproc // nodes} shaped 100mbit tbf"
                        print(f"== {label}", flush=True)
                        settings.append(run_setting(label, args.model, args.micro_batch_size, args.seq_len, nproc,
                                                    nodes, [], steps, rs, work, shaped))
    what_if = what_if_1b()
    wall = time.perf_counter() - t0
    load.append(os.getloadavg()[0])
    runs = [r for s in settings for r in s["runs"] if r["token_time_error"] is not None]
    errors = [abs(r["token_time_error"]) for r in runs]
    summary = {
        "bytes_exact": all(r["bytes_exact"] for s in settings for r in s["runs"]),
        "median_abs_time_per_token_error": statistics.median(errors) if errors else None,
        "max_abs_time_per_token_error": max(errors) if errors else None,
        "wall_s": wall,
        "load_average_start_end": load,
        "cpu_count": os.cpu_count(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"summary": summary, "settings": settings, "what_if": what_if},
                                                     indent=2, default=str) + "\n")
    table = []
    for s in settings:
        for r in s["runs"]:
            table.append([s["setting"], r["label"], _f(r["predicted_step_s"]), _f(r["measured_step_s"]),
                          _f(r["predicted_micro_batches"]), _f(r["measured_micro_batches"]),
                          _f(r["predicted_tokens_per_s"], 0), _f(r["measured_tokens_per_s"], 0),
                          _pct(r["token_time_error"]),
                          _f(r["predicted_busy"], 2), _f(r["measured_busy"], 2), "✓" if r["bytes_exact"] else "✗"])
    verdicts = "\n".join(f"- {s['setting']}: plan links {s['plan_links']}" for s in settings)
    notes = (f"Model {args.model}, micro-batch {args.micro_batch_size}×{args.seq_len} tokens, {steps} committed "
             f"steps per run (Local SGD and DiLoCo: 2 + two sync periods + τ), the first 2 skipped, "
             + " and ".join(f"{n} workers as {k} nodes" for n, k in topologies)
             + (f" (intra {INTRA})" if any(n > k for n, k in topologies) else "")
             + ". Micro-batches per step: all workers. Time/token error = predicted time per token / "
             "measured − 1 (for fixed-batch strategies the step-time error; ACCO/DPU/WP grow their steps with the "
             "link, so their step times are not comparable). Bytes: every worker's bytes per step per group equal the "
             f"schedule's. Summary: bytes exact {summary['bytes_exact']}, median |time/token error| "
             f"{_pct(summary['median_abs_time_per_token_error'])}, "
             f"max {_pct(summary['max_abs_time_per_token_error'])} (recommendations are judged by time to target "
             "in `time_to_target.md`). "
             f"{wall:.0f} s in all; "
             f"1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, "
             f"on {os.cpu_count()} cores.\n\n"
             f"{verdicts}\n\nWhat-if (1B parameters, 4 nodes × 8 GPUs):\n\n" +
             "\n\n".join(f"### inter {x['inter']}\n\n{x['markdown']}" for x in what_if) +
             f"\n\nReproduce: `python benchmarks/bench_plan.py {' '.join(sys.argv[1:])}` "
             "(root for the shaped link). "
             "Timings from a shared machine are not the planner's accuracy: run it on an idle one.")
    path = write_markdown(name, "quietsync plan: predicted vs measured",
                          ["setting", "strategy", "pred step s", "meas step s", "pred micro-batches/step",
                           "meas micro-batches/step", "pred tokens/s", "meas tokens/s", "time/token error", "pred busy",
                           "meas busy", "bytes exact"], table, notes)
    print(path.read_text())


def _f(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "—"
    return f"{v:,.{digits}f}" if digits == 0 else f"{v:.{digits}g}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:+.0%}" if v is not None and v < 0 else f"{v:.0%}"


if __name__ == "__main__":
    main()
