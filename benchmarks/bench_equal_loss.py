"""Equal loss (issue 27, item 4): every candidate setting run to a target held-out loss, on several links.

The planner's test set and the Streaming-DiLoCo-style table at once. Every run is a real ``quietsync train`` job:
the embedded corpus, model ``tiny``, 2 workers as 2 nodes with a core each (one torch thread per worker),
micro-batch 8 × 128 tokens per worker, AdamW at a warm-up + **constant** learning rate (so a run's trajectory does
not depend on its budget: a run stopped at the target is the prefix of a longer one), the same seed per row. Each
run stops at the first held-out evaluation at or below the **target** (chosen from the pilot sweep,
``--pilot``: a bit above the synchronous baseline's plateau), or at its budget: a token cap (generous: several
times what the baseline needs, and never fewer than 16 outer steps of a DiLoCo-family setting) and a time cap.

Links: emulated by the transport at 10 Mbit/s (5 ms), 50 Mbit/s (20 ms), 100 Mbit/s (5 ms) and 1 Gbit/s (1 ms), and
one **really shaped** link — two network namespaces joined by a veth pair with ``tc qdisc ... tbf rate 100mbit burst
64kb latency 400ms`` (root needed; the transport emulates nothing there).

Settings (:func:`settings`): every strategy — ddp (and its PowerSGD hook), zero1, fsdp; acco/dpu/wp adaptive and
capped at 4 micro-batches per stage; demo with the dct and random replicators at several compressions; localsgd K;
diloco H with fragments and τ; low-bit pseudo-gradients (int8, fp4, int4, int2); SparseLoCo at the paper's 2-bit
values; cdp v1/v2 — plus every setting of the planner's candidate grid (:func:`quietsync.plan.candidates
.default_candidates`) so the two join on setting names. Names are ``quietsync compare --strategies`` specs with the
knobs that differ from the defaults in the config's order, normalized by the planner's own
:func:`quietsync.plan.candidates.candidate` (``demo``, ``diloco:sync_every=16,fragments=4,overlap_delay=4``), so
equal settings are one row and the planner's rows join these by name. Left out, with why: flexdemo and
hierarchical diloco (``inner=ddp|zero1``) — with one worker per node their intra-node step is over a single worker,
so they would repeat demo's and diloco's rows — and 2 nodes × 2 workers (4 processes on 2 cores would measure the
core sharing); the planner's ``WIDE`` settings for large clusters (H = 128 and 512; its DeMo at 1/1024 is run).

Measured per run: whether it reached the target; training time (evaluations subtracted), tokens (all workers),
inter-node bytes (sent by all workers on the groups that span nodes, during the training steps: the start-up
broadcast, the same in every row, left out) and steps to the first evaluation at or below the target; the final and
best held-out loss (how close a run came that did not reach it); the held-out loss curve over tokens, time and
bytes. Evaluations run every ~32k tokens (every 16 steps of one micro-batch per worker; adaptive ACCO/DPU/WP:
estimated from the link); their time is left out of the times (for overlapped strategies their communication
keeps running during an evaluation: ``eval_overlap_s`` bounds what that hides).

Seeds: seed 0 for every setting on every link, then seeds 1 and 2 for the rows that decide the headline — the
baseline (ddp) and the best low-communication rows (fewest bytes to the target, fastest to it on each link).

The sweep is resumable: every run writes its record under ``--work`` (default ``runs/equal_loss``) and is not
re-run while its record exists for the same job. Each run can be wrapped in a command prefix (``--wrap "taskset -c
0,1"``), e.g. a shared machine's lock held per run, not for the whole sweep.

    python benchmarks/bench_equal_loss.py --quick      # 4 settings, one emulated link, low target (minutes)
    python benchmarks/bench_equal_loss.py --pilot      # the baseline's lr sweep that sets lr, tokens and target
    python benchmarks/bench_equal_loss.py              # the sweep (hours; resumable; root for the shaped link)
    python benchmarks/bench_equal_loss.py --report     # rebuild the table and plot from the records

Writes ``results/equal_loss.{json,md,png}`` (``equal_loss_quick.*``, ``equal_loss_pilot.*``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ShapedLink, flags_of, read_run, run_train, write_markdown  # noqa: E402

HERE = Path(__file__).resolve()
SHAPED = "shaped"
"""Link name of the ``tc tbf`` link between two network namespaces."""
LINKS = {"10mbit": "10mbit,5ms", "50mbit": "50mbit,20ms", "100mbit": "100mbit,5ms", "1gbit": "1gbit,1ms",
         SHAPED: None}
"""Link name → the ``--link inter=...`` value (None: the really shaped link)."""
REFERENCE_LINK = "1gbit"
"""Where the bytes table (a) is read: the fastest link, where a run is held back least by its time cap (bytes and
tokens to the target do not depend on the link except for the adaptive ACCO/DPU/WP, whose stages grow with it)."""
BASELINE = "ddp"
"""The synchronous baseline of the bytes table (Streaming DiLoCo's data-parallel row)."""
SYNC = ("ddp", "zero1", "fsdp")
LOW_COMM = ("demo", "flexdemo", "localsgd", "diloco")
"""Strategies that send less than the full gradient every step (plus ddp with the PowerSGD hook)."""
OVERLAPPED = ("acco", "dpu", "wp")
INTER_GROUPS = ("world", "replicate")
"""The groups that span nodes (``shard`` stays inside one; with one worker per node it is empty)."""


def shaped_link() -> ShapedLink:
    """The shaped link under this benchmark's own namespace, device and address names, so that another benchmark's
    shaped link (``bench_plan``, ``bench_time_to_target``'s probe: the default names) set up meanwhile neither
    deletes nor joins this one's."""
    link = ShapedLink()
    link.ns, link.dev, link.ip = ("qseqloss0", "qseqloss1"), ("qseqv0", "qseqv1"), ("10.79.0.1", "10.79.0.2")
    return link


@dataclasses.dataclass(frozen=True)
class Job:
    """What every run of the sweep shares (a change re-runs every record)."""

    model: str = "tiny"
    """Model preset."""
    micro_batch_size: int = 8
    """Sequences per micro-batch per worker."""
    seq_len: int = 128
    """Tokens per sequence."""
    lr: float = 2e-3
    """Peak (and, after the warm-up, constant) AdamW lr; chosen by the pilot sweep."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    target: float = 3.6
    """Held-out loss every run tries to reach; chosen by the pilot sweep (where the baseline's curve flattens)."""
    tokens: int = 8_000_000
    """Token cap (all workers) of a run (about 4× the baseline's tokens to the target); DiLoCo-family settings get
    at least 16 outer steps' worth."""
    time_s: float = 600.0
    """Time cap of a run (seconds of training, evaluations included, as ``--max-time-s``)."""
    eval_tokens: int = 32_768
    """Tokens (all workers) between two evaluations, as near as a step allows."""
    eval_windows: int = 48
    """Held-out sequences per evaluation (the same ones every time)."""
    vocab_size: int = 4096
    """Byte-level BPE vocabulary."""
    workers: int = 2
    """Workers, each its own node."""
    min_outer_steps: int = 16
    """Outer steps (syncs) a DiLoCo-family setting's token cap allows at least."""

    @property
    def micro_batch_tokens(self) -> int:
        return self.micro_batch_size * self.seq_len

    def key(self) -> str:
        return hashlib.sha1(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:10]


FULL = Job()
QUICK = Job(target=6.0, tokens=400_000, time_s=240.0, eval_tokens=8192, eval_windows=16)
SMOKE = Job(target=7.0, tokens=60_000, time_s=120.0, eval_tokens=8192, eval_windows=8, min_outer_steps=1)
"""Every setting to a high target: checks the sweep end to end (``--smoke``), its numbers mean nothing."""


# ---------------------------------------------------------------------------------------------- the settings
def settings(quick: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """The sweep's settings (strategy, knobs), in table order, the planner's grid included, one per setting: knobs
    normalized as the planner names candidates (the fields that differ from the defaults)."""
    if quick:
        return unique([("ddp", {}), ("demo", {}), ("diloco", {"sync_every": 16}), ("acco", {"max_accumulation": 4})])
    sparseloco = {"outer": "sparseloco", "pseudo_grad_dtype": "int2", "topk_density": 1 / 64, "topk_chunk": 4096,
                  "error_decay": 0.95, "outer_lr": 1.0}  # the SparseLoCo paper's values: 2-bit, lr 1 (averaged step)
    grid: list[tuple[str, dict[str, Any]]] = [
        ("ddp", {}), ("zero1", {}), ("fsdp", {}),
        ("ddp", {"comm_hook": "powersgd", "powersgd_rank": 4}),
        ("acco", {}), ("dpu", {}), ("wp", {}),
        ("acco", {"max_accumulation": 4}), ("dpu", {"max_accumulation": 4}), ("wp", {"max_accumulation": 4}),
        *[("demo", {"replicator": "dct", "compression": 1 / c}) for c in (8, 32, 256, 1024)],
        *[("demo", {"replicator": "random", "compression": 1 / c}) for c in (8, 32, 256)],
        *[("localsgd", {"sync_every": k}) for k in (16, 64)],
        *[("diloco", {"sync_every": h}) for h in (16, 64, 256)],
        ("diloco", {"sync_every": 16, "overlap_delay": 16}),                   # the whole exchange behind H steps
        ("diloco", {"sync_every": 16, "fragments": 4, "overlap_delay": 4}),    # each fragment behind H/F steps
        ("diloco", {"sync_every": 16, "fragments": 4, "overlap_delay": 4, "pseudo_grad_dtype": "fp4"}),
        ("diloco", {"sync_every": 64, "fragments": 4, "overlap_delay": 1}),    # Streaming DiLoCo (paper's τ = 1)
        ("diloco", {"sync_every": 64, "fragments": 4, "overlap_delay": 16}),
        *[("diloco", {"sync_every": 64, "pseudo_grad_dtype": d}) for d in ("int8", "fp4", "int4", "int2")],
        ("diloco", {"sync_every": 64, "fragments": 4, "overlap_delay": 1, "fragment_pattern": "strided",
                    "pseudo_grad_dtype": "fp4"}),                               # Streaming DiLoCo's fp4 row
        *[("diloco", {"sync_every": h, **sparseloco}) for h in (16, 64)],
        ("cdp", {"rule": "v1"}), ("cdp", {"rule": "v2"}),
    ]
    return unique(grid + planner_grid())


def planner_grid() -> list[tuple[str, dict[str, Any]]]:
    """The planner's candidate settings for this job's topology (2 workers as 2 nodes)."""
    from quietsync.plan.candidates import default_candidates
    from quietsync.plan.config import PlanConfig
    from quietsync.plan.planner import build_workload
    from quietsync.topology import Topology

    cfg = PlanConfig(model=FULL.model, micro_batch_size=FULL.micro_batch_size, seq_len=FULL.seq_len,
                     nproc=FULL.workers, nodes=FULL.workers)
    w, _ = build_workload(cfg, real=False)
    return list(default_candidates(w, Topology(0, FULL.workers, FULL.workers)))


def only(grid: list[tuple[str, dict[str, Any]]], wanted: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """The settings named in ``wanted``, in its order: a spec equal to a setting's picks that one, otherwise every
    setting whose spec starts with it (``diloco:sync_every=16`` alone; ``demo:replicator=random`` all three)."""
    out: list[tuple[str, dict[str, Any]]] = []
    for o in wanted:
        exact = [(n, k) for n, k in grid if spec(n, k) == o]
        for nk in exact or [(n, k) for n, k in grid if spec(n, k).startswith(o)]:
            if nk not in out:
                out.append(nk)
    if not out:
        raise SystemExit(f"--only: no setting matches {wanted}; --list prints them")
    return out


def resolved(name: str, knobs: dict[str, Any]) -> dict[str, Any]:
    """The strategy's whole config with these knobs (what makes two settings the same one)."""
    from quietsync.strategies import get

    _, config_cls = get(name)
    return dataclasses.asdict(config_cls(**knobs))


def unique(grid: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """``grid`` normalized (:func:`quietsync.plan.candidates.candidate`: the knobs that differ from the defaults, in
    the config's field order), later repeats of a setting dropped."""
    from quietsync.plan.candidates import candidate

    out: list[tuple[str, dict[str, Any]]] = []
    for name, knobs in grid:
        c = candidate(name, knobs)
        if (c.strategy, c.knob_dict) not in out:
            out.append((c.strategy, c.knob_dict))
    return out


LEFT_OUT = {
    "flexdemo": "the planner's reason: {flexdemo}; its intra-node reduce-scatter and sharding would be over a single "
                "worker, the same computation and cross-node traffic as demo's rows",
    "diloco inner=ddp|zero1 (hierarchical)": "with one worker per node the inner ddp/zero1 step is over a single "
                                             "worker: the same as diloco's default inner=local",
    "2 nodes × 2 workers": "4 worker processes on 2 cores would measure the core sharing, not the strategies",
    "the planner's WIDE settings (H = 128 / 512, SparseLoCo H = 128)": "settings for large clusters on slow links "
                                                                       "(--what-if); 16 outer steps at H = 512 "
                                                                       "would be 8 epochs of this corpus",
}
"""What the sweep does not run, and why (``{flexdemo}``: the planner's own reason, filled in by :func:`left_out`)."""


def left_out() -> dict[str, str]:
    from quietsync.plan.candidates import applies
    from quietsync.topology import Topology

    why = applies("flexdemo", Topology(0, FULL.workers, FULL.workers)) or "it applies"
    return {k: v.replace("{flexdemo}", why) for k, v in LEFT_OUT.items()}


def spec(name: str, knobs: dict[str, Any]) -> str:
    """The setting's name: the planner's spec string (``quietsync compare --strategies`` takes it), e.g. ``demo`` or
    ``diloco:sync_every=16,fragments=4,overlap_delay=4``."""
    from quietsync.plan.candidates import candidate

    return candidate(name, knobs).spec


def low_comm(name: str, knobs: dict[str, Any]) -> bool:
    return name in LOW_COMM or knobs.get("comm_hook") == "powersgd"


def outer_period(name: str, knobs: dict[str, Any]) -> int:
    """Inner steps between two syncs (1 for a setting that syncs every step)."""
    if name == "diloco":
        return int(knobs.get("sync_every", 64))
    if name == "localsgd":
        return int(knobs.get("sync_every", 8))
    return 1


def token_cap(job: Job, name: str, knobs: dict[str, Any]) -> int:
    """The run's token cap: the job's, and at least ``job.min_outer_steps`` outer steps (plus τ) of a DiLoCo-family
    setting."""
    period = outer_period(name, knobs)
    steps = job.min_outer_steps * period + int(knobs.get("overlap_delay", 0)) + 1
    outer = steps * job.workers * job.micro_batch_tokens
    return max(job.tokens, outer)


def micro_batches_per_step(job: Job, name: str, knobs: dict[str, Any], link: str) -> float:
    """Micro-batches per worker per committed step, estimated (only to space the evaluations): 1, or for
    ACCO/DPU/WP a stage of as many micro-batches (≈ 0.1 s each here) as its reduce-scatter + all-gather of the
    fp32 gradients takes on the link, within [1, max_accumulation]."""
    if name not in OVERLAPPED:
        return float(knobs.get("accumulation", 1))
    from quietsync.link import LinkModel

    bandwidth = LinkModel.parse(LINKS.get(link) or "100mbit,5ms").bandwidth  # the shaped link is 100 Mbit/s
    params = 0.95e6 if job.model == "tiny" else 2.6e6 if job.model == "default" else 10.6e6
    comm_s = 2 * 4 * params * (job.workers - 1) / job.workers / bandwidth
    stage = min(max(1.0, comm_s / 0.1), float(knobs.get("max_accumulation") or math.inf))
    return stage * (2 if name == "acco" else 1)


def eval_every(job: Job, name: str, knobs: dict[str, Any], link: str) -> int:
    """Steps between evaluations: about ``job.eval_tokens`` tokens, aligned with the sync period where one exists."""
    per_step = micro_batches_per_step(job, name, knobs, link) * job.workers * job.micro_batch_tokens
    steps = max(1, round(job.eval_tokens / per_step))
    period = outer_period(name, knobs)
    if period > 1:  # the committed model changes at syncs: evaluate right after them
        steps = period if period <= steps else steps
        while period % steps:
            steps -= 1
    return steps


# ---------------------------------------------------------------------------------------------- one run
def run_flags(job: Job, name: str, knobs: dict[str, Any], link: str, seed: int) -> list[str]:
    """``quietsync train`` flags of one run (without ``--out`` and the launcher's)."""
    flags = ["--model", job.model, "--micro-batch-size", str(job.micro_batch_size), "--seq-len", str(job.seq_len),
             "--vocab-size", str(job.vocab_size), "--threads", "1", "--lr", repr(job.lr),
             "--warmup-steps", str(job.warmup_steps), "--min-lr-ratio", "1.0", "--seed", str(seed),
             "--eval-every", str(eval_every(job, name, knobs, link)), "--eval-windows", str(job.eval_windows),
             "--target-loss", repr(job.target), "--max-tokens", str(token_cap(job, name, knobs)),
             "--max-time-s", repr(job.time_s), "--max-steps", "1000000", "--timeout-s", "900",
             "--strategy", name, *flags_of(knobs)]
    return flags


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def record_path(work: Path, job: Job, link: str, name: str, knobs: dict[str, Any], seed: int) -> Path:
    return work / f"job-{job.key()}" / link / f"{slug(spec(name, knobs))}-seed{seed}.json"


def run_one(job: Job, name: str, knobs: dict[str, Any], link: str, seed: int, work: Path, port: int,
            wrap: list[str]) -> dict:
    """Run one setting on one link with one seed and write its record (called in the child process, under the
    wrap's lock)."""
    path = record_path(work, job, link, name, knobs, seed)
    if path.exists():  # another sweep made it while this one waited for the lock
        return json.loads(path.read_text())
    out = path.with_suffix("")
    shutil.rmtree(out, ignore_errors=True)
    flags = run_flags(job, name, knobs, link, seed)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    if LINKS[link] is None:
        shaped_link().run(["train", "--out", str(out), "--no-progress", "--no-plot", "--no-export", *flags], 1,
                         timeout=job.time_s * 2 + 600, port=port)
        summary = read_run(out)
    else:
        summary = run_train(out, "--nproc", str(job.workers), "--nodes", str(job.workers),
                            "--link", f"inter={LINKS[link]}", *flags, timeout=job.time_s * 2 + 600)
    process_s = time.perf_counter() - t0
    rec = measure(summary, job)
    rec.update({"strategy": name, "knobs": knobs, "spec": spec(name, knobs), "config": resolved(name, knobs),
                "link": link, "link_spec": LINKS[link] or ShapedLink().describe(), "seed": seed,
                "low_comm": low_comm(name, knobs), "flags": flags, "token_cap": token_cap(job, name, knobs),
                "time_cap_s": job.time_s, "eval_every": eval_every(job, name, knobs, link),
                "process_s": process_s, "load_average_before_after": [load, os.getloadavg()[0]], "wrap": wrap,
                "job": dataclasses.asdict(job)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def inter_bytes(by_group: dict[str, Any]) -> int:
    return sum(by_group.get(g, {}).get("sent", 0) for g in INTER_GROUPS)


def measure(summary: dict[str, Any], job: Job) -> dict[str, Any]:
    """The record of one run: to-the-target numbers and the held-out loss curve."""
    steps_by_rank = [[r for r in records if "event" not in r] for records in summary["records"]]
    groups = {g for steps in steps_by_rank for r in steps for g, v in r["bytes_by_group"].items() if v["sent"]}
    unknown = groups - set(INTER_GROUPS) - {"shard"}
    if unknown:
        raise RuntimeError(f"bytes on groups {sorted(unknown)}: which link they cross is not known here")
    tokens_at: dict[int, int] = {}
    for records in summary["records"]:
        for e in records:
            if e.get("event") == "eval":
                tokens_at[e["step"]] = tokens_at.get(e["step"], 0) + e["tokens_total"]
    curve, eval_s = [], 0.0
    for e in summary["records"][0]:
        if e.get("event") != "eval":
            continue
        eval_s += e["eval_s"]
        sent = sum(inter_bytes(r["bytes_by_group"]) for steps in steps_by_rank for r in steps if r["step"] <= e["step"])
        curve.append({"step": e["step"], "loss": e["loss"], "tokens": tokens_at[e["step"]],
                      "time_s": e["time_s"] - eval_s, "wall_s": e["time_s"], "eval_s_before": eval_s,
                      "inter_bytes": sent})
    hit = next((c for c in curve[1:] if c["loss"] is not None and c["loss"] <= job.target), None)
    losses = [c["loss"] for c in curve[1:] if c["loss"] is not None and math.isfinite(c["loss"])]
    micro = [r["micro_batches"] for steps in steps_by_rank for r in steps]
    total = sum(inter_bytes(r["bytes_by_group"]) for steps in steps_by_rank for r in steps)
    last = curve[-1] if curve else {}
    return {
        "reached": hit is not None, "stopped_by": summary.get("stopped_by"),
        "time_to_target_s": hit["time_s"] if hit else None, "wall_to_target_s": hit["wall_s"] if hit else None,
        "tokens_to_target": hit["tokens"] if hit else None,
        "inter_bytes_to_target": hit["inter_bytes"] if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "eval_overlap_s": hit["eval_s_before"] if hit else None,
        "final_loss": summary.get("last_eval_loss"), "best_loss": min(losses) if losses else None,
        "steps": summary["steps"], "tokens": summary["tokens"], "train_time_s": last.get("time_s"),
        "wall_s": summary["wall_s"], "inter_bytes": total,
        "inter_bytes_with_setup": inter_bytes(summary["bytes_by_group"]),
        "micro_batches_per_step": statistics.mean(micro) * len(steps_by_rank) if micro else None,
        "compute_busy": summary.get("compute_fraction"),
        "tokens_per_s": (last["tokens"] / last["time_s"]) if last and last.get("time_s") else None,
        "curve": curve,
    }


# ---------------------------------------------------------------------------------------------- the sweep
class Sweep:
    """Runs (or reads from the cache) every (setting, link, seed), one child process per run."""

    def __init__(self, job: Job, work: Path, wrap: list[str], dry: bool = False) -> None:
        self.job, self.work, self.wrap, self.dry = job, work, wrap, dry
        self.port = 29700 + os.getpid() % 97 * 3

    def cached(self, name: str, knobs: dict[str, Any], link: str, seed: int = 0) -> dict[str, Any] | None:
        """The record of a run made before (by this sweep or another), or None."""
        path = record_path(self.work, self.job, link, name, knobs, seed)
        return json.loads(path.read_text()) if path.exists() else None

    def get(self, name: str, knobs: dict[str, Any], link: str, seed: int) -> dict[str, Any] | None:
        path = record_path(self.work, self.job, link, name, knobs, seed)
        if path.exists():
            return json.loads(path.read_text())
        if self.dry:
            return None
        self.port += 1
        call = {"job": dataclasses.asdict(self.job), "name": name, "knobs": knobs, "link": link, "seed": seed,
                "work": str(self.work), "port": self.port, "wrap": self.wrap}
        cmd = [*self.wrap, sys.executable, str(HERE), "--child", json.dumps(call)]
        t0 = time.perf_counter()
        print(f"[{time.strftime('%H:%M:%S')}] {link:8s} {spec(name, knobs):60s} seed {seed} ...", end=" ", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not path.exists():
            print(f"FAILED ({proc.returncode}) after {time.perf_counter() - t0:.0f} s", flush=True)
            fail = path.with_suffix(".failed.txt")
            fail.parent.mkdir(parents=True, exist_ok=True)
            fail.write_text(proc.stdout[-20000:] + "\n" + proc.stderr[-20000:])
            return None
        rec = json.loads(path.read_text())
        got = (f"{rec['time_to_target_s']:.1f} s, {rec['tokens_to_target']:,} tokens" if rec["reached"]
               else f"not reached (best {rec['best_loss']:.3f}, {rec['stopped_by']})")
        print(f"{got}  [{time.perf_counter() - t0:.0f} s]", flush=True)
        return rec


SEEDS_KEPT = 8
"""With ``--report``: seeds 1..this of every setting are read where their records exist."""


def extra_seeds(recs: dict[str, list[dict[str, Any]]]) -> tuple[int, list[str]]:
    """The most extra seeds any setting of one link has, and the settings that have them (for the reproduce line)."""
    n = max((len(rs) - 1 for rs in recs.values()), default=0)
    return n, [s for s, rs in recs.items() if n and len(rs) - 1 == n]


def headline_rows(link: str, recs: dict[str, dict[str, Any]], top: int = 2) -> list[str]:
    """The settings that need more seeds on ``link`` (of those that reached the target): the baseline, the ``top``
    fastest to the target and, on the reference link, the ``top`` low-communication rows with the fewest bytes to
    it."""
    reached = {s: r for s, r in recs.items() if r["reached"]}
    chosen = [s for s, r in reached.items() if r["strategy"] == BASELINE and not r["knobs"]]
    fastest = sorted(reached, key=lambda s: reached[s]["time_to_target_s"])
    chosen += [s for s in fastest if s not in chosen][:top]
    if link == REFERENCE_LINK:
        fewest = sorted((s for s in reached if reached[s]["low_comm"]),
                        key=lambda s: reached[s]["inter_bytes_to_target"])
        chosen += [s for s in fewest if s not in chosen][:top]
    return chosen


def not_reachable(job: Job, name: str, knobs: dict[str, Any], link: str, ref: dict[str, Any] | None) -> str | None:
    """Why ``(name, knobs)`` cannot reach the target within the caps on ``link``, read from its seed-0 run on the
    reference link (the fastest), or None (then it runs). Only for settings whose arithmetic does not depend on
    timing (all but ACCO/DPU/WP, whose stages adapt to the link): their loss per token is the same on every link
    (checked in the report, on the links where both ran), so

    * a run that did not reach the target on the fastest link does not reach it on a slower one (the token cap is
      the same; a time cap comes at fewer tokens);
    * a run that reached it sent its bytes to the target on every link, and a worker's link carries them no faster
      than its bandwidth: past the time cap, it cannot arrive in time.
    """
    if ref is None or link == REFERENCE_LINK or name in OVERLAPPED:
        return None
    if not ref["reached"]:
        cap = "token" if ref["stopped_by"] == "max_tokens" else "time"
        return (f"did not reach it on {REFERENCE_LINK} within the {cap} cap (best {ref['best_loss']:.3f}); its loss "
                "per token is the same on every link")
    from quietsync.link import LinkModel

    per_worker = ref["inter_bytes_to_target"] / job.workers
    bound = per_worker / LinkModel.parse(LINKS[link] or "100mbit").bandwidth  # the shaped link's rate is 100 Mbit/s
    if bound > job.time_s:
        return (f"its {per_worker / 1e6:,.0f} MB per worker to the target need ≥ {bound:,.0f} s on this link alone; "
                f"cap {job.time_s:g} s")
    return None


def skipped(name: str, knobs: dict[str, Any], link: str, why: str) -> dict[str, Any]:
    """The record of a run not made (:func:`not_reachable`)."""
    return {"strategy": name, "knobs": knobs, "spec": spec(name, knobs), "link": link, "seed": 0, "reached": False,
            "skipped": why, "stopped_by": None, "best_loss": None, "final_loss": None, "time_to_target_s": None,
            "tokens_to_target": None, "inter_bytes_to_target": None, "process_s": 0.0,
            "low_comm": low_comm(name, knobs), "curve": [], "tokens": None, "inter_bytes": None}


# ---------------------------------------------------------------------------------------------- the report
def aggregate(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Seeds of one setting on one link: mean, spread and how many reached the target."""
    hit = [r for r in recs if r["reached"]]

    def stat(key: str) -> dict[str, float] | None:
        vals = [r[key] for r in hit]
        if not vals or len(hit) < len(recs):
            return None
        return {"mean": statistics.mean(vals), "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                "min": min(vals), "max": max(vals), "n": len(vals)}

    best = [r["best_loss"] for r in recs if r["best_loss"] is not None]
    final = [r["final_loss"] for r in recs if r["final_loss"] is not None]
    return {"seeds": [r["seed"] for r in recs], "reached": len(hit), "runs": len(recs),
            "skipped": recs[0].get("skipped"),
            "time_to_target_s": stat("time_to_target_s"), "tokens_to_target": stat("tokens_to_target"),
            "inter_bytes_to_target": stat("inter_bytes_to_target"),
            "best_loss": min(best) if best else None, "final_loss": statistics.mean(final) if final else None}


def fmt_stat(s: dict[str, float] | None, scale: float = 1.0, digits: int = 3) -> str:
    if s is None:
        return "—"
    mean = s["mean"] / scale
    text = f"{mean:.{digits}g}" if abs(mean) < 1000 else f"{mean:,.0f}"
    if s["n"] > 1:
        sd = s["sd"] / scale
        text += f" ± {sd:.2g}" if abs(sd) < 1000 else f" ± {sd:,.0f}"
    return text


NOT_RUN = "this sweep's time"
"""Why a setting of the grid has no run on a link where the sweep's pruning did not rule it out: the sweep ran a
subset in the time it had (``--only``/``--links``), most important first."""


def report(job: Job, grid: list[tuple[str, dict[str, Any]]], links: list[str], records: dict, name: str,
           cmd: str, sweep_s: float | None, unrun_links: list[str] = (), base: str = "") -> Path:
    """Write ``results/NAME.{json,md,png}`` from the records (every seed of every setting on every link); the
    settings of ``grid`` with no record on a link of ``links``, and the links ``unrun_links``, are named as not run
    (:data:`NOT_RUN`)."""
    by_link: dict[str, dict[str, dict[str, Any]]] = {}
    for link in links:
        by_link[link] = {}
        for n, k in grid:
            recs = records.get(link, {}).get(spec(n, k), [])
            if recs:
                by_link[link][spec(n, k)] = {"strategy": n, "knobs": k, "spec": spec(n, k), "config": resolved(n, k),
                                             "low_comm": low_comm(n, k), **aggregate(recs), "runs_detail": recs}
    ref = REFERENCE_LINK if REFERENCE_LINK in by_link else links[0]
    table_a, headline = bytes_table(by_link.get(ref, {}), job)
    table_b = time_table(by_link, links, job)
    not_run = {lk: [spec(n, k) for n, k in grid if spec(n, k) not in by_link[lk]] for lk in links}
    nowhere = [spec(n, k) for n, k in grid if all(spec(n, k) in not_run[lk] for lk in links)]
    made = {lk: [s for s, r in by_link[lk].items() if not r["skipped"]] for lk in links}
    cpu = sum(r["process_s"] for lk in records.values() for rs in lk.values() for r in rs)
    runs = sum(1 for lk in records.values() for rs in lk.values() for r in rs if not r.get("skipped"))
    (RESULTS / f"{name}.json").write_text(json.dumps({
        "job": dataclasses.asdict(job), "links": {lk: LINKS[lk] or ShapedLink().describe() for lk in links},
        "reference_link": ref, "baseline": BASELINE, "headline": headline, "left_out": left_out(),
        "settings": [{"strategy": n, "knobs": k, "spec": spec(n, k), "config": resolved(n, k)} for n, k in grid],
        "results": by_link, "runs": runs, "run_seconds": cpu, "sweep_wall_s": sweep_s, "command": cmd,
        "not_run": {**not_run, **{lk: [spec(n, k) for n, k in grid] for lk in unrun_links}}, "not_run_why": NOT_RUN,
    }, indent=1) + "\n")
    plot(by_link, links, job, RESULTS / f"{name}.png", ref)
    notes = "\n".join([
        f"Job: model `{job.model}`, 2 workers as 2 nodes, a core and one torch thread each, micro-batch "
        f"{job.micro_batch_size}×{job.seq_len} tokens per worker, AdamW lr {job.lr:g} after {job.warmup_steps} "
        f"warm-up steps, then constant; **target held-out loss {job.target:g}**; caps per run: "
        f"{job.tokens:,} tokens (DiLoCo family: at least {job.min_outer_steps} outer steps) and {job.time_s:g} s. "
        f"Links: " + "; ".join(f"`{lk}` = {LINKS[lk] or ShapedLink().describe()}" for lk in links) + ".",
        "",
        "## (a) Bytes exchanged to reach the same loss (the Streaming DiLoCo table, redone at equal loss)",
        "",
        f"On the `{ref}` link. *Inter-node MB* = bytes all workers sent across nodes during the training steps "
        "until the first evaluation at or below the target (the start-up broadcast, the same in every row, left "
        "out); *× fewer* = the baseline's bytes / these; *tokens* = all workers' tokens to the target. A row that "
        "did not reach the target shows how close it came (its best held-out loss) and what it had sent by then. "
        "Mean ± sd over seeds where more than one ran.",
        "",
        headline,
        "",
        table_a,
        "",
        "## (b) Time to the target per link",
        "",
        "Seconds of training (evaluations left out) until the first evaluation at or below the target, mean ± sd "
        "over seeds where more than one ran; **bold** = the fastest of the settings run on that link, (×) = this "
        "time / the fastest's; — (x.xx; … cap) = not reached before the token or time cap, its best held-out loss "
        "in brackets.",
        "",
        table_b,
        "",
        same_tokens(by_link, links) if len(links) > 1 else "",
        "",
        seeds_note(records),
        "",
        "Left out: " + "; ".join(f"**{k}** — {v}" for k, v in left_out().items()) + ".",
        "",
        (f"**Not run ({NOT_RUN})**: " + (", ".join(f"`{s}`" for s in nowhere) + " on any link" if nowhere else "")
         + ("; " if nowhere and unrun_links else "") + (", ".join(f"`{lk}`" for lk in unrun_links)
                                                          + ": no setting" if unrun_links else "")
         + "."
         if nowhere or unrun_links else ""),
        "",
        f"{runs} runs, {cpu / 3600:.2f} h of run time ({wrapped(records)}"
        + (f"; the sweep {sweep_s / 3600:.2f} h of wall time" if sweep_s else "") + "). Reproduce the runs shown: "
        + "; ".join(f"`{base or cmd} --links {lk} --only {' '.join(made[lk])} --extra-seeds 0`"
                    for lk in links if made[lk])
        + "".join(f"; then `{base or cmd} --links {lk} --only {' '.join(seeded)} --extra-seeds {n}`"
                  for lk in links for n, seeded in [extra_seeds(records.get(lk, {}))] if seeded)
        + ". The whole sweep (every setting on every link, more seeds for the headline rows): `" + cmd + "`.",
    ])
    path = RESULTS / f"{name}.md"
    path.write_text(f"# Equal loss: every setting run to held-out loss {job.target:g}\n\n{notes}\n\n"
                    f"![loss vs time per link]({name}.png)\n")
    return path


def seeds_note(records: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """What the seeds allow to be read: one seed per setting and link, or more for some rows."""
    made = [r for lk in records.values() for rs in lk.values() for r in rs if not r.get("skipped")]
    more = sorted({r["spec"] for r in made if r["seed"] != 0})
    if not more:
        return ("**One seed (0) per setting and link**: each number is one run, its run-to-run spread not measured; "
                "read small differences in time (tens of percent) as unresolved.")
    return f"Seed 0 for every setting; more seeds for {', '.join(f'`{s}`' for s in more)} (mean ± sd)."


def wrapped(records: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """How the runs held the machine: ``each run alone on the machine's cores`` or a count per wrap."""
    wraps: dict[str, int] = {}
    for lk in records.values():
        for rs in lk.values():
            for r in rs:
                if r.get("skipped"):
                    continue
                w = " ".join(Path(r.get("wrap", [""])[0]).name.split() + r.get("wrap", [])[1:]) if r.get("wrap") else ""
                wraps[w] = wraps.get(w, 0) + 1
    if list(wraps) == ["cpulock exclusive"]:
        return "each run alone on the machine's cores (nothing else running)"  # the records' lock: all cores
    return ", ".join(f"{n} run(s) " + (f"under `{w}`" if w else "unwrapped") for w, n in wraps.items())


def bytes_table(recs: dict[str, dict[str, Any]], job: Job) -> tuple[str, str]:
    base = recs.get(BASELINE)
    base_bytes = base["inter_bytes_to_target"]["mean"] if base and base["inter_bytes_to_target"] else None
    base_tokens = base["tokens_to_target"]["mean"] if base and base["tokens_to_target"] else None
    rows = []

    def order(s: str) -> float:
        r = recs[s]
        return r["inter_bytes_to_target"]["mean"] if r["inter_bytes_to_target"] else math.inf

    for s in sorted(recs, key=order):
        r = recs[s]
        b, t = r["inter_bytes_to_target"], r["tokens_to_target"]
        reached = f"{r['reached']}/{r['runs']}"
        if b is not None:
            fewer = f"{base_bytes / b['mean']:,.1f}" if base_bytes else "—"
            tok = f"{fmt_stat(t, 1e6)} M" + (f" ({t['mean'] / base_tokens:.2f}×)" if base_tokens else "")
            rows.append([f"`{s}`", reached, fmt_stat(b, 1e6), fewer, tok, f"{r['best_loss']:.3f}"])
        else:
            sent = statistics.mean(x["inter_bytes"] for x in r["runs_detail"])
            toks = statistics.mean(x["tokens"] for x in r["runs_detail"])
            rows.append([f"`{s}`", reached, f"({sent / 1e6:,.0f} at the cap)", "—",
                         f"(not reached in {toks / 1e6:.3g} M)",
                         f"{r['best_loss']:.3f} (+{r['best_loss'] - job.target:.3f})"])
    header = ["setting", "reached", "inter-node MB to target", "× fewer than ddp", "tokens to target (× ddp)",
              "best held-out loss"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    low = {s: r for s, r in recs.items() if r["low_comm"] and r["inter_bytes_to_target"]}
    if base_bytes and low:
        best = min(low, key=lambda s: low[s]["inter_bytes_to_target"]["mean"])
        ratio = base_bytes / low[best]["inter_bytes_to_target"]["mean"]
        headline = (f"**Best low-communication row: `{best}`, {ratio:,.0f}× fewer inter-node bytes than {BASELINE} "
                    f"to the same loss** (goal ≥ 100×: {'met' if ratio >= 100 else 'not met'}; Streaming DiLoCo's "
                    "table reports ~400×).")
        if ratio < 100:
            near = [s for s, r in recs.items() if r["low_comm"] and not r["reached"]]
            if near:
                closest = min(near, key=lambda s: recs[s]["best_loss"])
                headline += (f" Of the rows that did not reach it, `{closest}` came closest (best "
                             f"{recs[closest]['best_loss']:.3f}).")
    elif not base_bytes:
        headline = f"The baseline ({BASELINE}) did not reach the target here: no ratio."
    else:
        headline = "No low-communication row reached the target."
    return "\n".join(lines), headline


def time_table(by_link: dict[str, dict[str, dict[str, Any]]], links: list[str], job: Job) -> str:
    specs: list[str] = []
    for link in links:
        specs += [s for s in by_link[link] if s not in specs]
    fastest: dict[str, str | None] = {}
    for link in links:
        reached = {s: r for s, r in by_link[link].items() if r["time_to_target_s"]}
        fastest[link] = min(reached, key=lambda s: reached[s]["time_to_target_s"]["mean"]) if reached else None
    header = ["setting", "tokens to target (M)"] + [f"{lk}: s to target (× the fastest)" for lk in links]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in specs:
        row = [f"`{s}`"]
        toks = next((by_link[lk][s]["tokens_to_target"] for lk in links if s in by_link[lk]
                     and by_link[lk][s]["tokens_to_target"]), None)
        row.append(fmt_stat(toks, 1e6))
        for link in links:
            r = by_link[link].get(s)
            if r is None:
                row.append(f"not run ({NOT_RUN})")
                continue
            t = r["time_to_target_s"]
            if r["skipped"]:
                row.append(f"— (not run: {r['skipped']})")
                continue
            if t is None:
                how = "; ".join(sorted({x["stopped_by"] for x in r["runs_detail"] if not x["reached"]}))
                row.append(f"— ({r['best_loss']:.2f}; {how.replace('max_', '')} cap)" if r["reached"] == 0
                           else f"— in {r['runs'] - r['reached']} of {r['runs']} seeds")
                continue
            best = by_link[link][fastest[link]]["time_to_target_s"]["mean"] if fastest[link] else t["mean"]
            cell = fmt_stat(t, 1.0, 3) + f" ({t['mean'] / best:.2f}×)"
            row.append(f"**{cell}**" if s == fastest[link] else cell)
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def same_tokens(by_link: dict[str, dict[str, dict[str, Any]]], links: list[str]) -> str:
    """Whether each setting's seed-0 run reached the target at the same tokens on every link where it reached it
    (true for every setting whose arithmetic does not depend on timing: all but the adaptive ACCO/DPU/WP stages)."""
    same, differ = [], []
    for s in {s for lk in links for s in by_link[lk]}:
        toks = {lk: by_link[lk][s]["runs_detail"][0]["tokens_to_target"] for lk in links
                if s in by_link[lk] and by_link[lk][s]["runs_detail"][0]["reached"]
                and not by_link[lk][s]["skipped"]}
        if len(toks) > 1:
            (same if len(set(toks.values())) == 1 else differ).append(s)
    text = (f"Tokens to the target (seed 0) are the same on every link where a setting reached it for {len(same)} "
            f"of {len(same) + len(differ)} settings")
    return text + (f"; they differ for {', '.join(f'`{s}`' for s in sorted(differ))} (stages that adapt to the "
                   "link, or timing-dependent arithmetic)." if differ else ".")


COLORS = {"ddp": "black", "zero1": "dimgray", "fsdp": "gray", "acco": "tab:orange", "dpu": "goldenrod",
          "wp": "tab:brown", "demo": "tab:blue", "localsgd": "tab:olive", "diloco": "tab:green", "cdp": "tab:purple"}


def plot(by_link: dict[str, dict[str, dict[str, Any]]], links: list[str], job: Job, path: Path, ref: str) -> None:
    """Held-out loss vs training time on each link (the baseline, the 4 fastest and the 2 low-communication rows with
    the fewest bytes to the target labelled), and vs tokens on the reference link."""
    from quietsync.cli.figures import pyplot

    plt = pyplot()
    panels = len(links) + 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 5.5), constrained_layout=True, squeeze=False)
    for ax, link in zip(axes[0], [*links, ref]):
        by_tokens = ax is axes[0][-1]
        recs = by_link[link]
        reached = sorted((s for s in recs if recs[s]["time_to_target_s"]),
                         key=lambda s: recs[s]["time_to_target_s"]["mean"])
        fewest = sorted((s for s in reached if recs[s]["low_comm"]),
                        key=lambda s: recs[s]["inter_bytes_to_target"]["mean"])
        labelled = set(reached[:4]) | {BASELINE} | set(fewest[:2])
        for s, r in recs.items():
            run = r["runs_detail"][0]
            if not run["curve"]:
                continue
            xs = [c["tokens" if by_tokens else "time_s"] for c in run["curve"][1:]]
            ys = [c["loss"] for c in run["curve"][1:]]
            ax.plot(xs, ys, "-", lw=2 if s in labelled else 0.8, alpha=1 if s in labelled else 0.45,
                    color=COLORS.get(r["strategy"], "tab:red"), label=s if s in labelled else None)
        ax.axhline(job.target, color="red", ls="--", lw=1, label=f"target {job.target:g}")
        ax.set_xscale("log")
        ax.set(xlabel="tokens, all workers (log)" if by_tokens else "seconds of training (log)",
               ylabel="held-out loss", ylim=(job.target - 0.5, job.target + 2.0),
               title=f"{link}: loss vs tokens" if by_tokens else f"{link}: loss vs time")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- the pilot
LEVELS = (4.0, 3.8, 3.6, 3.5)
"""Losses whose first step the pilot table shows."""


def pilot_choice(evals: list[dict[str, Any]]) -> str:
    """Why the sweep's lr and target, with the chosen run's (constant lr 2e-3) numbers."""
    def first(level: float) -> int:
        return next(e["step"] for e in evals[1:] if e["loss"] <= level)

    at, above, below = first(FULL.target), first(FULL.target + 0.5), first(FULL.target - 0.1)
    tokens = at * FULL.workers * FULL.micro_batch_tokens
    return (
        f"Chosen for the sweep: **lr {FULL.lr:g}, warm-up then constant**, the best constant lr (1e-3 trails it "
        "everywhere, 4e-3 stalls near 4); a constant lr keeps each run's trajectory independent of its budget, so a "
        "run stopped at the target is the prefix of a longer one and caps may differ per setting (cosine to 10% ends "
        f"lower, but its curve depends on the length it is given). **Target {FULL.target:g}**: the baseline reaches "
        f"it at step {at} ({tokens / 1e6:.2f} M tokens), where its descent has slowed — "
        f"{FULL.target + 0.5:g} → {FULL.target:g} took {at - above} steps, {FULL.target:g} → {FULL.target - 0.1:g} "
        f"takes {below - at} more (a rate of {0.1 / (below - at) * 256:.2f} per 256 steps against "
        f"{0.5 / (at - above) * 256:.2f} before). The curve has no plateau within 3 epochs of the corpus (about 1 M "
        "training tokens), so \"a bit above the baseline's plateau\" is read as where its descent has slowed, at a "
        f"cost the sweep can afford. Token cap {FULL.tokens / 1e6:g} M ({FULL.tokens / tokens:.1f}× the baseline's "
        f"tokens to the target; at least {FULL.min_outer_steps} outer steps of every DiLoCo-family setting).")


PILOT = [("const lr 1e-3", 1e-3, 1.0), ("const lr 2e-3", 2e-3, 1.0), ("const lr 4e-3", 4e-3, 1.0),
         ("cosine lr 2e-3 (to 10%)", 2e-3, 0.1)]


def pilot(work: Path, wrap: list[str], steps: int) -> None:
    """The baseline (zero1 ≡ ddp) without a link, for ``steps`` steps at a few lrs: the plateau the target is
    chosen from."""
    rows, curves, choice = [], {}, ""
    for label, lr, floor in PILOT:
        out = work / "pilot" / slug(f"{label}-{steps}")
        if not (out / "summary.json").exists():
            flags = ["--strategy", "zero1", "--nproc", "2", "--nodes", "2", "--model", FULL.model, "--threads", "1",
                     "--micro-batch-size", str(FULL.micro_batch_size), "--seq-len", str(FULL.seq_len),
                     "--lr", repr(lr), "--warmup-steps", str(FULL.warmup_steps), "--min-lr-ratio", repr(floor),
                     "--max-steps", str(steps), "--eval-every", "32", "--eval-windows", str(FULL.eval_windows),
                     "--seed", "0", "--overwrite"]
            cmd = [*wrap, sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from common import "
                   "run_train; run_train(__import__('pathlib').Path(sys.argv[2]), *sys.argv[3:])",
                   str(HERE.parent), str(out), *flags]
            print(f"pilot: {label}", flush=True)
            subprocess.run(cmd, check=True)
        evals = [json.loads(x) for x in (out / "metrics-rank0.jsonl").read_text().splitlines() if x.strip()]
        evals = [e for e in evals if e.get("event") == "eval"]
        curves[label] = [(e["tokens_total"] * 2, e["loss"]) for e in evals]
        if (lr, floor) == (FULL.lr, 1.0):
            choice = pilot_choice(evals)
        best = min(e["loss"] for e in evals)
        at = {frac: next(e["loss"] for e in evals if e["step"] >= frac * steps) for frac in (0.25, 0.5, 0.75)}
        first = [next((e["step"] for e in evals[1:] if e["loss"] <= level), None) for level in LEVELS]
        rows.append([label, f"{at[0.25]:.3f}", f"{at[0.5]:.3f}", f"{at[0.75]:.3f}", f"{evals[-1]['loss']:.3f}",
                     f"{best:.3f}", *["—" if f is None else f for f in first]])
    tokens = steps * 2 * FULL.micro_batch_tokens
    write_markdown("equal_loss_pilot", "Equal-loss pilot: the baseline's curve, where the target comes from",
                   ["zero1 run", f"loss at {steps // 4} steps", f"at {steps // 2}", f"at {3 * steps // 4}",
                    f"final ({steps} steps, {tokens / 1e6:.2f} M tokens)", "best",
                    *[f"first step ≤ {level:g}" for level in LEVELS]], rows,
                   notes=f"2 workers as 2 nodes (one thread each), no link, model {FULL.model}, micro-batch "
                         f"{FULL.micro_batch_size}×{FULL.seq_len} ({2 * FULL.micro_batch_tokens:,} tokens per step), "
                         f"{FULL.warmup_steps} warm-up steps, evaluations every 32 steps on the same 48 held-out "
                         "windows, seed 0. Reproduce: "
                         f"`python benchmarks/bench_equal_loss.py --pilot --pilot-steps {steps}`.\n\n" + choice)
    (RESULTS / "equal_loss_pilot.json").write_text(json.dumps({"steps": steps, "curves": curves}, indent=1) + "\n")
    print((RESULTS / "equal_loss_pilot.md").read_text())


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 settings, one emulated link (100 Mbit), target 6.0")
    ap.add_argument("--smoke", action="store_true", help="every setting to a high target (checks the sweep end to end)")
    ap.add_argument("--pilot", action="store_true", help="the baseline's lr sweep that sets lr, tokens and target")
    ap.add_argument("--pilot-steps", type=int, default=1536)
    ap.add_argument("--report", action="store_true", help="only rebuild the results from the records")
    ap.add_argument("--links", nargs="+", default=None, choices=list(LINKS), help="links (default: all)")
    ap.add_argument("--only", nargs="+", default=None, metavar="SPEC",
                    help="only these settings, in this order: a spec (exact) or the start of specs (e.g. diloco "
                         "demo:replicator=random)")
    ap.add_argument("--extra-seeds", type=int, default=2, help="more seeds for the headline rows (default 2)")
    ap.add_argument("--list", action="store_true", help="print the settings (specs) and exit")
    ap.add_argument("--work", type=Path, default=Path("runs/equal_loss"), help="records and run folders")
    ap.add_argument("--wrap", default="", help='command prefix of every run, e.g. "taskset -c 0,1"')
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        call = json.loads(args.child)
        run_one(Job(**call["job"]), call["name"], call["knobs"], call["link"], call["seed"], Path(call["work"]),
                call["port"], call["wrap"])
        return
    wrap = shlex.split(args.wrap)
    if args.pilot:
        pilot(args.work, wrap, args.pilot_steps)
        return
    job = QUICK if args.quick else SMOKE if args.smoke else FULL
    grid = settings(args.quick)
    if args.only:
        grid = only(grid, args.only)
    if args.list:
        for n, k in grid:
            print(spec(n, k))
        return
    links = args.links or (["100mbit"] if args.quick else list(LINKS))
    if SHAPED in links and not args.report and (os.geteuid() != 0 or not shutil.which("tc")):
        ap.error("the shaped link needs root and tc (leave it out with --links 10mbit 100mbit 1gbit)")
    name = "equal_loss_quick" if args.quick else "equal_loss_smoke" if args.smoke else "equal_loss"
    sweep = Sweep(job, args.work, wrap, dry=args.report)
    t0 = time.perf_counter()
    records: dict[str, dict[str, list[dict[str, Any]]]] = {}
    shaped = shaped_link() if SHAPED in links and not args.report else None
    try:
        if shaped is not None:
            shaped.__enter__()
        for link in links:  # seed 0 of everything, then more seeds of this link's headline rows
            for n, k in grid:
                ref = records.get(REFERENCE_LINK, {}).get(spec(n, k), [None])[0] or sweep.cached(n, k, REFERENCE_LINK)
                why = not_reachable(job, n, k, link, ref)
                rec = skipped(n, k, link, why) if why else sweep.get(n, k, link, 0)
                if rec is not None:
                    records.setdefault(link, {}).setdefault(spec(n, k), []).append(rec)
            if link not in records:
                continue
            first = {s: rs[0] for s, rs in records[link].items()}
            more = headline_rows(link, first) if args.extra_seeds else []
            if args.report:  # every extra seed that was run, headline row or not (e.g. `--only` runs of a pick)
                more += [s for s in first if s not in more]
            for s in more:
                n, k = next((n, k) for n, k in grid if spec(n, k) == s)
                for seed in range(1, 1 + max(args.extra_seeds, SEEDS_KEPT if args.report else 0)):
                    rec = sweep.cached(n, k, link, seed) if args.report else sweep.get(n, k, link, seed)
                    if rec is not None:
                        records[link][s].append(rec)
    finally:
        if shaped is not None:
            shaped.__exit__()
    ran = [lk for lk in links if any(not r.get("skipped") for rs in records.get(lk, {}).values() for r in rs)]
    unrun = [lk for lk in links if lk not in ran]
    links = ran
    if not links:
        print("no records yet")
        return
    base = "python benchmarks/bench_equal_loss.py" + (" --quick" if args.quick else " --smoke" if args.smoke else "")
    cmd = base + (f" --links {' '.join(args.links)}" if args.links else "") + (
        f" --only {' '.join(args.only)}" if args.only else "")
    path = report(job, grid, links, records, name, cmd, None if args.report else time.perf_counter() - t0, unrun,
                  base)
    print(path.read_text())


if __name__ == "__main__":
    main()
