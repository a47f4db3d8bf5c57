"""Golden trajectories: every strategy's parameters after each committed step, for a fixed seed.

Recorded on the code *before* a refactor (issue 7: 8 cases; issue 23, before the by-family move: 11 more, so
every strategy and its main modes are covered) and kept in ``golden/``; the test
``test_golden.py`` replays the same runs and demands bit-identical parameters, so a refactor that changes
numerics (an operation reordered, a division moved) fails loudly.

The workers run Intel MKL in its conditional-numerical-reproducibility mode ``MKL_CBWR=COMPATIBLE`` (:data:`ENV`):
by default MKL picks its matrix-product kernels by the processor's vendor and vector width, so the same code gives
trajectories that differ in the last bits between, say, an Intel and an AMD machine (1e-8 at the first step).
The compatible path is MKL's same-bits-on-every-x86-64-processor mode: checked on an AMD EPYC natively, with MKL
forced onto its Intel kernels, and with torch's own kernels held to AVX2 (``ATEN_CPU_CAPABILITY=avx2``). Other
processors (no MKL) round differently, so there the test is skipped (:data:`PORTABLE`).

Regenerate only when a numerics change is intended and documented::

    python -m tests.strategies.helpers.golden [CASE ...]   # rewrites helpers/golden/<case>.pt (all by default)
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path
from typing import Any

import torch

import quietsync
from tests.strategies.helpers.common import flat_params, loss_fn, micro_batch, param_groups, tiny_model

GOLDEN_DIR = Path(__file__).with_name("golden")
STEPS = 4

CASES: dict[str, dict[str, Any]] = {
    # name -> world, nodes, strategy, config; local_too: also the worker's own parameters after each step
    "ddp": {"world": 2, "strategy": "ddp", "config": {"accumulation": 2}},
    "zero1": {"world": 2, "strategy": "zero1", "config": {"accumulation": 2}},
    "acco": {"world": 2, "strategy": "acco", "config": {"deterministic_accumulation": 2}},
    "dpu": {"world": 2, "strategy": "dpu", "config": {"deterministic_accumulation": 1, "sync_warmup_steps": 1}},
    "wp": {"world": 2, "strategy": "wp", "config": {"deterministic_accumulation": 2}},
    "demo": {"world": 2, "strategy": "demo", "config": {"accumulation": 2, "chunk": 4, "compression": 0.25}},
    "demo_random_adamw": {"world": 2, "strategy": "demo",
                          "config": {"replicator": "random", "base": "adamw", "compression": 0.5}},
    "flexdemo": {"world": 4, "nodes": 2, "strategy": "flexdemo",
                 "config": {"chunk": 4, "compression": 0.25, "params": "replicated"}},
    # added before the by-family move (issue 23): the other four strategies and their main modes
    "flexdemo_fsdp2": {"world": 4, "nodes": 2, "strategy": "flexdemo",
                       "config": {"chunk": 4, "compression": 0.25, "params": "sharded", "base": "adamw"}},
    "fsdp": {"world": 4, "nodes": 2, "strategy": "fsdp", "config": {"accumulation": 2}},
    "localsgd": {"local_too": True, "world": 2, "strategy": "localsgd",
                 "config": {"sync_every": 2, "accumulation": 2, "average_optimizer_state": True}},
    "diloco": {"local_too": True, "world": 2, "strategy": "diloco", "config": {"sync_every": 2}},
    "diloco_streaming": {"local_too": True, "world": 2, "strategy": "diloco",
                         "config": {"sync_every": 2, "fragments": 2, "overlap_delay": 1, "pseudo_grad_dtype": "bf16"}},
    "diloco_zero1_int8": {"local_too": True, "world": 4, "nodes": 2, "strategy": "diloco",
                          "config": {"sync_every": 2, "inner": "zero1", "pseudo_grad_dtype": "int8"}},
    "diloco_ddp_replicator": {"local_too": True, "world": 4, "nodes": 2, "strategy": "diloco",
                              "config": {"sync_every": 2, "inner": "ddp", "pseudo_grad_replicator": "random",
                                         "compression": 0.5}},
    "cdp_v2": {"world": 2, "strategy": "cdp", "config": {"rule": "v2", "stages": 2}},
    "cdp_v1": {"world": 2, "strategy": "cdp", "config": {"rule": "v1", "stages": 2}},
    "cdp_one_process": {"world": 1, "strategy": "cdp", "config": {"rule": "v2", "stages": 2}},
}
PORTABLE = platform.machine().lower() in ("x86_64", "amd64")
"""Whether the recorded bits can be reproduced here: an x86-64 processor, where torch multiplies with MKL."""
ENV = {"MKL_CBWR": "COMPATIBLE"}
"""The workers' environment: MKL's processor-independent code path (read by MKL at its first call in a worker)."""
OPT = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


def lr_schedule(step: int) -> float:
    return 1.0 / (1.0 + 0.5 * step)


def mkl_branch() -> int | None:
    """The code path MKL runs in this process (``mkl_cbwr_get``: 3 is COMPATIBLE), or None where torch exposes no
    MKL (another processor, another build)."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        get = ctypes.CDLL(str(lib)).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    torch.ones(2, 2) @ torch.ones(2, 2)  # MKL settles its path at its first call
    return int(get(1))  # 1: MKL_CBWR_BRANCH


def trajectory(rank: int, world: int, case: str) -> list[torch.Tensor]:
    """Worker body: the committed parameters after each of ``STEPS`` steps (micro-batches fed one by one)."""
    branch = mkl_branch()
    if branch not in (None, 3):  # MKL started before MKL_CBWR reached this worker: the bits would be the machine's
        raise RuntimeError(f"MKL runs code path {branch}, not COMPATIBLE (3): {ENV} came too late for this worker")
    spec = CASES[case]
    model = tiny_model()
    strategy = quietsync.make_strategy(spec["strategy"], model, torch.optim.AdamW, param_groups=param_groups(model),
                                       config=dict(spec["config"]), lr_schedule=lr_schedule, **OPT)
    out: list[torch.Tensor] = []
    index = 0
    while strategy.steps < STEPS:
        strategy.forward_backward(micro_batch(0, rank, index), loss_fn)
        index += 1
        if strategy.step():
            with strategy.committed_params() as m:
                out.append(flat_params(m))
            if spec.get("local_too"):  # between syncs the worker's own θ moves too
                out.append(flat_params(strategy.module))
    strategy.close()
    return out


def run_case(case: str) -> list[list[torch.Tensor]]:
    from tests.distributed import run_ranks

    spec = CASES[case]
    return run_ranks(trajectory, spec["world"], case, nodes=spec.get("nodes"), timeout=120, env=ENV)


def main(cases: list[str] | None = None) -> None:
    GOLDEN_DIR.mkdir(exist_ok=True)
    for case in cases or CASES:
        result = run_case(case)
        torch.save({"torch": str(torch.__version__), "steps": STEPS, "by_rank": result}, GOLDEN_DIR / f"{case}.pt")
        print(f"{case}: {len(result)} ranks x {len(result[0])} steps")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
