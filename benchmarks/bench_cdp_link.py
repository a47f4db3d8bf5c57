"""Cyclic DP vs DDP and ZeRO-1 on an emulated slow link: step time and idle time at an equal batch (issue 9).

All three run ``quietsync train`` on the same job: 4 workers as 4 nodes (every transfer crosses the emulated
``inter`` link), the tiny GPT, one micro-batch of 8×128 tokens per worker per committed step (CDP with 4
stages: 4 micro-batches per step, one per worker), same steps. DDP and ZeRO-1 send the gradient in one burst
at the end of the step; CDP sends each stage's partial sums point to point during the step. Reported per
committed step, averaged over workers (first 2 steps skipped): wall seconds, main-thread idle seconds, MB sent.

    python benchmarks/bench_cdp_link.py [--steps 10] [--link inter=50mbit,5ms]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import RESULTS, run_train, step_stats, write_markdown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--link", default="inter=50mbit,5ms")
    args = ap.parse_args()
    jobs = {"ddp": ["--strategy", "ddp"], "zero1": ["--strategy", "zero1"],
            "cdp v2": ["--strategy", "cdp", "--rule", "v2", "--stages", "4"]}
    stats = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, flags in jobs.items():
            summary = run_train(Path(tmp) / label.replace(" ", "_"), *flags, "--nproc", "4", "--model", "tiny",
                                "--max-steps", str(args.steps), "--link", args.link, "--eval-every", "0",
                                "--eval-windows", "4")
            stats[label] = step_stats(summary)
            print(label, stats[label], flush=True)
    base = stats["ddp"]["step_s"]
    rows = [[label, s["step_s"], s["step_s"] / base, s["idle_s"], s["bytes_sent"] / 1e6, s["busy"]]
            for label, s in stats.items()]
    path = write_markdown(
        "cdp_link", f"Cyclic DP vs DDP / ZeRO-1 — 4 workers, tiny GPT, emulated {args.link}",
        ["strategy", "step s", "step time / ddp", "idle s / step", "MB sent / worker / step", "compute-busy"],
        rows,
        notes=(f"{args.steps} steps (first 2 skipped), one 8×128 micro-batch per worker per step; 4 gloo workers "
               "share 2 CPU cores. Reproduce: "
               f"`python benchmarks/bench_cdp_link.py --steps {args.steps} --link {args.link}`."),
    )
    (RESULTS / "cdp_link.json").write_text(json.dumps(stats, indent=2))
    print(path.read_text())


if __name__ == "__main__":
    main()
