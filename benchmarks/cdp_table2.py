"""Paper 002's Table 2 and Fig. 3 in fair miniature: dp, CDP-v1 and CDP-v2 trained alike, lr swept per rule.

Every run is ``quietsync.make_strategy("cdp", ...)`` on one process (world 1, ``stages`` = N), which runs the
same update rules as the N-worker ring. All rules see the **same batch per step** (N micro-batches, step ``c``
uses micro-batches ``cN … cN+N−1`` of one seeded order, the same for every rule), the same model init, a linear
**warm-up** and the paper's step decay (×0.2 at 30%, 60%, 90% of training), SGD momentum 0.9, weight decay
5e-4. The data: the offline synthetic digits of ``examples/cdp_models.py`` with more noise (0.5) than the
example's, so a converged tiny ResNet sits near 90% (noise 0.3 gives 99.9% to every reasonable run).

1. **lr sweep** per rule on a held-out validation split (the sweep seed differs from the final seeds);
   each rule's lr = best validation accuracy.
2. **final**: each rule at its lr, ≥ 5 seeds; test accuracy and loss, training loss (whole training set,
   committed parameters) mean ± std, and the per-step training loss (mean of the step's N micro-batch losses,
   as the paper plots it) for Fig. 3.
3. **diagnosis** of any gap: twice the steps at the chosen lr (is it convergence?); the paper's schedule
   (no warm-up, lr 0.05); momentum 0 at ten times the lr (same effective lr ``η/(1−β)``); the sharpness
   ``λ`` (top Hessian eigenvalue, whole model and per stage) along one run per rule, as ``η·λ`` against the
   stable limits of :mod:`delay_stability`.

Runs are deterministic (one thread each) and independent, so they can go to ``jobs`` processes.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "examples", ROOT / "src", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import delay_stability  # noqa: E402
from cdp_models import synthetic_digits, tiny_resnet  # noqa: E402

import quietsync  # noqa: E402

RULES = ("dp", "v1", "v2")
LABEL = {"dp": "DP", "v1": "CDP-v1", "v2": "CDP-v2"}


@dataclass(frozen=True)
class Setup:
    """One miniature of the paper's CIFAR-10 set-up."""

    stages: int = 4
    """N: stages = micro-batches per step (the paper: 4)."""
    micro_batch: int = 16
    """Samples per micro-batch; the batch per step is ``stages × micro_batch`` for every rule."""
    steps: int = 4000
    """Committed optimizer steps per run (62 epochs of the training set)."""
    train: int = 4096
    val: int = 4000
    test: int = 10000
    noise: float = 0.5
    """Pixel noise of the synthetic digits (examples/cdp_models.py)."""
    warmup: float = 0.05
    """Linear warm-up over this fraction of the steps (the paper has none)."""
    milestones: tuple[float, ...] = (0.3, 0.6, 0.9)
    """lr × ``decay`` at these fractions of the steps (the paper: epochs 30, 60, 90 of 100)."""
    decay: float = 0.2
    momentum: float = 0.9
    weight_decay: float = 5e-4
    lrs: tuple[float, ...] = (0.0125, 0.025, 0.05, 0.1, 0.2)
    """The lr grid swept for every rule."""
    extend: int = 2
    """How many times a rule's grid may grow by one lr (×2 or ÷2) when its best lr is at an end."""
    momentum0_lrs: tuple[float, ...] = (0.25,)
    """The diagnosis with momentum 0 (10× the momentum-0.9 lrs keeps the effective lr η/(1−β))."""
    sweep_seeds: tuple[int, ...] = (100,)
    final_seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    sharpness_at: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.3, 0.6, 1.0)
    """Fractions of the steps at which the diagnosis run measures the sharpness."""
    sharpness_samples: int = 256
    sharpness_iters: int = 12

    def lr_multiplier(self, step: int, warmup: bool = True) -> float:
        w = max(1, round(self.warmup * self.steps))
        warm = min(1.0, (step + 1) / w) if warmup else 1.0
        return warm * self.decay ** sum(step >= round(m * self.steps) for m in self.milestones)


QUICK = Setup(steps=120, train=1024, val=1000, test=1000, lrs=(0.0125, 0.05), momentum0_lrs=(0.25,),
              sweep_seeds=(100,), final_seeds=(0, 1), sharpness_at=(0.5, 1.0), sharpness_iters=4,
              sharpness_samples=64)


@dataclass(frozen=True)
class Job:
    """One training run."""

    rule: str
    lr: float
    seed: int
    setup: Setup
    split: str = "val"
    """Which held-out split the run is scored on at the end: ``val`` (sweep) or ``test`` (final)."""
    momentum: float | None = None
    """Overrides ``setup.momentum``."""
    steps: int | None = None
    """Overrides ``setup.steps`` (the schedule stretches with it)."""
    warmup: bool = True
    sharpness: bool = False
    tag: str = ""
    """Which part of the benchmark the run belongs to."""
    extra: dict = field(default_factory=dict)


_DATA: dict[Setup, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}


def data(setup: Setup) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Train / validation / test splits: independent draws (seeds 1, 3, 2) of the same distribution."""
    key = replace(setup, lrs=(), sweep_seeds=(), final_seeds=(), sharpness_at=())
    if key not in _DATA:
        _DATA[key] = {"train": synthetic_digits(setup.train, seed=1, noise=setup.noise),
                      "val": synthetic_digits(setup.val, seed=3, noise=setup.noise),
                      "test": synthetic_digits(setup.test, seed=2, noise=setup.noise)}
    return _DATA[key]


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy %, mean cross-entropy) in chunks."""
    correct, total = 0, 0.0
    with torch.no_grad():
        for lo in range(0, len(x), 1000):
            out = model(x[lo:lo + 1000])
            correct += int((out.argmax(1) == y[lo:lo + 1000]).sum())
            total += float(torch.nn.functional.cross_entropy(out, y[lo:lo + 1000], reduction="sum"))
    return 100.0 * correct / len(x), total / len(x)


def top_eigenvalue(model: torch.nn.Module, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                   iters: int, seed: int) -> float:
    """Largest-magnitude eigenvalue of the Hessian of the loss on ``(x, y)`` w.r.t. ``params`` (the block of
    the Hessian for those parameters), by power iteration on Hessian-vector products."""
    loss = torch.nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    g = torch.Generator().manual_seed(seed)
    v = [torch.randn(p.shape, generator=g) for p in params]
    lam = 0.0
    for _ in range(iters):
        norm = math.sqrt(sum(float((u * u).sum()) for u in v))
        v = [u / norm for u in v]
        hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True)
        lam = sum(float((h * u).sum()) for h, u in zip(hv, v))
        v = [h.detach() for h in hv]
    return lam


def train_run(job: Job) -> dict[str, Any]:
    """Train one model with ``job``'s rule; returns its per-step training loss and end-of-run scores."""
    torch.set_num_threads(1)
    setup = job.setup
    steps = job.steps or setup.steps
    sched = replace(setup, steps=steps)
    momentum = setup.momentum if job.momentum is None else job.momentum
    n, micro = setup.stages, setup.micro_batch
    d = data(setup)
    xtr, ytr = d["train"]
    model = tiny_resnet(seed=job.seed)
    s = quietsync.make_strategy(
        "cdp", model, torch.optim.SGD, config={"rule": job.rule, "stages": n, "partition": "flops"},
        lr_schedule=lambda step: sched.lr_multiplier(step, job.warmup),
        lr=job.lr, momentum=momentum, weight_decay=setup.weight_decay)
    losses: dict[int, float] = {}

    def loss_fn(m: torch.nn.Module, batch: tuple) -> torch.Tensor:
        x, y, k = batch
        loss = torch.nn.functional.cross_entropy(m(x), y)
        losses[k] = float(loss.detach())
        return loss

    g = torch.Generator().manual_seed(1000 + job.seed)  # the data order: the same for every rule
    order, pos, fed = torch.randperm(len(xtr), generator=g), 0, 0
    checks = sorted({max(1, round(f * steps)) for f in setup.sharpness_at}) if job.sharpness else []
    sharp: list[dict] = []
    stage_names = None
    while s.steps < steps:
        if pos + micro > len(order):
            order, pos = torch.randperm(len(xtr), generator=g), 0
        idx = order[pos:pos + micro]
        pos += micro
        s.forward_backward((xtr[idx], ytr[idx], fed), loss_fn)
        fed += 1
        if s.step() and checks and s.steps == checks[0]:
            checks.pop(0)
            if stage_names is None:
                stage_names = s.balance()["stages"]
            sharp.append(_sharpness(s, model, stage_names, sched, job, xtr, ytr))
    curve = [sum(losses[c * n + i] for i in range(n)) / n for c in range(steps)]
    with s.committed_params() as m:
        score = evaluate(m, *d[job.split])
        train_acc, train_loss = evaluate(m, xtr, ytr)
    s.close()
    diverged = not math.isfinite(curve[-1]) or not math.isfinite(score[1])
    return {"rule": job.rule, "lr": job.lr, "seed": job.seed, "momentum": momentum, "steps": steps,
            "warmup": job.warmup, "tag": job.tag, "split": job.split, "acc": score[0], "loss": score[1],
            "train_acc": train_acc, "train_loss": train_loss, "curve": curve, "sharpness": sharp,
            "diverged": diverged}


def _sharpness(s: Any, model: torch.nn.Module, stage_names: list[list[str]], sched: Setup, job: Job,
               xtr: torch.Tensor, ytr: torch.Tensor) -> dict[str, Any]:
    """λ of the whole model and of each stage's diagonal Hessian block at θ_steps, on a fixed training
    sample; ``eta`` is the lr the next update uses."""
    setup = job.setup
    x, y = xtr[:setup.sharpness_samples], ytr[:setup.sharpness_samples]
    children = dict(model.named_children())
    with s.committed_params() as m:
        params = [p for p in m.parameters() if p.requires_grad]
        whole = top_eigenvalue(m, params, x, y, setup.sharpness_iters, seed=s.steps)
        per_stage = []
        for names in stage_names:
            ps = [p for name in names for p in children[name].parameters() if p.requires_grad]
            per_stage.append(top_eigenvalue(m, ps, x, y, setup.sharpness_iters, seed=s.steps))
    eta = job.lr * sched.lr_multiplier(s.steps, job.warmup)
    return {"step": s.steps, "eta": eta, "lambda": whole, "lambda_stage": per_stage}


def job_key(job: Job) -> str:
    """A run's identity (everything that determines its result, not the benchmark's plan) as a string."""
    setup = replace(job.setup, lrs=(), momentum0_lrs=(), sweep_seeds=(), final_seeds=(), extend=0)
    if not job.sharpness:
        setup = replace(setup, sharpness_at=(), sharpness_samples=0, sharpness_iters=0)
    return json.dumps(asdict(replace(job, setup=setup)), sort_keys=True)


def run_jobs(jobs: list[Job], workers: int, cache: Path | None = None) -> list[dict[str, Any]]:
    """Run ``jobs`` on ``workers`` processes; results in the order of ``jobs``. With ``cache`` (a JSON-lines
    file), runs already recorded there under the same :func:`job_key` are read back instead of rerun, and
    every finished run is appended (the runs are deterministic, so this only saves time)."""
    done: dict[str, dict[str, Any]] = {}
    if cache is not None and cache.exists():
        for line in cache.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["key"]] = rec["result"]
    todo = [j for j in jobs if job_key(j) not in done]
    pool = multiprocessing.get_context("spawn").Pool(workers) if workers > 1 and len(todo) > 1 else None
    try:
        results = pool.imap_unordered(_run_keyed, todo) if pool else map(_run_keyed, todo)
        for k, (key, result) in enumerate(results, 1):
            done[key] = result
            print(f"[cdp accuracy] {k}/{len(todo)}: {result['tag']} {result['rule']} lr {result['lr']:g} "
                  f"momentum {result['momentum']:g} seed {result['seed']} steps {result['steps']}: "
                  f"{result['split']} accuracy {result['acc']:.2f}", file=sys.stderr, flush=True)
            if cache is not None:
                with cache.open("a") as f:
                    f.write(json.dumps({"key": key, "result": result}) + "\n")
    finally:
        if pool:
            pool.close()
            pool.join()
    return [done[job_key(j)] for j in jobs]


def _run_keyed(job: Job) -> tuple[str, dict[str, Any]]:
    return job_key(job), train_run(job)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def bench_table2(quick: bool, workers: int = 1, cache: Path | None = None) -> dict[str, Any]:
    """The sweep, the final runs and the diagnosis; returns everything the report and plot need."""
    setup = QUICK if quick else Setup()
    sweep_jobs = [Job(r, lr, seed, setup, "val", tag="sweep") for r in RULES for lr in setup.lrs
                  for seed in setup.sweep_seeds]
    seed = setup.final_seeds[0]
    # the diagnosis that does not depend on the chosen lrs runs alongside the sweep
    diag_jobs = [Job(r, 0.05, seed, setup, "test", warmup=False, tag="paper_schedule") for r in RULES]
    diag_jobs += [Job(r, lr, setup.sweep_seeds[0], setup, "val", momentum=0.0, tag="momentum0")
                  for r in RULES for lr in setup.momentum0_lrs]
    first = run_jobs(sweep_jobs + diag_jobs, workers, cache)
    sweep = first[:len(sweep_jobs)]
    # a rule whose best lr is at an end of its grid gets the next lr (×2 or ÷2) until the best is inside
    for _ in range(setup.extend):
        more = []
        for rule in RULES:
            tried = sorted({x["lr"] for x in sweep if x["rule"] == rule})
            best = best_lr(sweep, rule)
            nxt = best * 2 if best == tried[-1] else best / 2 if best == tried[0] else None
            if nxt is not None:
                more += [Job(rule, nxt, sd, setup, "val", tag="sweep") for sd in setup.sweep_seeds]
        if not more:
            break
        sweep += run_jobs(more, workers, cache)
    chosen = {rule: best_lr(sweep, rule) for rule in RULES}
    final_jobs = [Job(r, chosen[r], sd, setup, "test", tag="final", sharpness=(sd == seed))
                  for r in RULES for sd in setup.final_seeds]
    long_jobs = [Job(r, chosen[r], seed, setup, "test", steps=2 * setup.steps, tag="long") for r in RULES]
    rest = run_jobs(final_jobs + long_jobs, workers, cache)
    final = rest[:len(final_jobs)]
    summary = {}
    for rule in RULES:
        runs = [x for x in final if x["rule"] == rule]
        summary[rule] = {"lr": chosen[rule], "seeds": len(runs),
                         "test_acc": _mean_std([x["acc"] for x in runs]),
                         "test_loss": _mean_std([x["loss"] for x in runs]),
                         "train_loss": _mean_std([x["train_loss"] for x in runs]),
                         "train_acc": _mean_std([x["train_acc"] for x in runs]),
                         "flatness": _mean_std([flatness(x["curve"]) for x in runs]),
                         "plateau": [plateau(x["curve"], setup) for x in runs]}
    stability = delay_stability.table(setup.stages, simulate=not quick)
    diagnosis = first[len(sweep_jobs):] + rest[len(final_jobs):]
    return {"setup": asdict(setup), "chosen_lr": chosen, "summary": summary,
            "sweep": [_thin(x) for x in sweep], "final": final, "diagnosis": [_thin(x) for x in diagnosis],
            "stability": stability}


def best_lr(sweep: list[dict[str, Any]], rule: str) -> float:
    """The lr with the best mean validation accuracy over the sweep seeds (a tie: the lower validation loss)."""
    lrs = sorted({x["lr"] for x in sweep if x["rule"] == rule})

    def score(lr: float) -> tuple[float, float]:
        runs = [x for x in sweep if x["rule"] == rule and x["lr"] == lr]
        loss = statistics.mean(x["loss"] if math.isfinite(x["loss"]) else math.inf for x in runs)
        return statistics.mean(x["acc"] for x in runs), -loss

    return max(lrs, key=score)


def _thin(run: dict[str, Any], every: int = 10) -> dict[str, Any]:
    """The run with its per-step curve averaged over blocks of ``every`` steps (``curve_every``)."""
    c = run["curve"]
    return {**run, "curve": [sum(c[a:a + every]) / len(c[a:a + every]) for a in range(0, len(c), every)],
            "curve_every": every}


def flatness(curve: list[float]) -> float:
    """Relative change of the per-step training loss between the two halves of the last tenth of the run
    (both at the last lr of the schedule): about 0 when the training loss is flat."""
    k = max(1, len(curve) // 20)
    a, b = statistics.mean(curve[-2 * k:-k]), statistics.mean(curve[-k:])
    return (b - a) / a


def plateau(curve: list[float], setup: Setup) -> int:
    """Steps until the training loss (1-epoch window) first falls below 90% of chance (ln 10): how long a
    run sits on the plateau at chance."""
    w = max(1, setup.train // (setup.stages * setup.micro_batch))
    for t, x in enumerate(smooth(curve, w)):
        if t >= w and x < 0.9 * math.log(10):
            return t + 1
    return len(curve)


def smooth(xs: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for t, x in enumerate(xs):
        acc += x
        if t >= w:
            acc -= xs[t - w]
        out.append(acc / min(t + 1, w))
    return out


def plot(res: dict[str, Any], path: Path) -> None:
    """Fig. 3 analog (training loss per step, all rules on one axis, mean over the final seeds) and the
    sweep (validation accuracy against lr)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setup = res["setup"]
    w = max(1, setup["train"] // (setup["stages"] * setup["micro_batch"]))  # one epoch
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    for rule in RULES:
        runs = [x for x in res["final"] if x["rule"] == rule]
        mean = [statistics.mean(r["curve"][t] for r in runs) for t in range(len(runs[0]["curve"]))]
        ax.plot(range(1, len(mean) + 1), smooth(mean, w),
                label=f"{LABEL[rule]} (lr {res['chosen_lr'][rule]:g})")
    for m in setup["milestones"]:
        ax.axvline(m * setup["steps"], color="0.85", lw=0.8, zorder=0)
    ax.set_yscale("log")
    ax.set_xlabel("training step (batch of N micro-batches, same for every rule)")
    ax.set_ylabel(f"training loss (mean of {len(setup['final_seeds'])} seeds, 1-epoch window)")
    ax.set_title("each rule at its best lr")
    ax.legend()
    ax = axes[1]
    same = [x for x in res["sweep"] if x["lr"] == 0.05] or res["sweep"]
    for rule in RULES:
        for r in [x for x in same if x["rule"] == rule][:1]:
            e = r["curve_every"]
            ax.plot([e * (k + 1) for k in range(len(r["curve"]))], smooth(r["curve"], max(1, w // e)),
                    label=f"{LABEL[rule]} (lr {r['lr']:g})")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel(f"training loss (sweep seed {setup['sweep_seeds'][0]}, 1-epoch window)")
    ax.set_title("all rules at the paper's lr 0.05 (with warm-up)")
    ax.legend()
    ax = axes[2]
    for rule in RULES:
        runs = [x for x in res["sweep"] if x["rule"] == rule]
        lrs = sorted({x["lr"] for x in runs})
        line = ax.plot(lrs, [statistics.mean(x["acc"] for x in runs if x["lr"] == lr) for lr in lrs], "o-",
                       label=LABEL[rule])[0]
        ax.scatter([x["lr"] for x in runs], [x["acc"] for x in runs], s=8, color=line.get_color(), alpha=0.5)
    ax.set_xscale("log")
    ax.set_xlabel(f"peak lr (SGD, momentum {setup['momentum']})")
    ax.set_ylabel(f"validation accuracy % (mean of {len(setup['sweep_seeds'])} seeds; dots: each)")
    ax.set_title("lr sweep")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res: dict[str, Any]) -> list[str]:
    """The report's lines (results only; the interpretation lives in docs/cdp.md)."""
    st = res["setup"]
    n, micro = st["stages"], st["micro_batch"]
    lines = ["## Accuracy (paper Tab. 2 / Fig. 3 in fair miniature)", "",
             f"Tiny ResNet (examples/cdp_models.py) on the offline synthetic digits with noise {st['noise']} "
             f"({st['train']} train / {st['val']} validation / {st['test']} test), N = {n} stages = {n} "
             f"micro-batches of {micro} per step for **every** rule (same data order, same init per seed), "
             f"{st['steps']} steps ({st['steps'] * n * micro // st['train']} epochs), SGD momentum "
             f"{st['momentum']}, weight decay {st['weight_decay']}, linear warm-up over {st['warmup']:.0%} of the "
             f"steps, then lr × {st['decay']} at {', '.join(f'{m:.0%}' for m in st['milestones'])} (the paper's "
             f"epochs 30/60/90 of 100). One process (world 1) per run, "
             "`quietsync.make_strategy(\"cdp\", …)` with rule dp / v1 / v2.", "",
             f"### Final: each rule at its best lr, {len(st['final_seeds'])} seeds (mean ± std)", "",
             "| rule | lr | test accuracy % | test loss | training loss (train set) | training accuracy % | "
             "change of the training loss over the last 5% of steps | steps on the chance plateau, per seed | "
             "paper (CIFAR-10, ResNet-18) |",
             "|---|---|---|---|---|---|---|---|---|"]
    paper = {"dp": "94.7", "v1": "94.1", "v2": "94.8"}
    for rule in RULES:
        s = res["summary"][rule]
        lines.append(f"| {LABEL[rule]} | {s['lr']:g} | {s['test_acc'][0]:.2f} ± {s['test_acc'][1]:.2f} | "
                     f"{s['test_loss'][0]:.4f} ± {s['test_loss'][1]:.4f} | {s['train_loss'][0]:.4f} ± "
                     f"{s['train_loss'][1]:.4f} | {s['train_acc'][0]:.2f} ± {s['train_acc'][1]:.2f} | "
                     f"{s['flatness'][0]:+.2%} | {', '.join(map(str, s['plateau']))} | {paper[rule]} |")
    lines += ["", "![loss](cdp_loss.png)", "",
              "The plateau: steps until the training loss (1-epoch window) first falls below 0.9·ln 10 "
              "(chance is ln 10 = 2.303).", "",
              f"### lr sweep (validation accuracy % / validation loss, mean of seeds "
              f"{', '.join(map(str, st['sweep_seeds']))} (not final seeds), each seed's accuracy in brackets; "
              "**bold** = chosen: best mean validation accuracy; a grid grows by ×2 / ÷2 while its best is at an "
              "end)", "",
              "| lr | " + " | ".join(LABEL[r] for r in RULES) + " |", "|---|" + "---|" * len(RULES)]
    for lr in sorted({x["lr"] for x in res["sweep"]}):
        cells = []
        for rule in RULES:
            runs = [x for x in res["sweep"] if x["rule"] == rule and x["lr"] == lr]
            if not runs:
                cells.append("—")
                continue
            acc = statistics.mean(x["acc"] for x in runs)
            loss = statistics.mean(x["loss"] for x in runs)
            each = ", ".join(f"{x['acc']:.1f}" for x in runs)
            cell = f"{acc:.2f} / {loss:.3f} ({each})"
            cells.append(f"**{cell}**" if res["chosen_lr"][rule] == lr else cell)
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    diag = res["diagnosis"]
    if diag:
        lines += ["", "### Diagnosis runs (one seed each)", "",
                  "| what | rule | lr | momentum | steps | warm-up | split | accuracy % | loss | "
                  "training loss (train set) |", "|---|---|---|---|---|---|---|---|---|---|"]
        for x in diag:
            lines.append(f"| {x['tag']} | {LABEL[x['rule']]} | {x['lr']:g} | {x['momentum']:g} | {x['steps']} | "
                         f"{'yes' if x['warmup'] else 'no'} | {x['split']} | {x['acc']:.2f} | {x['loss']:.4f} | "
                         f"{x['train_loss']:.4f} |")
    sharp = [x for x in res["final"] if x["sharpness"]]
    if sharp:
        lines += ["", f"### Sharpness along one final run per rule (seed {st['final_seeds'][0]}): η·λ against the "
                  "stable limit κ* of a quadratic", "",
                  f"λ = top Hessian eigenvalue of the training loss ({st['sharpness_samples']} training samples, "
                  f"{st['sharpness_iters']} power iterations) at θ_steps, whole model and each stage's diagonal "
                  "block; η = the lr of the next update. Stable limits (benchmarks/delay_stability.py, "
                  f"momentum {st['momentum']}): "
                  + ", ".join(f"{r['rule']}{'' if r['stage'] is None else ' stage ' + str(r['stage'])} "
                              f"{r['kappa_closed_form']:.3g}" for r in res["stability"]
                              if r["beta"] == st["momentum"]) + ".", "",
                  "| rule | step | η | λ whole | η·λ whole | η·λ per stage 1..N | η·λ / κ* per stage |",
                  "|---|---|---|---|---|---|---|"]
        for x in sharp:
            limits = [delay_stability.threshold(st["momentum"], delay_stability.fresh_fraction(x["rule"], n, j))
                      for j in range(1, n + 1)]
            for p in x["sharpness"]:
                per = [p["eta"] * lam for lam in p["lambda_stage"]]
                lines.append(f"| {LABEL[x['rule']]} | {p['step']} | {p['eta']:.4g} | {p['lambda']:.1f} | "
                             f"{p['eta'] * p['lambda']:.3f} | {', '.join(f'{v:.3f}' for v in per)} | "
                             f"{', '.join(f'{v / k:.2f}' for v, k in zip(per, limits))} |")
    lines += ["", "### Stable limit of ηλ on a quadratic (closed form; simulated with the paper's rules "
              "micro-batch by micro-batch)", "",
              "| momentum | rule | fresh fraction of the step's gradient | κ* closed form | κ* simulated |",
              "|---|---|---|---|---|"]
    for r in res["stability"]:
        name = LABEL[r["rule"]] + ("" if r["stage"] is None else f" stage {r['stage']}")
        sim = f"{r['kappa_simulated']:.4g}" if "kappa_simulated" in r else "—"
        lines.append(f"| {r['beta']:g} | {name} | {r['fresh']:.2f} | {r['kappa_closed_form']:.4g} | {sim} |")
    lines.append("")
    return lines
