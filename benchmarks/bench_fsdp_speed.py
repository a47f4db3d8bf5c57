"""Step time and bytes per group: flexdemo on the flat substrate vs on FSDP2, and fsdp, on slow inter links.

Runs ``quietsync train`` on 2 nodes x 2 local workers with an emulated inter-node link (10 Mbit/s and
100 Mbit/s, 5 ms) and intra-node link (10 Gbit/s, 0.05 ms), same model, data and steps for every job, and
writes ``results/fsdp_speed.md`` (+ ``.json``): seconds per step (steps 3..end, mean over workers), idle
seconds per step, and the bytes each worker sends per step on ``shard`` (inside the node) and ``replicate``
(across nodes).

    python benchmarks/bench_fsdp_speed.py [--steps 12] [--model tiny] [--accumulation 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import RESULTS, run_train, step_stats, write_markdown  # noqa: E402

JOBS = {
    "flexdemo flat (--params replicated)": ["--strategy", "flexdemo", "--params", "replicated"],
    "flexdemo FSDP2 (--params sharded)": ["--strategy", "flexdemo", "--params", "sharded"],
    "fsdp (HSDP AdamW)": ["--strategy", "fsdp"],
}
LINKS = ("10mbit,5ms", "100mbit,5ms")


def per_step_bytes(summary: dict, group: str) -> float:
    """Bytes one worker sends on ``group`` per step (steps 3..end, mean over workers)."""
    vals = [r["bytes_by_group"].get(group, {}).get("sent", 0)
            for records in summary["records"] for r in [x for x in records if "event" not in x][3:]]
    return sum(vals) / max(1, len(vals))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--accumulation", type=int, default=1)
    args = ap.parse_args()
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for inter in LINKS:
            for label, flags in JOBS.items():
                t0 = time.perf_counter()
                summary = run_train(
                    Path(tmp) / f"{label.split()[0]}_{len(results)}", "--nproc", "4", "--nodes", "2",
                    "--link", f"inter={inter}", "--link", "intra=10gbit,0.05ms", "--model", args.model,
                    "--max-steps", str(args.steps), "--micro-batch-size", "4", "--seq-len", "64",
                    "--accumulation", str(args.accumulation), "--eval-every", str(args.steps), *flags)
                stats = step_stats(summary)
                results[f"{inter} | {label}"] = {
                    "inter": inter, "label": label, "step_s": stats["step_s"], "idle_s": stats["idle_s"],
                    "shard_B": per_step_bytes(summary, "shard"), "replicate_B": per_step_bytes(summary, "replicate"),
                    "last_eval": summary["last_eval_loss"]}
                print(f"{inter} {label}: {stats['step_s']:.3f} s/step ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = [[v["inter"].split(",")[0], v["label"], v["step_s"], v["idle_s"], v["shard_B"] / 1e6,
             v["replicate_B"] / 1e6, v["last_eval"]] for v in results.values()]
    path = write_markdown(
        "fsdp_speed", "flexdemo flat vs FSDP2 vs fsdp: step time and bytes per group (2 nodes x 2 workers)",
        ["inter link", "strategy", "step s", "idle s/step", "shard MB/step", "replicate MB/step", "eval last"],
        rows,
        notes=(f"Model `{args.model}`, {args.steps} steps, micro-batch 4 x 64 tokens per worker, accumulation "
               f"{args.accumulation}, emulated links inter=<link>,5ms and intra=10gbit,0.05ms, flexdemo defaults "
               "(dct replicator, compression 1/32, DeMo-SGD). Bytes are what one worker sends per step. One run "
               "each on a loaded 2-core machine: differences of a few percent are noise. Reproduce: "
               "`python benchmarks/bench_fsdp_speed.py`."))
    (RESULTS / "fsdp_speed.json").write_text(json.dumps(results, indent=1))
    print(path.read_text())


if __name__ == "__main__":
    main()
