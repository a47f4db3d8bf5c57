"""DeMo replicator step ÷ forward+backward on 2 gloo workers, real collective, one run.

Two gloo workers (``--threads`` torch threads each; 2 workers × 1 thread on a 2-core box is how a user runs
them), a GPT-Neo preset (``tiny`` ≈ 1 M, ``10m`` ≈ 10.6 M parameters at vocabulary 4096), one fixed 8×128
micro-batch per step. For every variant the forward+backward and the optimizer step (momentum update,
encode, top-k, error feedback, the real all-gather / all-reduce, decode, sign, apply) are timed separately
in the same loop, and the variants are interleaved round by round in a rotating order, so the drift of a
shared machine hits them all alike. Reported: median step ÷ median forward+backward per variant. The workers
meet at a barrier before the step (not timed), so a step's collective does not also wait for a peer whose
backward ran slower on the shared cores (``--no-step-barrier`` times from the end of the local backward).

Variants: quietsync ``demo`` with the ``dct`` (chunk 64, compression 1/32), ``random`` and ``striding``
replicators (DeMo-SGD, sign), and -- only when the PyPI package ``detonation`` is importable -- the reference
implementation's ``DeToSGD`` + ``DeMoReplicator`` (chunk 64, ``--detonation-topk``; sharding group of one
per rank, replication over both workers, no FSDP: the plain module's gradients are what it reads). It is
measured, never a dependency of quietsync.

``--phases`` also times DeMo's four phases inside every quietsync step (momentum, extract, exchange -- the
all-gather included --, apply) and reports each one's median ÷ the median forward+backward.

The ratio differs from one processor to another (the step is more memory-bound than the forward+backward), so the
report names the CPU and gives one thread's rate on a large product and on the DCT's own products, measured before
the workers start.

``--profile`` additionally records a ``torch.profiler`` table of a few quietsync ``dct`` steps on rank 0
(after the timed rounds) into ``results/demo_codec_profile_<model>.txt``.

    python benchmarks/bench_demo_codec.py [--models tiny 10m] [--rounds 8] [--steps-per-round 2] [--variants dct]
                                          [--phases] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import RESULTS, cpu_description, init_local_worker, write_markdown  # noqa: E402

VOCAB = 4096
BATCH, SEQ = 8, 128
LR = 1e-4


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def _have_detonation() -> bool:
    try:
        import detonation  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not measured"
        return False
    return True


class _Variant:
    """One thing to time: ``fwd_bwd(batch)`` then ``step()``."""

    def __init__(self, fwd_bwd: Any, step: Any) -> None:
        self.fwd_bwd, self.step = fwd_bwd, step


PHASES = ("momentum", "extract", "exchange", "apply")
"""DeMo's update, one optimizer method each (``strategies/decoupled/demo.py`` calls them in this order)."""


def _timed(fn: Any, into: list[float], cpu: list[float]) -> Any:
    def timed(*args: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args)
        into.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        return out
    return timed


def _quietsync_variant(model_name: str, replicator: str,
                       phases: dict[str, dict[str, list[float]]] | None = None) -> _Variant:
    import quietsync
    from quietsync.models import build_model

    strategy = quietsync.make_strategy("demo", build_model(model_name, VOCAB, seed=0), torch.optim.SGD, lr=LR,
                                       config={"replicator": replicator, "chunk": 64, "compression": 1 / 32})
    if phases is not None:  # each phase's wall and CPU time, step by step (the optimizer's own methods, wrapped)
        for name in PHASES:
            wall, cpu = phases.setdefault("wall", {}), phases.setdefault("cpu", {})
            setattr(strategy.optimizer, name, _timed(getattr(strategy.optimizer, name), wall.setdefault(name, []),
                                                     cpu.setdefault(name, [])))

    def fwd_bwd(batch: torch.Tensor) -> None:
        strategy.forward_backward(batch, _loss)

    def step() -> None:
        assert strategy.step()
    return _Variant(fwd_bwd, step)


def _detonation_variant(model_name: str, topk: int, solo: Any) -> _Variant:
    from detonation import DeMoReplicator, DeToSGD

    from quietsync.models import build_model

    model = build_model(model_name, VOCAB, seed=0)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its chunk sizes
        opt = DeToSGD(model.parameters(), lr=LR, replicator=DeMoReplicator(compression_topk=topk, compression_chunk=64),
                      sharding_parallel_group=solo, replication_parallel_group=dist.group.WORLD)

    def fwd_bwd(batch: torch.Tensor) -> None:
        _loss(model, batch).backward()

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _Variant(fwd_bwd, step)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    init_local_worker(rank, world, port, args.threads)
    solos = [dist.new_group([r]) for r in range(world)]  # every rank takes part in creating every group
    batch = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    result: dict[str, Any] = {}
    for model_name in args.models:
        phases: dict[str, dict[str, list[float]]] = {f"quietsync {r}": {} for r in args.variants}
        variants = {name: _quietsync_variant(model_name, name.split()[1], ph if args.phases else None)
                    for name, ph in phases.items()}
        if args.detonation:
            variants["detonation dct"] = _detonation_variant(model_name, args.detonation_topk, solos[rank])
        names = list(variants)
        for name in names:  # warm-up: allocations, caches, layouts
            for _ in range(2):
                variants[name].fwd_bwd(batch)
                variants[name].step()
        fb: dict[str, list[float]] = {n: [] for n in names}
        st: dict[str, list[float]] = {n: [] for n in names}
        fb_cpu: dict[str, list[float]] = {n: [] for n in names}
        st_cpu: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                v = variants[name]
                for _ in range(args.steps_per_round):
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    v.fwd_bwd(batch)
                    t1, c1 = time.perf_counter(), time.process_time()
                    fb[name].append(t1 - t0)
                    fb_cpu[name].append(c1 - c0)
                    if args.step_barrier:  # the step starts together: its collective does not wait out a slow peer
                        dist.barrier()
                        t1, c1 = time.perf_counter(), time.process_time()
                    v.step()
                    st[name].append(time.perf_counter() - t1)
                    st_cpu[name].append(time.process_time() - c1)
        n_params = sum(p.numel() for p in _param_count_model(model_name).parameters())
        timed = slice(2, 2 + args.rounds * args.steps_per_round)  # after the two warm-up steps
        kept = {v: {clock: {k: t[timed] for k, t in by.items()} for clock, by in ph.items()}
                for v, ph in phases.items() if ph}
        result[model_name] = {"params": n_params, "fwd_bwd_s": fb, "step_s": st, "fwd_bwd_cpu_s": fb_cpu,
                              "step_cpu_s": st_cpu, "phases_s": kept}
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            v = variants["quietsync dct"]
            prof_ctx = profile(activities=[ProfilerActivity.CPU]) if rank == 0 else contextlib.nullcontext()
            with prof_ctx as prof:
                for _ in range(3):
                    v.fwd_bwd(batch)
                    dist.barrier()
                    if rank == 0:
                        with torch.profiler.record_function("dct_step"):
                            v.step()
                    else:
                        v.step()
            if rank == 0:
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                (RESULTS / f"demo_codec_profile_{model_name}.txt").write_text(table)
        del variants
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def gemm_rates(reps: int = 20) -> dict[str, float]:
    """GFLOP/s of one thread on a large fp32 product (1024³) and on the DCT's own shapes (chunk 64: a 64×64
    basis times a block row of a 1024-wide matrix, and 4096 rows times a 64×64 basis), medians of ``reps``."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1024, 1024, generator=g)
    basis, rows, tall = torch.randn(64, 64, generator=g), torch.randn(4, 64, 1024, generator=g), torch.randn(4096, 64)

    def rate(fn: Any, flops: float) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return flops / statistics.median(times) / 1e9

    dct_flops = 2 * 4 * 64 * 64 * 1024
    return {"large_gflops": rate(lambda: big @ big, 2 * 1024**3),
            "dct_left_gflops": rate(lambda: torch.matmul(basis, rows), dct_flops),
            "dct_right_gflops": rate(lambda: tall @ basis, dct_flops)}


def _param_count_model(model_name: str) -> torch.nn.Module:
    from quietsync.models import build_model

    return build_model(model_name, VOCAB, seed=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "10m"], choices=["tiny", "default", "10m"])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps-per-round", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (2 workers share 2 cores)")
    ap.add_argument("--variants", nargs="+", default=["dct", "random", "striding"],
                    choices=["dct", "random", "striding"], help="quietsync replicators to time")
    ap.add_argument("--detonation-topk", type=int, default=32, help="DeMo reference's compression_topk")
    ap.add_argument("--no-detonation", action="store_true", help="skip the reference even when installed")
    ap.add_argument("--phases", action="store_true", help="time DeMo's four phases inside each quietsync step")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of quietsync dct steps (rank 0)")
    ap.add_argument("--name", default="demo_codec", help="results file stem")
    ap.add_argument("--no-step-barrier", dest="step_barrier", action="store_false",
                    help="time the step from the end of the local backward (includes waiting for the peer)")
    args = ap.parse_args()
    args.detonation = _have_detonation() and not args.no_detonation
    rates = gemm_rates()
    cpu = cpu_description()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.name}.raw.json"
    mp.start_processes(_worker, args=(2, port, args, str(out)), nprocs=2, start_method="spawn")
    raw = json.loads(out.read_text())
    out.unlink()
    rows, summary, phase_lines = [], {}, []
    for model_name, res in raw.items():
        summary[model_name] = {}
        for name in res["fwd_bwd_s"]:
            fb = statistics.median(res["fwd_bwd_s"][name])
            st = statistics.median(res["step_s"][name])
            fbc = statistics.median(res["fwd_bwd_cpu_s"][name])
            stc = statistics.median(res["step_cpu_s"][name])
            summary[model_name][name] = {"fwd_bwd_ms": fb * 1e3, "step_ms": st * 1e3, "step_over_fwd_bwd": st / fb,
                                         "fwd_bwd_cpu_ms": fbc * 1e3, "step_cpu_ms": stc * 1e3,
                                         "step_over_fwd_bwd_cpu": stc / fbc}
            rows.append([model_name, f"{res['params']:,}", name, fb * 1e3, st * 1e3, st / fb, stc / fbc])
            ph = res.get("phases_s", {}).get(name)
            if ph:
                over = {clock: {k: statistics.median(t) / (fb if clock == "wall" else fbc) for k, t in by.items()}
                        for clock, by in ph.items()}
                summary[model_name][name]["phases_over_fwd_bwd"] = over
                phase_lines += [f"{model_name} {name}, {clock}: " + ", ".join(f"{k} {v:.3f}" for k, v in by.items())
                                for clock, by in over.items()]
    cmd = (f"python benchmarks/bench_demo_codec.py --models {' '.join(args.models)} --rounds {args.rounds} "
           f"--steps-per-round {args.steps_per_round} --threads {args.threads} --variants {' '.join(args.variants)}"
           + (" --phases" if args.phases else "") + (" --profile" if args.profile else "")
           + (" --no-detonation" if args.no_detonation else "")
           + ("" if args.step_barrier else " --no-step-barrier"))
    ref = (f"`detonation dct` is the reference implementation (PyPI detonation 0.5.2, topk {args.detonation_topk} "
           "per 64×64 chunk, measured only)." if args.detonation else "detonation not installed: not measured.")
    notes = (f"2 gloo workers × {args.threads} thread(s), one {BATCH}×{SEQ} micro-batch per step, DeMo-SGD "
             f"(sign, lr {LR}), quietsync replicators at compression 1/32 (dct chunk 64). Median over "
             f"{args.rounds} interleaved rounds × {args.steps_per_round} steps of each variant; forward+backward "
             "and step timed separately in the same loop, the step includes the real gloo collective"
             + (" (workers meet at a barrier before it). " if args.step_barrier else ". ")
             + f"{ref} CPU: the worker process's CPU time (all its threads, gloo's included), which a loaded "
             "machine inflates far less than the wall time of a worker waiting for a core. Shared 2-core machine: "
             "compare ratios within this table only.\n\n"
             + f"CPU: {cpu}; one thread: a 1024³ product at {rates['large_gflops']:.0f} GFLOP/s, the DCT's products "
             f"at {rates['dct_left_gflops']:.0f} (basis × block row) and {rates['dct_right_gflops']:.0f} (rows × "
             "basis) GFLOP/s. The ratio differs from one CPU to another (docs/demo.md).\n\n"
             + ("".join(f"Phases (median ÷ median forward+backward) {line}.\n\n" for line in phase_lines))
             + f"Reproduce: `{cmd}`")
    path = write_markdown(args.name, "DeMo replicator step ÷ forward+backward (2 gloo workers, one run)",
                          ["model", "params", "variant", "fwd+bwd ms", "step ms", "step ÷ fwd+bwd",
                           "CPU step ÷ CPU fwd+bwd"], rows, notes)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "command": cmd, "cpu": cpu,
                                                           "gemm_rates": rates, "summary": summary,
                                                           "raw": raw}, indent=1))
    print(path.read_text())


if __name__ == "__main__":
    main()
