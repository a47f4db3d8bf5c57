"""Where a DeMo-SGD ``dct`` step's CPU time goes: each phase, and inside them the transforms, the top-k, block moves
and packing, in one process (one thread), the collective faked.

The faked replicate group of two hands back, as the peer's payload, this worker's payload of the step before, so
the peer sent other coefficients than this worker (some coefficients come from one worker, some from both, as
between real workers). CPU time of the thread (``time.thread_time``), so other work on a shared machine inflates it
far less than wall time; reported: the fastest and the median of ``--steps`` steps, in ms and ÷ the median
forward+backward.

    python benchmarks/demo_step_breakdown.py [--model 10m] [--steps 8]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


class _PreviousPayload:
    """A replicate group of two whose peer sends this worker's payload of the previous step."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None

    def group_size(self, group: str) -> int:
        return 2

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group: str, **_: Any) -> None:
        both = out.view(2, -1)
        both[0].copy_(inp)
        same = self.previous is not None and self.previous.numel() == inp.numel()
        both[1].copy_(self.previous if same else inp)
        self.previous = inp.clone()


def _timed(owner: Any, name: str, label: str, into: dict[str, float], static: bool = False) -> None:
    """Wrap ``owner.name`` so that its CPU time adds to ``into[label]``."""
    fn = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        out = fn(*args, **kwargs)
        into[label] += time.thread_time() - t0
        return out
    setattr(owner, name, staticmethod(timed) if static else timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="10m", choices=["tiny", "default", "10m"])
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import quietsync.wire.replicators.dct as dct
    from quietsync.models import build_model
    from quietsync.optim import DeMoSGD
    from quietsync.wire.codecs import BlockLayout

    parts: dict[str, float] = collections.defaultdict(float)
    _timed(dct, "topk_picks", "top-k", parts)
    _timed(dct, "_accumulate_rows", "transforms", parts)
    _timed(dct, "_inverse_rows", "transforms", parts)
    _timed(BlockLayout, "transform", "transforms", parts, static=True)
    for name in ("tile_scatter", "tile_gather"):
        _timed(BlockLayout, name, "block moves", parts)
    for name in ("pack", "unpack"):
        _timed(dct, name, "pack/unpack", parts)
    model = build_model(args.model, 4096, seed=0)
    opt = DeMoSGD(model.parameters(), lr=1e-4, replicator="dct", transport=_PreviousPayload(), group="world",
                  replicator_kwargs={"compression": 1 / 32, "chunk": 64})
    batch = torch.randint(0, 4096, (8, 128), generator=torch.Generator().manual_seed(0))
    fbs: list[float] = []
    seen: dict[str, list[float]] = collections.defaultdict(list)
    for i in range(args.steps + 2):  # two warm-up steps
        model.zero_grad(set_to_none=False)
        t0 = time.thread_time()
        model(input_ids=batch, labels=batch).loss.backward()
        fbs.append(time.thread_time() - t0)
        parts.clear()
        with torch.no_grad():
            clock = [time.thread_time()]
            step = opt.begin_step()
            opt.momentum(step)
            clock.append(time.thread_time())
            q = opt.extract(step)
            clock.append(time.thread_time())
            update = opt.exchange(step, q)
            clock.append(time.thread_time())
            opt.apply(step, update)
            clock.append(time.thread_time())
        if i >= 2:
            phases = dict(zip(("momentum", "extract", "exchange", "apply"), (b - a for a, b in zip(clock, clock[1:]))))
            for key, value in {**phases, "step": clock[-1] - clock[0], **parts}.items():
                seen[key].append(value)
    fb = statistics.median(fbs[2:])
    print(f"{args.model} dct, one thread, CPU time: forward+backward median {fb * 1e3:.0f} ms")
    for key, values in seen.items():
        best, mid = min(values), statistics.median(values)
        print(f"  {key:12s} fastest {best * 1e3:6.1f} ms ({best / fb:.3f}x)   "
              f"median {mid * 1e3:6.1f} ms ({mid / fb:.3f}x)")


if __name__ == "__main__":
    main()
