"""DeMo's ``dct`` step, this checkout against another revision, side by side in one run (2 gloo workers).

A change to the codec moves its step by a few percent, while a shared machine moves the step ÷ forward+backward
ratio of one and the same code by 20% between runs minutes apart (``bench_demo_codec.py`` on the 10m model: 0.165
to 0.23). So this benchmark times both codes in the same processes at the same moments: the other revision's
``src/quietsync`` (``git archive``, imported as ``quietsync_base``) and this checkout's each build the ``demo``
strategy (DeMo-SGD, sign, ``dct`` at compression 1/32, chunk 64) on the same model; every round runs one step of
each, in alternating order, on the same micro-batch, the workers meeting at a barrier before every
forward+backward and every step. Reported: each code's median step and its ratio to the median forward+backward
(both codes' forward+backward pooled: they compute the same), and the **paired** ratio (this checkout's step ÷
the other's step of the same round, median over rounds and workers), in wall and in process CPU time. Each phase
of DeMo's update (momentum, extract, exchange, apply) is timed too (process CPU). The paired ratio still moves:
the same code against itself (``--base HEAD`` on a clean tree) gave 0.96-1.08 over three runs of 20 rounds on a
shared 2-core machine, so a step ratio inside that band does not show a difference; run it again, or compare the
phase that changed.

    python benchmarks/ab_demo_step.py --base REV [--model 10m] [--rounds 8] [--name ab_demo_step]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from bench_demo_codec import BATCH, LR, PHASES, SEQ, VOCAB, _loss, _timed  # noqa: E402
from common import RESULTS, init_local_worker, write_markdown  # noqa: E402

from quietsync.cli.launch import free_port  # noqa: E402

CODES = ("base", "head")


def export_base(rev: str, into: Path) -> str:
    """``rev``'s ``src/quietsync`` as the package ``quietsync_base`` under ``into`` (its absolute imports of
    ``quietsync`` renamed); returns the revision's full hash."""
    full = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    archive = into / "base.tar"
    subprocess.run(["git", "archive", "-o", str(archive), full, "src/quietsync"], cwd=ROOT, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    package = into / "quietsync_base"
    (into / "src" / "quietsync").rename(package)
    pattern = re.compile(r"^(\s*)(from|import) quietsync(?=[.\s])", re.MULTILINE)
    for path in package.rglob("*.py"):
        path.write_text(pattern.sub(r"\1\2 quietsync_base", path.read_text()))
    return full


def _worker(rank: int, world: int, port: int, base_dir: str, args: argparse.Namespace, out: str) -> None:
    init_local_worker(rank, world, port, 1)
    sys.path.insert(0, base_dir)
    import quietsync_base  # type: ignore[import-not-found]

    import quietsync
    from quietsync.models import build_model

    config = {"replicator": "dct", "chunk": 64, "compression": 1 / 32}
    makers = {"base": quietsync_base.make_strategy, "head": quietsync.make_strategy}
    strategies = {code: makers[code]("demo", build_model(args.model, VOCAB, seed=0), torch.optim.SGD, lr=LR,
                                     config=dict(config)) for code in CODES}
    record: dict[str, dict[str, list[float]]] = {
        code: {key: [] for key in ("fwd_bwd", "fwd_bwd_cpu", "step", "step_cpu", *PHASES)} for code in CODES}
    for code, strategy in strategies.items():  # each phase's process CPU time, step by step (its wall time unused)
        for phase in PHASES:
            setattr(strategy.optimizer, phase, _timed(getattr(strategy.optimizer, phase), [], record[code][phase]))
    batch = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    for r in range(args.rounds + 1):  # round 0 warms both up (layouts, buffers, caches); not kept
        for code in (CODES if r % 2 else CODES[::-1]):
            strategy = strategies[code]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            strategy.forward_backward(batch, _loss)
            t1, c1 = time.perf_counter(), time.process_time()
            dist.barrier()
            t2, c2 = time.perf_counter(), time.process_time()
            assert strategy.step()
            t3, c3 = time.perf_counter(), time.process_time()
            kept = record[code]
            for key, value in (("fwd_bwd", t1 - t0), ("fwd_bwd_cpu", c1 - c0), ("step", t3 - t2),
                               ("step_cpu", c3 - c2)):
                kept[key].append(value)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {code: {k: v[-args.rounds:] for k, v in rec.items()}
                                      for code, rec in record.items()})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def _ratios(per_worker: list[dict[str, dict[str, list[float]]]], key: str) -> list[float]:
    """Head's ``key`` ÷ base's ``key`` in the same round, over every worker's rounds."""
    return [h / b for w in per_worker for b, h in zip(w["base"][key], w["head"][key])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the git revision to compare this checkout with")
    ap.add_argument("--model", default="10m", choices=["tiny", "default", "10m"])
    ap.add_argument("--rounds", type=int, default=8, help="steps of each code per worker, after one warm-up round")
    ap.add_argument("--name", default="ab_demo_step", help="results file stem")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            base = export_base(args.base, Path(tmp))
        except subprocess.CalledProcessError as e:
            ap.error(f"--base {args.base!r}: not a revision of this repository ({(e.stderr or str(e)).strip()})")
        raw = Path(tmp) / "raw.json"
        mp.start_processes(_worker, args=(2, free_port(), tmp, args, str(raw)), nprocs=2, start_method="spawn")
        per_worker = json.loads(raw.read_text())
    head = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    med = statistics.median
    # both codes run the same forward+backward: its median over both is the one denominator
    fb = med([v for w in per_worker for code in CODES for v in w[code]["fwd_bwd"]])
    fb_cpu = med([v for w in per_worker for code in CODES for v in w[code]["fwd_bwd_cpu"]])
    rows, summary = [], {"fwd_bwd_ms": fb * 1e3, "fwd_bwd_cpu_ms": fb_cpu * 1e3}
    for code, label in (("base", f"{args.base} ({base[:7]})"), ("head", f"this checkout ({head})")):
        def m(key: str, _code: str = code) -> float:
            return med([v for w in per_worker for v in w[_code][key]])
        summary[code] = {"step_ms": m("step") * 1e3, "step_over_fwd_bwd": m("step") / fb,
                         "step_over_fwd_bwd_cpu": m("step_cpu") / fb_cpu,
                         "phases_cpu_ms": {p: m(p) * 1e3 for p in PHASES}}
        rows.append([label, m("step") * 1e3, m("step") / fb, m("step_cpu") / fb_cpu] + [m(p) * 1e3 for p in PHASES])
    paired = {key: statistics.median(_ratios(per_worker, key)) for key in ("step", "step_cpu", *PHASES)}
    summary["paired_head_over_base"] = paired
    quartiles = statistics.quantiles(_ratios(per_worker, "step"), n=4) if args.rounds > 1 else [paired["step"]] * 3
    summary["paired_step_quartiles"] = [quartiles[0], quartiles[2]]
    cmd = f"python benchmarks/ab_demo_step.py --base {args.base} --model {args.model} --rounds {args.rounds}"
    notes = (f"2 gloo workers × 1 thread, the {args.model} model, one {BATCH}×{SEQ} micro-batch per step, DeMo-SGD "
             f"(sign, lr {LR}), `dct` at compression 1/32, chunk 64. Both codes in the same worker processes, one "
             f"step of each per round in alternating order, {args.rounds} rounds after a warm-up round; medians "
             f"over both workers' steps. Forward+backward (the same for both codes; median of both): "
             f"{fb * 1e3:.0f} ms wall, {fb_cpu * 1e3:.0f} ms CPU. Phases: process CPU ms.\n\n"
             f"**Paired, this checkout ÷ {args.base}, same round: step {paired['step']:.3f} (wall), "
             f"{paired['step_cpu']:.3f} (CPU)** (the rounds' wall ratios: quartiles {quartiles[0]:.3f}-"
             f"{quartiles[2]:.3f}); phases (CPU) " + ", ".join(f"{p} {paired[p]:.3f}" for p in PHASES) + ". The "
             "same code against itself gave paired step ratios of 0.96-1.08 in three runs of 20 rounds on a "
             "shared 2-core machine: a difference inside that band is not one.\n\n"
             f"Reproduce: `{cmd}`")
    path = write_markdown(args.name, f"DeMo dct step: this checkout against {args.base}, side by side",
                          ["code", "step ms", "step ÷ fwd+bwd", "CPU step ÷ CPU fwd+bwd",
                           *(f"{p} ms" for p in PHASES)], rows, notes)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "base": base, "head": head,
                                                           "command": cmd, "summary": summary,
                                                           "raw": per_worker}, indent=1))
    print(path.read_text())


if __name__ == "__main__":
    main()
