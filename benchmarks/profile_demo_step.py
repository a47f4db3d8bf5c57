"""Where a DeMo-SGD step's time goes: ``torch.profiler`` of the optimizer step alone, in one process.

The collective is faked (a replicate group of two whose peer sends this worker's own payload), so the table
holds the codec's own work only: momentum update, transforms, top-k, error feedback, packing, the
per-coefficient mean, decode, sign and apply. One thread, the ``10m`` preset (vocabulary 4096), one 8×128
micro-batch; prints step ÷ forward+backward (medians of ``--steps``) and writes the table of three profiled
steps to ``results/demo_step_profile_<model>_<replicator>.txt``.

    python benchmarks/profile_demo_step.py [--model 10m] [--replicator dct] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import RESULTS  # noqa: E402


class _Pair:
    """A replicate group of two whose peer sends what this worker sends."""

    def group_size(self, group: str) -> int:
        return 2

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: str, **_: Any) -> None:
        out.view(2, -1).copy_(inp.expand(2, -1))

    def all_reduce(self, t: torch.Tensor, group: str, op: str = "sum", **_: Any) -> None:
        if op == "sum":
            t.mul_(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="10m", choices=["tiny", "default", "10m"])
    ap.add_argument("--replicator", default="dct", choices=["dct", "random", "striding"])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from torch.profiler import ProfilerActivity, profile

    from quietsync.models import build_model
    from quietsync.optim import DeMoSGD

    model = build_model(args.model, 4096, seed=0)
    opt = DeMoSGD(model.parameters(), lr=1e-4, replicator=args.replicator, transport=_Pair(), group="world",
                  replicator_kwargs={"compression": 1 / 32, "chunk": 64})
    batch = torch.randint(0, 4096, (8, 128), generator=torch.Generator().manual_seed(0))

    def fwd_bwd() -> None:
        opt.zero_grad(set_to_none=False)
        model(input_ids=batch, labels=batch).loss.backward()

    for _ in range(2):
        fwd_bwd()
        opt.step()
    fb, st = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        fwd_bwd()
        t1 = time.perf_counter()
        opt.step()
        st.append(time.perf_counter() - t1)
        fb.append(t1 - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            opt.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    f, s = statistics.median(fb), statistics.median(st)
    head = (f"{args.model} {args.replicator}: forward+backward {f * 1e3:.0f} ms, step {s * 1e3:.0f} ms, "
            f"step ÷ forward+backward {s / f:.3f} (medians of {args.steps}; one process, one thread, collective "
            f"faked)\n\nReproduce: `python benchmarks/profile_demo_step.py --model {args.model} --replicator "
            f"{args.replicator} --steps {args.steps}`\n\nProfile of 3 steps (the step's own self time is NumPy's "
            "top-k and Python):\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"demo_step_profile_{args.model}_{args.replicator}.txt"
    out.write_text(head + table + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
