"""One strategy's training runs for the GPU check, through ``quietsync train`` in this process.

The check starts one process per strategy (``python -m quietsync.gpu_check.runs SPEC.json RESULT.json``), so a
strategy that crashes or hangs costs that strategy's checks only. The process runs, on one device (world of one),
the same job three ways: CUDA fp32, CUDA bf16 (and fp16 where asked), and CPU fp32 for the first few steps of the
same schedule (``--max-tokens`` stops it early; the lr schedule still spans ``--max-steps``). For each run it
records the per-step training losses, the held-out losses, the median step time, the strategy's
``memory_report()`` and the CUDA allocator's peak.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TOKENS_PER_MICRO_BATCH = 8 * 128
"""The check's micro-batch: 8 sequences of 128 tokens."""


@dataclass
class RunSpec:
    """What one strategy's process runs."""

    strategy: str
    """Registered strategy name."""
    flags: list[str] = field(default_factory=list)
    """The strategy's own ``quietsync train`` flags (e.g. ``["--sync-every", "4"]``)."""
    steps: int = 40
    """Committed steps of the CUDA runs (the lr schedule spans them)."""
    cpu_steps: int = 5
    """Steps of the CPU run compared step by step with the CUDA fp32 run."""
    precisions: list[str] = field(default_factory=lambda: ["bf16"])
    """Mixed precisions run on CUDA besides fp32."""
    extra_flags: list[str] = field(default_factory=list)
    """Job flags for every run of this spec (e.g. ``["--compile"]``)."""
    model: str = "tiny"
    """Model preset."""
    work: str = "gpu-check-runs"
    """Folder for the runs' outputs."""
    cache_dir: str | None = None
    """Tokenizer and token cache folder (``--cache-dir``)."""
    label: str = ""
    """Name of the run set in the report (default: the strategy)."""
    device: str = "cuda"
    """Device of the main runs: ``cuda`` (the check) or ``cpu`` (a dry run of the check on a machine without one)."""


def _read_run(out: Path) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    losses, times, evals_at, fwd_bwd = [], [], set(), []
    for line in (out / "metrics-rank0.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("event") == "eval":
            evals_at.add(r["step"])
        elif "event" not in r:
            if r.get("loss") is not None:  # a step committed by finish() (dpu/wp's update in flight) has no loss
                losses.append((int(r["step"]), float(r["loss"])))
            times.append((int(r["step"]), float(r["time_s"])))
            if int(r["step"]) > 3 and r.get("micro_batches"):
                fwd_bwd.append(float(r["compute_s"]) / int(r["micro_batches"]))
    # step time: consecutive committed steps after 3 warm-up steps, leaving out the intervals that hold an eval
    gaps = [t1 - t0 for (s0, t0), (s1, t1) in zip(times, times[1:]) if s0 >= 3 and s0 not in evals_at]
    return {"losses": losses, "eval": summary["eval"], "last_eval_loss": summary["last_eval_loss"],
            "fwd_bwd_s": statistics.median(fwd_bwd) if fwd_bwd else None,
            "steps": summary["steps"], "tokens": summary["tokens"], "wall_s": summary["wall_s"],
            "step_s": statistics.median(gaps) if gaps else None,
            "memory_bytes": summary.get("memory_bytes"), "cuda_peak_bytes": summary.get("cuda_peak_bytes")}


def _train(spec: RunSpec, name: str, precision: str, steps: int, max_tokens: int | None) -> dict[str, Any]:
    """One ``quietsync train`` run in this process; its recorded figures, or ``{"error": ...}``."""
    import torch

    from ..commands.main import main

    out = Path(spec.work) / f"{spec.label or spec.strategy}-{name}"
    argv = ["train", "--strategy", spec.strategy, *spec.flags, *spec.extra_flags, "--nproc", "1",
            "--model", spec.model, "--micro-batch-size", "8", "--seq-len", "128", "--max-steps", str(steps),
            "--precision", precision, "--eval-every", str(steps), "--eval-windows", "16", "--seed", "0",
            "--out", str(out), "--overwrite", "--no-progress", "--no-plot", "--no-export"]
    if max_tokens is not None:
        argv += ["--max-tokens", str(max_tokens)]
    if spec.cache_dir:
        argv += ["--cache-dir", spec.cache_dir]
    if torch.cuda.is_available():  # the runs share this process: each summary must report its own peak
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        rc = main(argv)
    except Exception as e:  # noqa: BLE001 - reported as this run's failure, the other runs go on
        return {"error": f"{type(e).__name__}: {e}", "argv": argv, "seconds": time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    if rc != 0:
        return {"error": f"quietsync train exited {rc}", "argv": argv, "seconds": seconds}
    return {**_read_run(out), "argv": argv, "seconds": seconds}


def run_spec(spec: RunSpec) -> dict[str, Any]:
    """Every run of ``spec``: ``{"fp32": ..., "bf16": ..., "cpu_fp32": ...}``."""
    from ..transport.groups import BACKEND_ENV

    results: dict[str, Any] = {}
    on_device = spec.device == "cuda"
    os.environ[BACKEND_ENV] = "nccl" if on_device else "gloo"
    results["fp32"] = _train(spec, "fp32", "fp32", spec.steps, None)
    for precision in spec.precisions:
        results[precision] = _train(spec, precision, precision, spec.steps, None)
    if spec.cpu_steps:
        os.environ[BACKEND_ENV] = "gloo"  # the transport's device: CPU
        fp32 = results["fp32"]
        # tokens per committed step measured, not assumed: a step may hold several micro-batches
        per_step = fp32["tokens"] // max(1, fp32["steps"]) if "error" not in fp32 else TOKENS_PER_MICRO_BATCH
        results["cpu_fp32"] = _train(spec, "cpu-fp32", "fp32", spec.steps, spec.cpu_steps * per_step)
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m quietsync.gpu_check.runs SPEC.json RESULT.json``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m quietsync.gpu_check.runs SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec = RunSpec(**json.loads(Path(args[0]).read_text()))
    result = {"spec": asdict(spec), "runs": run_spec(spec)}
    Path(args[1]).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
