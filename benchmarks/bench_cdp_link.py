"""Cyclic DP vs DDP and ZeRO-1 on an emulated slow link: step time, idle time, and whether the ring's transfers
hide behind compute (paper 002's communication claim, a timeline per run).

All three run ``quietsync train`` on the same job: W workers as W nodes (every transfer crosses the emulated
``inter`` link), one core each (``--threads 1``; W = 2 on this 2-core machine), the tiny GPT, one micro-batch of
8×128 tokens per worker per committed step (CDP with W stages: W micro-batches per step, one per worker), the
same steps. DDP and ZeRO-1 send the gradient in a burst at the end of the backward; CDP sends each stage's
partial sums point to point while the other stages compute.

Two links: ``balanced`` — the bandwidth at which one DDP all-reduce of the gradient takes one micro-batch's
compute (measured first), where overlap can at best halve the step; and ``slow`` (default 50 Mbit/s), where the
transfer is several times the compute and nothing can hide it. Reported per committed step, averaged over
workers (first 2 steps skipped): wall seconds, main-thread idle seconds, MB sent, the time those bytes take
alone on the link (``transfer``), how much of it the main thread waited (``exposed`` = idle ÷ transfer: 0 when
the transfers hide behind compute), and from each run's trace the time per step with a transfer in flight.

    python benchmarks/bench_cdp_link.py [--steps 12] [--workers 2] [--slow inter=50mbit,5ms]

Writes ``benchmarks/results/cdp_link.{md,json}`` and the timelines ``cdp_link-<link>-<strategy>.png``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from common import RESULTS, run_train, step_stats, write_markdown

from quietsync.train.trace import plot_timeline


def _union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def wire_time(trace: Path, steps: int) -> float:
    """Seconds per step during which a worker had a transfer on the (emulated) wire, in or out: the union of its
    collectives' ``on wire`` slices in the merged trace, mean over workers."""
    events = json.loads(trace.read_text())["traceEvents"]
    opened: dict[tuple[int, Any], float] = {}
    per_rank: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("name") != "on wire":
            continue
        key = (e["pid"], e.get("id"))
        if e["ph"] == "b":
            opened[key] = e["ts"]
        elif e["ph"] == "e" and key in opened:
            per_rank.setdefault(e["pid"], []).append((opened.pop(key), e["ts"]))
    times = [_union_length(spans) / 1e6 / steps for spans in per_rank.values()]
    return sum(times) / max(1, len(times))


def _bits_per_s(link: str) -> float:
    value = re.search(r"=([0-9.]+)\s*([kmg]?)bit", link.lower())
    if value is None:
        raise ValueError(f"cannot read a bandwidth from {link!r}")
    return float(value.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[value.group(2)]


def calibrate(tmp: Path, workers: int) -> tuple[float, int]:
    """(seconds of one micro-batch's compute on ``workers`` one-thread workers, bytes of the fp32 gradient)."""
    s = run_train(tmp / "calibrate", "--strategy", "ddp", "--nproc", str(workers), "--max-steps", "6",
                  "--model", "tiny", "--eval-every", "0", "--eval-windows", "4", "--threads", "1")
    steps = [r for r in s["records"][0] if "event" not in r][2:]
    return sum(r["compute_s"] for r in steps) / sum(r["micro_batches"] for r in steps), 4 * s["parameters"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workers", type=int, default=2, help="workers = nodes = CDP stages, one core each")
    ap.add_argument("--slow", default="inter=50mbit,5ms", help="the slow link (--link syntax)")
    ap.add_argument("--multiples", type=float, nargs="+", default=[1.0, 4.0],
                    help="links at these multiples of the balanced bandwidth")
    args = ap.parse_args()
    n = args.workers
    jobs = {"ddp": ["--strategy", "ddp"], "zero1": ["--strategy", "zero1"],
            "cdp v2": ["--strategy", "cdp", "--rule", "v2", "--stages", str(n)]}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        compute_s, grad_bytes = calibrate(tmp, n)
        balanced_bits = 8 * 2 * (n - 1) / n * grad_bytes / compute_s
        links = {("balanced" if m == 1 else f"{m:g}x balanced"): f"inter={m * balanced_bits / 1e6:.0f}mbit,1ms"
                 for m in args.multiples}
        links["slow"] = args.slow
        print(f"micro-batch {compute_s:.3f} s, gradient {grad_bytes / 1e6:.2f} MB -> balanced {links['balanced']}",
              flush=True)
        for name, link in links.items():
            for label, flags in jobs.items():
                out = tmp / f"{name}-{label.replace(' ', '_')}"
                summary = run_train(out, *flags, "--nproc", str(n), "--model", "tiny", "--threads", "1",
                                    "--max-steps", str(args.steps), "--link", link, "--eval-every", "0",
                                    "--eval-windows", "4", "--trace")
                stats = step_stats(summary)
                stats["wire_s"] = wire_time(out / "trace.json", args.steps)
                stats["transfer_s"] = stats["bytes_sent"] * 8 / _bits_per_s(link)  # one worker's bytes, alone
                stats["exposed"] = stats["idle_s"] / stats["transfer_s"]
                results[f"{name} {label}"] = {"link_name": name, "strategy": label, "link": link, **stats}
                timeline = plot_timeline(out, args.steps, title=f"{label}, {n} workers, {link}")
                if timeline is not None:
                    stem = f"cdp_link-{name.replace(' ', '_')}-{label.replace(' ', '_')}.png"
                    shutil.copy(timeline, RESULTS / stem)
                print(name, label, results[f"{name} {label}"], flush=True)
    rows = []
    for s in results.values():
        base = results[f"{s['link_name']} ddp"]["step_s"]
        rows.append([f"{s['link_name']} ({s['link']})", s["strategy"], s["step_s"], s["step_s"] / base, s["idle_s"],
                     s["transfer_s"], s["exposed"], s["wire_s"], s["bytes_sent"] / 1e6, s["busy"]])
    path = write_markdown(
        "cdp_link", f"Cyclic DP vs DDP / ZeRO-1 — {n} workers with a core each, tiny GPT, emulated links",
        ["link", "strategy", "step s", "step time / ddp", "idle s / step", "transfer s / step (bytes ÷ bandwidth)",
         "exposed: idle ÷ transfer", "s / step with a transfer in flight", "MB sent / worker / step",
         "compute-busy"],
        rows,
        notes=(f"{args.steps} steps (first 2 skipped), one 8×128 micro-batch per worker per step, "
               f"micro-batch compute {compute_s:.3f} s, gradient {grad_bytes / 1e6:.2f} MB. `balanced`: one "
               "DDP all-reduce ≈ one micro-batch of compute. Timelines: `cdp_link-<link>-<strategy>.png`. "
               f"Reproduce: `python benchmarks/bench_cdp_link.py --steps {args.steps} --workers {n} "
               f"--slow {args.slow} --multiples {' '.join(f'{m:g}' for m in args.multiples)}`."),
    )
    (RESULTS / "cdp_link.json").write_text(json.dumps({"compute_s": compute_s, "grad_bytes": grad_bytes,
                                                        "results": results}, indent=2))
    print(path.read_text())


if __name__ == "__main__":
    main()
