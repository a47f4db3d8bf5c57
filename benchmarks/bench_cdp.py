"""CDP benchmark in miniature: activation memory (paper Fig. 4), accuracy of dp / cdp-v1 / cdp-v2 (Tab. 2,
Fig. 3) and communication per time step. Writes benchmarks/results/cdp_*.{md,json,png}.

    PYTHONPATH=src python benchmarks/bench_cdp.py [--quick] [--only memory,accuracy,comm]

Activation memory is *measured* (quietsync.activation_memory: autograd's saved tensors, per storage, over
time) on one process running the N micro-batches on the DP timeline (rule dp: lock-step) and on the cyclic
one (rule v2), for a GPT-Neo (8 blocks) and a ViT (8 blocks); per-worker memory = total / N as in the paper.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "src"))

from cdp_models import synthetic_digits, tiny_resnet, tiny_vit  # noqa: E402

import quietsync  # noqa: E402
from quietsync.strategies.cdp.schedule import Schedule  # noqa: E402
from quietsync.train.model import ModelPreset, build_model  # noqa: E402

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


def bench_memory(quick: bool) -> dict:
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
        fig.savefig(OUT / "cdp_memory.png", dpi=110)
    except ImportError:
        pass
    return {"rows": rows}


def bench_accuracy(quick: bool) -> dict:
    n, micro, epochs = 4, 16, (2 if quick else 6)
    xtr, ytr = synthetic_digits(1024 if quick else 2048, seed=1)
    xte, yte = synthetic_digits(1000, seed=2)
    per_step = n * micro
    steps_per_epoch = len(xtr) // per_step
    total = epochs * steps_per_epoch
    milestones = [int(total * 0.5), int(total * 0.75)]

    def schedule(step: int) -> float:
        return 0.2 ** sum(step >= m for m in milestones)

    results: dict = {}
    for rule in ("dp", "v1", "v2"):
        for seed in (0, 1, 2):
            model = tiny_resnet(seed=seed)
            s = quietsync.make_strategy("cdp", model, torch.optim.SGD,
                                        config={"rule": rule, "stages": n, "partition": "flops"},
                                        lr_schedule=schedule, lr=0.05, momentum=0.9, weight_decay=5e-4)
            g = torch.Generator().manual_seed(100 + seed)
            curve, k = [], 0
            order = torch.randperm(len(xtr), generator=g)
            t0 = time.perf_counter()
            while s.steps < total:
                if (k + 1) * micro > len(order):
                    order, k = torch.randperm(len(xtr), generator=g), 0
                idx = order[k * micro:(k + 1) * micro]
                k += 1
                loss = s.forward_backward((xtr[idx], ytr[idx]), ce_loss)
                if loss is not None:
                    curve.append(float(loss))
                s.step()
            with torch.no_grad(), s.committed_params() as m:
                acc = (m(xte).argmax(1) == yte).float().mean().item() * 100
            s.close()
            results.setdefault(rule, []).append({"seed": seed, "acc": acc, "curve": curve,
                                                 "seconds": time.perf_counter() - t0})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        for rule, runs in results.items():
            length = min(len(r["curve"]) for r in runs)
            mean = [statistics.mean(r["curve"][t] for r in runs) for t in range(length)]
            w = 16
            smooth = [statistics.mean(mean[max(0, t - w):t + 1]) for t in range(length)]
            ax.plot(smooth, label={"dp": "DP", "v1": "CDP-v1", "v2": "CDP-v2"}[rule])
        ax.set_xlabel("micro-batch")
        ax.set_ylabel("training loss (3 seeds, smoothed)")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(OUT / "cdp_loss.png", dpi=110)
    except ImportError:
        pass
    return {"setup": {"stages": n, "micro_batch": micro, "epochs": epochs, "steps": total, "train": len(xtr),
                      "test": len(xte), "lr": 0.05, "decay": "x0.2 at 50%, 75%", "momentum": 0.9,
                      "weight_decay": 5e-4},
            "runs": results}


def bench_comm() -> dict:
    """Bytes each worker sends per time step (from the executor's plan, which the tests check against the
    transport), and the DP all-reduce of the same gradient at the end of the step."""
    rows = []
    model = tiny_resnet()
    from quietsync.strategies.cdp.stages import partition, sequential_view

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


def write_md(res: dict, seconds: float, argv: list[str]) -> None:
    lines = ["# CDP benchmark (miniature)", "", f"`PYTHONPATH=src python benchmarks/bench_cdp.py {' '.join(argv)}`"
             f" — {seconds:.0f} s on this machine (CPU).", ""]
    if "memory" in res:
        lines += ["## Activation memory per worker (measured: autograd saved tensors, one process, total / N)", "",
                  "| model | N | DP peak (MB) | CDP peak (MB) | CDP/DP measured | ideal (N+1)/2N | stage FLOPs max/mean |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["memory"]["rows"]:
            lines.append(f"| {r['model']} | {r['N']} | {r['dp_peak_per_worker'] / 1e6:.2f} | "
                         f"{r['cdp_peak_per_worker'] / 1e6:.2f} | {r['ratio']:.3f} | {r['ideal']:.3f} | "
                         f"{r['flops_max_over_mean']:.2f} |")
        lines += ["", "![memory](cdp_memory.png)", ""]
    if "accuracy" in res:
        a = res["accuracy"]
        st = a["setup"]
        lines += ["## Accuracy (paper Tab. 2 in miniature)", "",
                  f"tiny ResNet on the offline synthetic digits ({st['train']} train / {st['test']} test), "
                  f"{st['stages']} stages = micro-batches of {st['micro_batch']}, SGD momentum 0.9, lr 0.05 "
                  f"{st['decay']}, wd 5e-4, {st['steps']} steps ({st['epochs']} epochs), 3 seeds.", "",
                  "| rule | test accuracy % (mean ± std) | first-third train loss | last-third train loss |",
                  "|---|---|---|---|"]
        for rule, runs in a["runs"].items():
            accs = [r["acc"] for r in runs]
            length = min(len(r["curve"]) for r in runs)
            early = statistics.mean(statistics.mean(r["curve"][:length // 3]) for r in runs)
            late = statistics.mean(statistics.mean(r["curve"][-length // 3:]) for r in runs)
            lines.append(f"| {rule} | {statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f} | {early:.3f} | "
                         f"{late:.3f} |")
        lines += ["", "![loss](cdp_loss.png)", ""]
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
    (OUT / "cdp_results.md").write_text("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="memory,accuracy,comm")
    args = p.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res: dict = {}
    parts = args.only.split(",")
    if "memory" in parts:
        res["memory"] = bench_memory(args.quick)
    if "comm" in parts:
        res["comm"] = bench_comm()
    if "accuracy" in parts:
        res["accuracy"] = bench_accuracy(args.quick)
    (OUT / "cdp_results.json").write_text(json.dumps(res, indent=1))
    write_md(res, time.perf_counter() - t0, sys.argv[1:])
    print((OUT / "cdp_results.md").read_text())


if __name__ == "__main__":
    main()
