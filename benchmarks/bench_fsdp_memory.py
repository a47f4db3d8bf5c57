"""Memory per worker of flexdemo (flat substrate vs FSDP2), fsdp and zero1, measured, against the formulas.

Builds the trainer's GPT-Neo (2 blocks, vocabulary 4096) at several widths on 4 local gloo workers laid out
as 2 nodes x 2 workers and as 1 node x 4 workers, runs two committed steps of each strategy (AdamW; flexdemo
with ``--base adamw`` so every strategy keeps Adam moments) and counts, on every worker, the bytes of every
distinct tensor storage alive in the process at the step's peak (after the last backward, before the
optimizer step, and again after it; the larger is kept): parameters (FSDP2's padded shards, or whole
parameters), gradients, the fp32 master shard, optimizer state and decoupled momentum. Transient buffers
inside forward/backward (activations, FSDP2's per-unit all-gathered parameters and unsharded gradients) are
not in it. Writes ``results/fsdp_memory.md`` (+ ``.json``): bytes per parameter next to the formula, and the
largest width whose measured state fits a per-worker cap.

    python benchmarks/bench_fsdp_memory.py [--widths 128 256 384 512] [--cap-mib 24]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import RESULTS, write_markdown  # noqa: E402

CASES = {  # label -> (strategy, config)
    "zero1": ("zero1", {}),
    "fsdp": ("fsdp", {}),
    "flexdemo replicated (flat)": ("flexdemo", {"params": "replicated", "base": "adamw"}),
    "flexdemo sharded (FSDP2)": ("flexdemo", {"params": "sharded", "base": "adamw"}),
}


def formula(label: str, n_node: int, n_world: int) -> float:
    """Bytes per parameter in fp32: whole buffers cost 4, a buffer sharded over k workers 4/k."""
    if label == "zero1":  # params + flat grads + (grad shard, master, m, v) over the world
        return 4 + 4 + 16 / n_world
    if label == "fsdp":  # (param, grad, m, v) shards inside the node
        return 16 / n_node
    if label.startswith("flexdemo replicated"):  # params + grads + (grad shard, master, delta, m, v) / node
        return 4 + 4 + 20 / n_node
    return 20 / n_node  # flexdemo sharded: (param, grad, delta, m, v) shards inside the node


def _storages() -> dict[int, int]:
    """``{storage pointer: bytes}`` of every live tensor the garbage collector sees (DTensors via their shard),
    after a collection (so the previous strategy is gone and no cycle's garbage counts)."""
    import gc

    import torch

    gc.collect()  # live tensors only, not garbage waiting in reference cycles
    seen: dict[int, int] = {}

    def add(t: object) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        local = getattr(t, "_local_tensor", None)
        if local is not None:
            add(local)
            return
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()

    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            add(obj)
            if isinstance(obj, torch.nn.Parameter) and obj.grad is not None:
                add(obj.grad)  # gradients live in autograd, not always as Python objects
    return seen


def _measure(rank: int, world: int, widths: list[int]) -> dict:
    import torch

    import quietsync
    from quietsync.models import ModelPreset, build_model, count_parameters

    torch.set_num_threads(1)
    out: dict = {}
    for width in widths:
        preset = ModelPreset(hidden_size=width, num_layers=2, num_heads=4, max_positions=64)
        for label, (name, config) in CASES.items():
            base = _storages()
            model = build_model(preset, 4096, seed=0)
            psi = count_parameters(model)
            strategy = quietsync.make_strategy(name, model, torch.optim.AdamW, config=config, lr=1e-3)
            x = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(rank))
            peak = 0
            for _ in range(2):
                strategy.backward(strategy.model(input_ids=x, labels=x).loss)
                before = _storages()
                strategy.step()
                after = _storages()
                peak = max(peak, *(sum(v for k, v in s.items() if k not in base) for s in (before, after)))
            out.setdefault(label, {})[width] = {"psi": psi, "bytes": peak}
            strategy.close()
            del strategy, model
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[128, 256, 384, 512])
    ap.add_argument("--cap-mib", type=float, default=24.0, help="per-worker memory cap for the largest width")
    args = ap.parse_args()
    from tests.distributed import run_ranks

    world = 4
    results = {}
    for nodes in (2, 1):
        per_rank = run_ranks(_measure, world, args.widths, nodes=nodes, timeout=1200)
        results[f"{nodes}x{world // nodes}"] = {
            label: {w: {"psi": per_rank[0][label][w]["psi"],
                        "bytes_max_worker": max(r[label][w]["bytes"] for r in per_rank)}
                    for w in args.widths} for label in CASES}
    cap = args.cap_mib * 2**20
    rows = []
    for layout, by_label in results.items():
        nodes, per_node = (int(v) for v in layout.split("x"))
        for label, by_width in by_label.items():
            big = by_width[max(args.widths)]
            fits = [w for w in args.widths if by_width[w]["bytes_max_worker"] <= cap]
            rows.append([layout, label, big["bytes_max_worker"] / big["psi"], formula(label, per_node, world),
                         big["bytes_max_worker"] / 2**20, max(fits) if fits else "none"])
    widest = max(args.widths)
    psi = results["2x2"]["zero1"][widest]["psi"]
    path = write_markdown(
        "fsdp_memory", "Memory per worker: flexdemo flat vs FSDP2, fsdp, zero1 (4 workers, AdamW state)",
        ["nodes x workers", "strategy", f"measured bytes / parameter (width {widest})", "formula",
         f"MiB per worker (width {widest}, Ψ = {psi:,})", f"largest width under {args.cap_mib:g} MiB"],
        rows,
        notes=("Measured: the bytes of every distinct tensor storage alive on the worker at the step's peak "
               "(the most loaded worker), divided by Ψ; FSDP2 counts its padded shards. Formula (fp32, n = "
               "workers per node, N = 4 workers): zero1 4+4+16/N (whole parameters and flat gradients; grad "
               "shard, master, m, v over the world); fsdp 16/n; flexdemo flat 4+4+20/n (whole parameters and "
               "gradients; grad shard, master, momentum δ, m, v per node); flexdemo FSDP2 20/n (parameters, "
               "gradients, δ, m, v sharded per node). Transient buffers of forward/backward (activations, one "
               "FSDP2 unit's gathered parameters and unsharded gradients) are not counted. Widths tried: "
               f"{', '.join(map(str, args.widths))} (GPT-Neo, 2 blocks, vocabulary 4096, tied embeddings). "
               "Reproduce: `python benchmarks/bench_fsdp_memory.py`."),
    )
    (RESULTS / "fsdp_memory.json").write_text(json.dumps(results, indent=2))
    print(path.read_text())


if __name__ == "__main__":
    main()
