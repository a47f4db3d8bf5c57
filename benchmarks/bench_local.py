"""K-batch synchronous SGD, gradient accumulation and DiLoCo at an equal token budget: the seed note's table
(paper 004) in miniature.

Every row trains the same GPT-Neo preset on the embedded corpus with the same number of **tokens**
(``--micro-batches`` micro-batches of 8×128 in total, over all workers) and the same lr schedule shape:

* ``1 worker`` — plain training, one micro-batch per step (the reference for speed-up);
* ``full sync, accumulation A`` — ``zero1`` on W workers, A micro-batches per worker per step (the note's
  gradient accumulation: fewer, larger steps);
* ``localsgd K`` — W workers, a local step per micro-batch, parameters averaged every K steps;
* ``diloco H`` — W workers, H inner AdamW steps, outer Nesterov SGD (lr 0.7, momentum 0.9);
* ``streaming diloco`` — H = 16, 4 fragments, outer communication overlapped by one inner step.

The W workers stand for W nodes on an emulated link whose bandwidth is chosen so that **one full gradient
all-reduce takes about one micro-batch's compute** (the note's PCIe estimate): the script first measures a
micro-batch on W workers, then sets the link. Columns: speed-up in wall time over 1 worker at the same tokens,
final held-out loss (the note's F1 analogue), bytes sent per token (all workers).

    python benchmarks/bench_local.py [--micro-batches 256] [--model tiny] [--workers 2] [--threads 1]

A miniature must be able to show the claim: every worker gets a core of its own (``--workers 2 --threads 1``
on this 2-core machine, against 1 worker at 1 thread), so the ceiling is a 2× speed-up, which K = 16 should
approach. (More workers than cores cannot beat one worker: they share the cores.)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from common import RESULTS, run_train, write_markdown


def _row(label: str, summary: dict[str, Any], base_wall: float | None) -> dict[str, Any]:
    bytes_sent = sum(c["sent"] for c in summary["bytes_by_group"].values())
    return {
        "label": label, "steps": summary["steps"], "tokens": summary["tokens"], "wall_s": summary["wall_s"],
        "speedup": (base_wall / summary["wall_s"]) if base_wall else 1.0,
        "eval_loss": summary["last_eval_loss"], "bytes_per_token": bytes_sent / max(1, summary["tokens"]),
        "curve": summary["eval"],
    }


def calibrate(tmp: Path, model: str, workers: int, threads: int) -> tuple[float, int]:
    """(seconds of one micro-batch's compute on ``workers`` workers, bytes of one full fp32 gradient)."""
    s = run_train(tmp / "calibrate", "--strategy", "ddp", "--nproc", str(workers), "--max-steps", "6",
                  "--model", model, "--eval-every", "0", "--eval-windows", "4", "--threads", str(threads))
    steps = [r for r in s["records"][0] if "event" not in r][2:]
    compute = sum(r["compute_s"] for r in steps) / sum(r["micro_batches"] for r in steps)
    return compute, 4 * s["parameters"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, default=256, help="token budget, in micro-batches over all workers")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--lr", default="3e-3")
    ap.add_argument("--workers", type=int, default=2, help="workers of the distributed rows (one core each)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker, the 1-worker row included")
    args = ap.parse_args()
    workers = args.workers
    per_worker = args.micro_batches // workers
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        compute_s, grad_bytes = calibrate(tmp, args.model, workers, args.threads)
        # ring all-reduce: each worker sends 2(n-1)/n of the buffer; make that take one micro-batch's compute
        bandwidth_bits = 8 * 2 * (workers - 1) / workers * grad_bytes / compute_s
        link = f"inter={bandwidth_bits / 1e6:.1f}mbit,1ms"
        print(f"micro-batch {compute_s:.3f} s on {workers} workers, gradient {grad_bytes / 1e6:.2f} MB -> {link}",
              flush=True)
        common = ["--model", args.model, "--lr", args.lr, "--eval-every", "0", "--eval-windows", "32",
                  "--threads", str(args.threads)]

        def run(label: str, nproc: int, steps: int, *flags: str) -> None:
            summary = run_train(tmp / label.replace(" ", "_").replace(",", ""), "--nproc", str(nproc),
                                "--max-steps", str(steps), "--link", link, *common, *flags)
            rows.append(_row(label, summary, rows[0]["wall_s"] if rows else None))
            r = rows[-1]
            print(f"{label:28s} {r['speedup']:.2f}x  loss {r['eval_loss']:.3f}  {r['bytes_per_token']:.0f} B/token",
                  flush=True)

        run("1 worker", 1, args.micro_batches, "--strategy", "zero1")
        for acc in (1, 2, 4, 8, 16):
            run(f"full sync, accumulation {acc}", workers, max(1, per_worker // acc), "--strategy", "zero1",
                "--accumulation", str(acc))
        for k in (1, 2, 4, 8, 16):
            run(f"localsgd K={k}", workers, per_worker, "--strategy", "localsgd", "--sync-every", str(k))
        for h in (4, 16):
            run(f"diloco H={h}", workers, per_worker, "--strategy", "diloco", "--sync-every", str(h))
        run("streaming diloco H=16 F=4", workers, per_worker, "--strategy", "diloco", "--sync-every", "16",
            "--fragments", "4", "--overlap-delay", "1")
    table = [[r["label"], r["steps"], r["tokens"], r["speedup"], r["eval_loss"], r["bytes_per_token"]] for r in rows]
    path = write_markdown(
        "local", f"Local SGD / DiLoCo vs gradient accumulation — {args.micro_batches} micro-batches of tokens, "
        f"model {args.model}, {workers} workers on {link}",
        ["run", "steps", "tokens", "speed-up vs 1 worker", "held-out loss", "bytes sent / token"], table,
        notes=(f"One full gradient all-reduce ≈ one micro-batch's compute ({compute_s:.3f} s measured on "
               f"{workers} workers, gradient {grad_bytes / 1e6:.2f} MB). Same tokens and lr ({args.lr}, warm-up + "
               f"cosine over each run's steps) everywhere; {args.threads} torch thread(s) per worker, the 1-worker "
               f"row included. Reproduce: `python benchmarks/bench_local.py --micro-batches {args.micro_batches} "
               f"--model {args.model} --workers {workers} --threads {args.threads}`."),
    )
    (RESULTS / "local.json").write_text(json.dumps({"link": link, "compute_s": compute_s, "rows": rows}, indent=2))
    print(path.read_text())


if __name__ == "__main__":
    main()
