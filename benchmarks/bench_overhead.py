"""No hidden overhead: quietsync ``ddp`` and ``zero1`` against raw PyTorch in the same loop (issue 13, part 3).

Two gloo workers (one thread each), no link emulation, the same GPT-Neo preset, the same 8×128 micro-batch of
token ids, AdamW(lr 1e-4), one micro-batch per step. Four variants are built side by side in one process
group and timed in interleaved rounds (each round times ``--steps-per-round`` steps of every variant, in a
rotating order), so drift of a shared machine hits all four alike:

* ``torch DDP`` — ``DistributedDataParallel(model)`` (defaults), ``loss.backward()``, ``opt.step()``;
* ``torch DDP + ZeroRedundancyOptimizer`` — the same with ``ZeroRedundancyOptimizer(AdamW)``;
* ``quietsync ddp`` — ``strategy.forward_backward(batch, loss_fn)``, ``strategy.step()``;
* ``quietsync zero1`` — the same with the ``zero1`` strategy.

A step is timed from the forward to the end of the optimizer step, with a barrier before each timed block.
Reported: the median over rounds of the per-step time, and quietsync ÷ its torch counterpart.

    python benchmarks/bench_overhead.py [--model tiny] [--rounds 12] [--steps-per-round 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import RESULTS, init_local_worker, write_markdown  # noqa: E402

VOCAB = 8192
BATCH, SEQ = 8, 128


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    init_local_worker(rank, world, port, args.threads)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    import quietsync
    from quietsync.models import build_model

    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(4)]

    def torch_variant(zero: bool):
        model = DistributedDataParallel(build_model(args.model, VOCAB, seed=0))
        opt = (ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4) if zero
               else torch.optim.AdamW(model.parameters(), lr=1e-4))

        def step(batch: torch.Tensor) -> None:
            _loss(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def quietsync_variant(name: str):
        strategy = quietsync.make_strategy(name, build_model(args.model, VOCAB, seed=0), torch.optim.AdamW, lr=1e-4)

        def step(batch: torch.Tensor) -> None:
            strategy.forward_backward(batch, _loss)
            assert strategy.step()
        return step

    variants = {"torch DDP": torch_variant(False), "torch DDP + ZeroRedundancyOptimizer": torch_variant(True),
                "quietsync ddp": quietsync_variant("ddp"), "quietsync zero1": quietsync_variant("zero1")}
    names = list(variants)
    for name in names:  # warm-up: allocations, DDP's first-iteration bucket rebuild
        for i in range(3):
            variants[name](batches[i % len(batches)])
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(args.steps_per_round):
                variants[name](batches[i % len(batches)])
            times[name].append((time.perf_counter() - t0) / args.steps_per_round)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "default", "10m"])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (2 workers share 2 cores)")
    args = ap.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = RESULTS / f"overhead_{args.model}.raw.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(2, port, args, str(out)), nprocs=2, start_method="spawn")
    times = json.loads(out.read_text())
    out.unlink()
    med = {k: statistics.median(v) for k, v in times.items()}
    pairs = {"quietsync ddp": "torch DDP", "quietsync zero1": "torch DDP + ZeroRedundancyOptimizer"}
    rows = []
    for name, m in med.items():
        ref = pairs.get(name)
        rows.append([name, m * 1e3, (m / med[ref]) if ref else 1.0, ref or "—",
                     statistics.pstdev(times[name]) * 1e3])
    notes = (f"2 gloo workers × {args.threads} thread(s), model `{args.model}`, one {BATCH}×{SEQ} micro-batch per "
             f"step, AdamW, no link emulation; median of {args.rounds} interleaved rounds × "
             f"{args.steps_per_round} steps. Reproduce: `python benchmarks/bench_overhead.py --model {args.model} "
             f"--rounds {args.rounds} --steps-per-round {args.steps_per_round}`.")
    path = write_markdown(f"overhead_{args.model}", "quietsync vs raw PyTorch: step time without link emulation",
                          ["variant", "step ms (median)", "÷ torch counterpart", "counterpart", "spread ms (std)"],
                          rows, notes)
    (RESULTS / f"overhead_{args.model}.json").write_text(json.dumps({"args": vars(args), "times": times,
                                                                      "median": med}, indent=1))
    print(path.read_text())


if __name__ == "__main__":
    main()
