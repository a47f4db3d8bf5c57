"""ddp vs zero1 on 4 workers under an emulated slow inter-node link (issue 2's baseline benchmark).

Both run the same job (default GPT-Neo, embedded corpus, same seed and steps) with each of the 4 local
workers standing for its own node, so every collective crosses the emulated ``inter`` link. Reported per
committed step: median step time, bytes sent per worker, compute-busy fraction (compute seconds / wall
seconds), and the time the main thread sat idle waiting for the network. Runs are interleaved and
repeated so machine noise hits both alike; the ratio zero1/ddp is the result.

    python benchmarks/bench_baselines.py [--steps 12] [--repeats 2] [--link inter=100mbit,5ms]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import RESULTS, run_train, step_stats, write_markdown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--link", default="inter=100mbit,5ms")
    ap.add_argument("--model", default="default")
    ap.add_argument("--nproc", type=int, default=4)
    args = ap.parse_args()
    strategies = ["ddp", "zero1"]
    runs: dict[str, list[dict]] = {s: [] for s in strategies}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for s in strategies:
                summary = run_train(Path(tmp) / f"{s}-{rep}", "--strategy", s, "--nproc", str(args.nproc),
                                    "--max-steps", str(args.steps), "--model", args.model, "--link", args.link,
                                    "--eval-every", "0", "--eval-windows", "4")
                runs[s].append(step_stats(summary))
                print(s, rep, runs[s][-1], flush=True)
    agg = {s: {k: statistics.mean(r[k] for r in runs[s]) for k in runs[s][0]} for s in strategies}
    rows = [[s, agg[s]["step_s"], agg[s]["step_s"] / agg["ddp"]["step_s"], agg[s]["bytes_sent"] / 1e6,
             agg[s]["busy"], agg[s]["idle_s"], agg[s]["comm_s"]] for s in strategies]
    path = write_markdown(
        "baselines", f"ddp vs zero1 — {args.nproc} workers, emulated {args.link}, model {args.model}",
        ["strategy", "step s (mean)", "step time / ddp", "MB sent / worker / step", "compute-busy fraction",
         "idle s / step", "comm s / step"], rows,
        notes=(f"{args.repeats} interleaved repeats x {args.steps} steps (first 2 skipped) on a 2-core CPU "
               "machine; 4 gloo workers share the cores, so compute per step is inflated. Reproduce: "
               f"`python benchmarks/bench_baselines.py --steps {args.steps} --repeats {args.repeats}`."),
    )
    (RESULTS / "baselines.json").write_text(json.dumps(agg, indent=2))
    print(path.read_text())


if __name__ == "__main__":
    main()
