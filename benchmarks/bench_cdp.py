"""CDP benchmark in miniature: activation memory (paper Fig. 4), accuracy of dp / cdp-v1 / cdp-v2 (Tab. 2,
Fig. 3) and communication per time step. Writes benchmarks/results/cdp_*.{md,json,png}.

    PYTHONPATH=src python benchmarks/bench_cdp.py [--quick] [--only memory,accuracy,comm] [--jobs 2]

A part not run keeps its previous results in cdp_results.json (``--only accuracy`` runs alone); ``--quick``
writes to a temporary folder unless ``--out`` is given. The accuracy part is benchmarks/cdp_table2.py.

Activation memory is *measured* (quietsync.activation_memory: autograd's saved tensors, per storage, over
time) on one process running the N micro-batches on the DP timeline (rule dp: lock-step) and on the cyclic
one (rule v2), for a GPT-Neo (8 blocks) and a ViT (8 blocks); per-worker memory = total / N as in the paper.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import cdp_table2  # noqa: E402
from cdp_models import tiny_resnet, tiny_vit  # noqa: E402

import quietsync  # noqa: E402
from quietsync.models import ModelPreset, build_model  # noqa: E402
from quietsync.strategies.cdp.schedule import Schedule  # noqa: E402

OUT = ROOT / "benchmarks" / "results"


def lm_loss(model, batch):
    return model(input_ids=batch, labels=batch).loss


def ce_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def memory_run(kind: str, n: int, rule: str) -> dict:
    if kind == "gpt":
        model = build_model(ModelPreset(hidden_size=64, num_layers=8, num_heads=4, max_positions=64), 128, seed=0)
        batches = [torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(k)) for k in range(4 * n)]
        loss = lm_loss
        segments = 11
    else:
        model = tiny_vit(depth=8, dim=64)
        batches = [(torch.randn(8, 1, 16, 16), torch.randint(0, 10, (8,))) for _ in range(4 * n)]
        loss = ce_loss
        segments = 10
    s = quietsync.make_strategy("cdp", model, torch.optim.SGD,
                                config={"rule": rule, "stages": min(n, segments), "partition": "flops",
                                        "measure_activations": True}, lr=0.01)
    for b in batches:
        s.forward_backward(b, loss)
        s.step()
    tl = s.activation_timeline()
    bal = s.balance()
    s.close()
    steady = tl[2 * n * 2:]  # skip the first two cycles (pipeline fill)
    return {"kind": kind, "n": n, "rule": rule, "peak": max(x.peak for x in steady),
            "timeline": [x.bytes for x in tl], "balance_flops": bal.get("flops_max_over_mean")}


def bench_memory(quick: bool, out: Path) -> dict:
    rows = []
    for kind in ("gpt", "vit"):
        for n in ((2, 4) if quick else (2, 4, 8)):
            dp, cdp = memory_run(kind, n, "dp"), memory_run(kind, n, "v2")
            rows.append({"model": kind, "N": n, "dp_peak_per_worker": dp["peak"] / n,
                         "cdp_peak_per_worker": cdp["peak"] / n, "ratio": cdp["peak"] / dp["peak"],
                         "ideal": (n + 1) / (2 * n), "flops_max_over_mean": cdp["balance_flops"],
                         "dp_timeline": dp["timeline"], "cdp_timeline": cdp["timeline"]})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        for ax, kind in zip(axes, ("gpt", "vit")):
            for r in rows:
                if r["model"] != kind:
                    continue
                n = r["N"]
                k = 2 * n * 3  # three cycles
                line = ax.plot([b / n / 1e6 for b in r["dp_timeline"][2 * n:2 * n + k]], label=f"DP N={n}")[0]
                ax.plot([b / n / 1e6 for b in r["cdp_timeline"][2 * n:2 * n + k]], "--", color=line.get_color(),
                        label=f"CDP N={n}")
            ax.set_title(f"{kind}: activation memory per worker (measured)")
            ax.set_xlabel("time step")
            ax.set_ylabel("MB")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "cdp_memory.png", dpi=110)
    except ImportError:
        pass
    return {"rows": rows}


def bench_accuracy(quick: bool, jobs: int, out: Path, cache: Path | None) -> dict:
    """Paper Tab. 2 / Fig. 3 in fair miniature (benchmarks/cdp_table2.py): same batch per step for every rule,
    lr swept per rule on a validation split, 5 seeds, and the diagnosis of the gap."""
    res = cdp_table2.bench_table2(quick, jobs, cache)
    try:
        cdp_table2.plot(res, out / "cdp_loss.png")
    except ImportError:
        pass
    return res


def bench_comm() -> dict:
    """Bytes each worker sends per time step (from the executor's plan, which the tests check against the
    transport), and the DP all-reduce of the same gradient at the end of the step."""
    rows = []
    model = tiny_resnet()
    from quietsync.models.stages import partition, sequential_view

    for n in (2, 4):
        plan = partition(sequential_view(model), n)
        stage_bytes = [p * 4 for p in plan.params]
        psi = sum(stage_bytes)
        sched = Schedule(n, n, "v2")
        cycles = 6
        per_worker = [sched.bytes_per_step(stage_bytes, w, cycles) for w in range(n)]
        lo, hi = 2 * n * 2, 2 * n * (cycles - 1)  # steady state
        total_per_step = [sum(pw.get(t, 0) for pw in per_worker) for t in range(lo, hi)]
        worst_worker = max(max((pw.get(t, 0) for t in range(lo, hi)), default=0) for pw in per_worker)
        rows.append({"N": n, "psi_bytes": psi,
                     "cdp_bytes_per_cycle_all_workers": sum(total_per_step) / (cycles - 3),
                     "dp_bytes_per_step_all_workers": 2 * (n - 1) * psi,
                     "cdp_largest_burst_one_worker": worst_worker,
                     "dp_burst_one_worker": 2 * (n - 1) * psi // n,
                     "cdp_max_bytes_in_one_time_step_all_workers": max(total_per_step),
                     "cdp_time_steps_with_traffic": sum(1 for b in total_per_step if b) / (cycles - 3),
                     "time_steps_per_cycle": 2 * n})
    return {"rows": rows}


def write_md(res: dict, commands: dict[str, str], out: Path) -> None:
    lines = ["# CDP benchmark (miniature)", "", "Each part was last written by:", ""]
    lines += [f"- {part}: `{cmd}`" for part, cmd in commands.items() if part in res] + [""]
    if "memory" in res:
        lines += ["## Activation memory per worker (measured: autograd saved tensors, one process, total / N)", "",
                  "| model | N | DP peak (MB) | CDP peak (MB) | CDP/DP measured | ideal (N+1)/2N "
                  "| stage FLOPs max/mean |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["memory"]["rows"]:
            lines.append(f"| {r['model']} | {r['N']} | {r['dp_peak_per_worker'] / 1e6:.2f} | "
                         f"{r['cdp_peak_per_worker'] / 1e6:.2f} | {r['ratio']:.3f} | {r['ideal']:.3f} | "
                         f"{r['flops_max_over_mean']:.2f} |")
        lines += ["", "![memory](cdp_memory.png)", ""]
    if "accuracy" in res:
        lines += cdp_table2.markdown(res["accuracy"])
    if "comm" in res:
        lines += ["## Communication (N workers, ResNet, fp32 gradients; from the executor's plan, which the tests "
                  "check against the transport's meter)", "",
                  "| N | Ψ (bytes) | DP bytes/step (all workers, at the end) | CDP bytes/cycle (all workers) | "
                  "DP burst per worker | CDP largest burst per worker | CDP max bytes in one time step (all) | "
                  "time steps with traffic / cycle |", "|---|---|---|---|---|---|---|---|"]
        for r in res["comm"]["rows"]:
            lines.append(f"| {r['N']} | {r['psi_bytes']} | {r['dp_bytes_per_step_all_workers']} | "
                         f"{r['cdp_bytes_per_cycle_all_workers']:.0f} | {r['dp_burst_one_worker']} | "
                         f"{r['cdp_largest_burst_one_worker']} | {r['cdp_max_bytes_in_one_time_step_all_workers']} | "
                         f"{r['cdp_time_steps_with_traffic']:.0f} of {r['time_steps_per_cycle']} |")
        lines.append("")
    (out / "cdp_results.md").write_text("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="a smoke run (written to --out, by default a temp folder)")
    p.add_argument("--only", default="memory,accuracy,comm")
    p.add_argument("--jobs", type=int, default=1, help="processes for the accuracy runs (one thread each)")
    p.add_argument("--cache", type=Path, default=None,
                   help="accuracy runs: a JSON-lines file of finished runs, reused when the same run is asked again")
    p.add_argument("--out", type=Path, default=None,
                   help=f"results folder (default {OUT.relative_to(ROOT)}; with --quick a temp folder)")
    args = p.parse_args()
    parts = args.only.split(",")
    unknown = set(parts) - {"memory", "accuracy", "comm"}
    if unknown:
        p.error(f"--only takes memory, accuracy, comm; got {', '.join(sorted(unknown))}")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    out = args.out or (Path(tempfile.gettempdir()) / "quietsync_cdp_quick" if args.quick else OUT)
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    # parts not run now keep their previous results (so --only accuracy leaves memory and comm in place)
    old = json.loads((out / "cdp_results.json").read_text()) if (out / "cdp_results.json").exists() else {}
    res: dict = {k: v for k, v in old.items() if k not in parts and k != "commands"}
    commands = {k: old.get("commands", {}).get(k, "PYTHONPATH=src python benchmarks/bench_cdp.py")
                for k in res}  # results from before commands were recorded: the full default run
    cmd = "PYTHONPATH=src python benchmarks/bench_cdp.py " + " ".join(sys.argv[1:])
    commands.update({part: cmd.strip() for part in parts})
    if "memory" in parts:
        res["memory"] = bench_memory(args.quick, out)
    if "comm" in parts:
        res["comm"] = bench_comm()
    if "accuracy" in parts:
        res["accuracy"] = bench_accuracy(args.quick, args.jobs, out, args.cache)
    res["commands"] = commands
    (out / "cdp_results.json").write_text(json.dumps(res, indent=1))
    write_md(res, commands, out)
    print((out / "cdp_results.md").read_text())


if __name__ == "__main__":
    main()
