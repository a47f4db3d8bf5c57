"""The cost of the overlapping family, beside it: ``acco``, ``dpu``, ``wp``.

Each stage, the main thread accumulates micro-batches while a job runs on the communication worker: an
all-reduce of the per-worker micro-batch counts and times (float64, two per worker), a reduce-scatter of the
handed-over gradients, an optimizer step on this worker's shard (ACCO: an uncommitted estimate or the commit; WP: the
commit and a second, predicted step), and an all-gather of the resulting parameters. A stage holds as many
micro-batches as it takes for the job to finish (:class:`~quietsync.cost.terms.Adaptive`), so computation
hides the network at any link speed — a slower link means more micro-batches (tokens) per step, not idle
workers — unless ``max_accumulation`` caps the stage. ACCO has two stages per committed step, DPU and WP one.
Under ``--adapt`` ACCO's commit job (DPU's and WP's update job) all-reduces two more floats per worker (the measured
link and micro-batch), and the step is the step at the cap the controller picks on the link (:mod:`.adapt_cap`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...cost.costmodel import Comm
from ...cost.schedule import Schedule
from ...cost.terms import Adaptive, Seq, Term, Wire, copy, optimizer
from ...cost.workload import Workload
from ...topology import Topology
from ..parts.cost import ADAMW, FirstThatFits, OptimizerState, group_of
from ..substrates.cost import flat_collectives, flat_shard, sharded_state_memory


def _job(w: Workload, topo: Topology, cfg: Any, name: str, steps: int, probe: bool = False
         ) -> tuple[list[Comm], Term]:
    """One job: counts all-reduce (``probe``: with the link and micro-batch ``--adapt`` agrees), reduce-scatter,
    ``steps`` optimizer steps on the shard, all-gather."""
    n = group_of(topo, "world")
    if n == 1:
        return [], Seq(*(optimizer(flat_shard(w, 1)) for _ in range(steps)))
    counts = Comm("all_reduce", "world", (32 if probe else 16) * n,
                  f"{name}: all-reduce micro-batch counts and times" + (", link and micro-batch" if probe else ""))
    rs, ag = flat_collectives(w, topo, "world", cfg.reduce_dtype, name)
    shard = flat_shard(w, n)
    work = [optimizer(shard, f"{name}: optimizer step on the shard") for _ in range(steps)]
    return [counts, rs, ag], Seq(Wire([counts, rs]), *work, Wire([ag]))


def _stage(job: Term, cfg: Any, w: Workload) -> Term:
    hand_over = copy(3 * w.padded(1) * w.dtype_bytes, "hand-over (P ← B, B ← G, G ← 0)")
    return Seq(Adaptive(job, cfg.min_accumulation, cfg.max_accumulation, cfg.deterministic_accumulation), hand_over)


def _label(name: str, cfg: Any) -> str:
    if cfg.deterministic_accumulation is not None:
        return f"{name} {cfg.deterministic_accumulation} mb/stage"
    cap = f"≤{cfg.max_accumulation}" if cfg.max_accumulation else ""
    return f"{name} adaptive{' ' + cap if cap else ''}"


def _memory(w: Workload, topo: Topology, opt: OptimizerState, estimate: bool, snapshot: bool) -> dict[str, int]:
    n = group_of(topo, "world")
    shard = flat_shard(w, n)
    base = sharded_state_memory(w, topo, "world", opt)
    flat = w.padded(n) * w.dtype_bytes
    return {**base, "grads": flat, "comm_buffer": flat,
            "estimate_scratch": shard * 4 + base["optimizer_state"] if estimate else 0,
            "committed_snapshot": shard * 4 if snapshot else 0}


def acco(w: Workload, topo: Topology, cfg: Any, opt: OptimizerState = ADAMW) -> Schedule:
    """ACCO: two stages per committed step, the estimate job then the commit job, each hidden behind the
    micro-batches of a stage; with ``adapt``, the step at the cap its controller picks on the link
    (:class:`~quietsync.strategies.parts.cost.FirstThatFits` over the caps, smallest first)."""
    adapt = bool(getattr(cfg, "adapt", False))
    c1, estimate = _job(w, topo, cfg, "acco estimate", 1)
    c2, commit = _job(w, topo, cfg, "acco commit", 1, probe=adapt)
    step, mark = _adapted(acco, w, topo, cfg, opt, Seq(_stage(estimate, cfg, w), _stage(commit, cfg, w)))
    memory = {**_memory(w, topo, opt, True, True), "tilde_grad_shard": flat_shard(w, group_of(topo, "world")) * 4}
    return Schedule("acco", _label("acco", cfg) + mark, tuple(c1 + c2), step, memory, config=cfg)


def _adapted(schedule: Any, w: Workload, topo: Topology, cfg: Any, opt: OptimizerState, step: Term
             ) -> tuple[Term, str]:
    """``adapt``: the step at the cap the controller picks on the link (each cap costed as a fixed run, its 16 bytes
    per worker fewer on the count all-reduce: negligible), and the label's mark."""
    if not getattr(cfg, "adapt", False):
        return step, ""
    return FirstThatFits("cap", tuple(
        (c, schedule(w, topo, dataclasses.replace(cfg, max_accumulation=c, adapt=False), opt).step)
        for c in cfg.cap_candidates()), cfg.adapt_overhead), " adapt"


def dpu(w: Workload, topo: Topology, cfg: Any, opt: OptimizerState = ADAMW) -> Schedule:
    """DPU: one stage per committed step, hiding the previous round's update job."""
    comms, job = _job(w, topo, cfg, "dpu update", 1, probe=bool(getattr(cfg, "adapt", False)))
    step, mark = _adapted(dpu, w, topo, cfg, opt, _stage(job, cfg, w))
    return Schedule("dpu", _label("dpu", cfg) + mark, tuple(comms), step, _memory(w, topo, opt, False, False),
                    config=cfg)


def wp(w: Workload, topo: Topology, cfg: Any, opt: OptimizerState = ADAMW) -> Schedule:
    """WP: like DPU, with a second (predicted) optimizer step in the job."""
    comms, job = _job(w, topo, cfg, "wp update", 2, probe=bool(getattr(cfg, "adapt", False)))
    step, mark = _adapted(wp, w, topo, cfg, opt, _stage(job, cfg, w))
    return Schedule("wp", _label("wp", cfg) + mark, tuple(comms), step, _memory(w, topo, opt, True, True),
                    config=cfg)
