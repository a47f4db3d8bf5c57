"""Mixed precision, activation checkpointing and compile, measured side by side on CPU.

Four measurements, each a ratio within one run of this script (timings depend on the machine: re-run on an
idle one before quoting them):

1. **bf16 vs fp32 per strategy** (zero1, acco, demo, diloco, fsdp; 2 local gloo workers, one thread each): the
   trainer's GPT-Neo (``--model default`` unless ``--quick``), the same micro-batches, the same number of
   committed steps; per worker the median seconds per committed step (after two warm-up steps) and the peak
   resident memory during the steps above the resident memory before them (Linux ``VmHWM``, reset through
   ``/proc/self/clear_refs``); the last training loss of both.
2. **The main job's held-out loss in bf16 vs fp32**: ``quietsync train`` (its defaults: zero1, 2 workers,
   ``--model default``, 300 steps, the embedded corpus; ``--quick``: ``--model tiny``, 60 steps) once with
   ``--precision fp32`` and once with ``--precision bf16``; the final held-out loss of each (evaluated under the
   run's precision) and their relative difference (the claim: within 1%).
3. **Activation checkpointing** (one process, the same model): bytes autograd holds for backward after one
   micro-batch's forward (``quietsync.activation_memory.ActivationMeter``) and seconds per forward+backward,
   with and without ``enable_activation_checkpointing``, interleaved.
4. **Compile**: seconds per forward+backward with ``compile_blocks`` (each transformer block through
   ``torch.compile``) vs eager, interleaved after a warm-up that includes compiling, and the compile time.

Writes ``results/precision.json`` and ``results/precision.md`` (``precision_quick.*`` with ``--quick``).

    python benchmarks/bench_precision.py            # the full run (the main job twice: ~15 min on 2 idle cores)
    python benchmarks/bench_precision.py --quick    # a few minutes: tiny model, fewer steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import RESULTS, run_train, write_markdown  # noqa: E402

STRATEGIES = {  # name -> config (2 workers)
    "zero1": {},
    "acco": {"deterministic_accumulation": 1},
    "demo": {},
    "diloco": {"sync_every": 8},
    "fsdp": {},
}
VOCAB = 4096


def _status(key: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _model(preset: str):
    from quietsync.models import build_model

    return build_model(preset, VOCAB, 0, seed=0)


def _strategy_worker(rank: int, world: int, name: str, precision: str, preset: str, steps: int,
                     micro_batch: int, seq_len: int) -> dict[str, Any]:
    import torch

    import quietsync
    from quietsync.models import param_groups

    model = _model(preset)
    strategy = quietsync.make_strategy(
        name, model, torch.optim.AdamW, param_groups=param_groups(model, 0.1), config=dict(STRATEGIES[name]),
        precision=precision, lr=2e-3, weight_decay=0.1, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(100 + rank)

    def loss_fn(m, b):
        return m(input_ids=b, labels=b).loss

    reset = _reset_peak_rss()
    rss0 = _status("VmRSS")
    commits, losses = [], []
    t0 = time.perf_counter()
    while strategy.steps < steps:
        loss = strategy.forward_backward(torch.randint(0, VOCAB, (micro_batch, seq_len), generator=g), loss_fn)
        if loss is not None:
            losses.append(float(loss))
        if strategy.step():
            commits.append(time.perf_counter())
    peak = _status("VmHWM")
    strategy.close()
    intervals = [b - a for a, b in zip([t0, *commits], commits)][2:]
    return {"step_s": statistics.median(intervals), "peak_over_start": peak - rss0 if reset else None,
            "peak_rss": peak, "loss": statistics.mean(losses[-4:]), "micro_batches": strategy.micro_batches}


def per_strategy(preset: str, steps: int, micro_batch: int, seq_len: int) -> dict[str, Any]:
    from tests.distributed import run_ranks

    out: dict[str, Any] = {}
    for name in STRATEGIES:
        for precision in ("fp32", "bf16"):
            ranks = run_ranks(_strategy_worker, 2, name, precision, preset, steps, micro_batch, seq_len,
                              timeout=3600)
            out.setdefault(name, {})[precision] = ranks
            print(f"  {name} {precision}: {[round(r['step_s'], 3) for r in ranks]} s/step, peak over start "
                  f"{[None if r['peak_over_start'] is None else r['peak_over_start'] >> 20 for r in ranks]} MiB",
                  flush=True)
    return out


def main_job(quick: bool, workdir: Path) -> dict[str, Any]:
    flags = ["--model", "tiny", "--max-steps", "60", "--eval-every", "0"] if quick else []
    out = {}
    for precision in ("fp32", "bf16"):
        summary = run_train(workdir / f"main-{precision}", "--precision", precision, "--overwrite", *flags)
        out[precision] = {"last_eval_loss": summary["last_eval_loss"], "first_eval_loss": summary["first_eval_loss"],
                          "wall_s": summary["wall_s"], "steps": summary["steps"], "tokens": summary["tokens"]}
        print(f"  main job {precision}: held-out loss {summary['last_eval_loss']:.4f} ({summary['wall_s']:.0f} s)",
              flush=True)
    out["relative_difference"] = abs(out["bf16"]["last_eval_loss"] - out["fp32"]["last_eval_loss"]) / \
        out["fp32"]["last_eval_loss"]
    out["flags"] = ["quietsync", "train", *flags]
    return out


def _fwd_bwd_seconds(models: dict[str, Any], batch, repeats: int) -> dict[str, float]:
    """Median seconds of forward+backward of each model, interleaved (so load changes hit all alike)."""
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(repeats):
        for key, model in models.items():
            t0 = time.perf_counter()
            model(input_ids=batch, labels=batch).loss.backward()
            times[key].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    return {k: statistics.median(v) for k, v in times.items()}


def checkpointing(preset: str, micro_batch: int, seq_len: int, repeats: int) -> dict[str, Any]:
    import torch

    from quietsync.activation_memory import ActivationMeter
    from quietsync.models import enable_activation_checkpointing

    torch.set_num_threads(1)
    plain, ckpt = _model(preset), _model(preset)
    enable_activation_checkpointing(ckpt)
    batch = torch.randint(0, VOCAB, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    held = {}
    for key, model in (("plain", plain), ("checkpointed", ckpt)):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        meter = ActivationMeter(exclude=lambda t, params=params: t.untyped_storage().data_ptr() in params)
        with meter.track():
            loss = model(input_ids=batch, labels=batch).loss
        held[key] = meter.sample().bytes
        loss.backward()
        model.zero_grad(set_to_none=True)
    seconds = _fwd_bwd_seconds({"plain": plain, "checkpointed": ckpt}, batch, repeats)
    return {"held_bytes": held, "fwd_bwd_s": seconds,
            "memory_saved": 1 - held["checkpointed"] / held["plain"],
            "time_added": seconds["checkpointed"] / seconds["plain"] - 1}


def compile_speed(preset: str, micro_batch: int, seq_len: int, repeats: int) -> dict[str, Any]:
    import torch

    from quietsync.models import compile_blocks

    torch.set_num_threads(1)
    eager, compiled = _model(preset), _model(preset)
    compile_blocks(compiled)
    batch = torch.randint(0, VOCAB, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    for _ in range(2):  # the first call compiles (forward and backward graphs)
        compiled(input_ids=batch, labels=batch).loss.backward()
        compiled.zero_grad(set_to_none=True)
    compile_s = time.perf_counter() - t0
    seconds = _fwd_bwd_seconds({"eager": eager, "compiled": compiled}, batch, repeats)
    return {"compile_s": compile_s, "fwd_bwd_s": seconds, "speedup": seconds["eager"] / seconds["compiled"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and fewer steps (a few minutes)")
    ap.add_argument("--skip-main-job", action="store_true", help="leave out measurement 2 (the longest)")
    args = ap.parse_args()
    preset = "tiny" if args.quick else "default"
    steps = 6 if args.quick else 12
    micro_batch, seq_len = 8, 128
    repeats = 5 if args.quick else 15
    load_before = os.getloadavg()
    results: dict[str, Any] = {"preset": preset, "steps": steps, "micro_batch": micro_batch, "seq_len": seq_len,
                               "cpus": os.cpu_count(), "load_average_before": load_before}
    print("1. bf16 vs fp32 per strategy", flush=True)
    results["strategies"] = per_strategy(preset, steps, micro_batch, seq_len)
    print("3. activation checkpointing", flush=True)
    results["checkpointing"] = checkpointing(preset, micro_batch, seq_len, repeats)
    print("4. compile", flush=True)
    results["compile"] = compile_speed(preset, micro_batch, seq_len, repeats)
    if not args.skip_main_job:
        print("2. the main job, fp32 then bf16", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            results["main_job"] = main_job(args.quick, Path(tmp))
    results["load_average_after"] = os.getloadavg()
    name = "precision_quick" if args.quick else "precision"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2))
    print(_markdown(name, results, args).read_text())


def _markdown(name: str, r: dict[str, Any], args: argparse.Namespace) -> Path:
    rows = []
    for strategy, by in r["strategies"].items():
        f32, b16 = by["fp32"], by["bf16"]
        step = [statistics.mean(x["step_s"] for x in v) for v in (f32, b16)]
        peaks = [[x["peak_over_start"] for x in v] for v in (f32, b16)]
        mib = [max(p) / 2**20 if all(x is not None for x in p) else float("nan") for p in peaks]
        rows.append([strategy, step[0], step[1], step[1] / step[0], mib[0], mib[1],
                     statistics.mean(x["loss"] for x in f32), statistics.mean(x["loss"] for x in b16)])
    ck, co = r["checkpointing"], r["compile"]
    lines = [
        f"GPT-Neo `{r['preset']}` (vocabulary {VOCAB}), micro-batch {r['micro_batch']} x {r['seq_len']} tokens, "
        f"{r['steps']} committed steps per run, 2 local gloo workers with one thread each; {r['cpus']} CPUs, load "
        f"average {r['load_average_before'][0]:.1f} before and {r['load_average_after'][0]:.1f} after the run "
        "(timings from a loaded machine are not the machine's: re-run on an idle one).",
        "",
        "**Activation checkpointing** (one process, per micro-batch): held for backward "
        f"{ck['held_bytes']['plain'] / 2**20:.1f} MiB → {ck['held_bytes']['checkpointed'] / 2**20:.1f} MiB "
        f"({100 * ck['memory_saved']:.0f}% saved); forward+backward {ck['fwd_bwd_s']['plain'] * 1e3:.0f} ms → "
        f"{ck['fwd_bwd_s']['checkpointed'] * 1e3:.0f} ms ({100 * ck['time_added']:+.0f}%).",
        "",
        f"**Compile** (each block through torch.compile, one process): forward+backward "
        f"{co['fwd_bwd_s']['eager'] * 1e3:.0f} ms eager → {co['fwd_bwd_s']['compiled'] * 1e3:.0f} ms compiled "
        f"(speed-up {co['speedup']:.2f}x); compiling took {co['compile_s']:.0f} s.",
    ]
    if "main_job" in r:
        m = r["main_job"]
        lines += ["", f"**The main job** (`{' '.join(m['flags'])} --precision fp32|bf16`): held-out loss "
                  f"{m['fp32']['last_eval_loss']:.4f} (fp32) vs {m['bf16']['last_eval_loss']:.4f} (bf16), a "
                  f"relative difference of {100 * m['relative_difference']:.2f}% after {m['fp32']['steps']} steps "
                  f"({m['fp32']['wall_s']:.0f} s vs {m['bf16']['wall_s']:.0f} s of training)."]
    lines += ["", "Peak memory is the worker's peak resident memory during the steps above its resident memory "
              "before them (the larger of the two workers): activations, gradients, optimizer state created at "
              "the first step, autocast's low-precision weight copies. Reproduce: `python "
              f"benchmarks/bench_precision.py{' --quick' if args.quick else ''}`."]
    return write_markdown(
        name, "bf16 vs fp32 per strategy, activation checkpointing, compile (CPU)",
        ["strategy", "fp32 s/step", "bf16 s/step", "bf16 / fp32 time", "fp32 peak MiB", "bf16 peak MiB",
         "fp32 last loss", "bf16 last loss"],
        rows, notes="\n".join(lines))


if __name__ == "__main__":
    main()
