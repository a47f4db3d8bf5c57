"""The cost of ``cdp``, beside it: Cyclic Data Parallelism's point-to-point transfers and its cyclic timeline.

Which worker sends which stage's gradient to whom in a cycle is the strategy's own timeline
(:class:`~quietsync.strategies.cdp.schedule.Schedule`: the reduce chain over the slots, then the distribution chain from
the root), read here rather than re-derived. The time model: a cycle has ``period`` time steps (``2N`` for
v1/v2); each worker computes its ``N/W`` micro-batches' stage operations spread over them, a time step lasting
as long as its slowest operation (stages balanced by parameters are not balanced in time: the largest stage
sets the pace); a hop of the chains must arrive before the time step that uses it, so a hop slower than a time
step stretches that time step by the difference — the hops one worker sends go one after the other on its link,
so their stretches add up (measured: on a link slower than compute a cycle takes about one worker's sends, not
``period`` hops; stretching every time step to the slowest hop over-predicted 2.1–2.3×, benchmarks/results/
plan.md); and each worker's link must carry its cycle's sends (and receives) within the cycle, full duplex.
Every worker applies every stage's update once per cycle (the root and each relay).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...cost.costmodel import Comm, Cost, Ctx
from ...cost.schedule import Schedule
from ...cost.terms import Term
from ...cost.workload import Workload
from ...topology import Topology
from ..parts.cost import ADAMW, OptimizerState
from .schedule import Schedule as Timeline


@dataclass(frozen=True)
class CyclicTimeline(Term):
    """One cycle of CDP on every worker (see the module docstring)."""

    stages: int
    workers: int
    period: int
    stage_fractions: tuple[float, ...]
    hops: tuple[Comm, ...]
    """Every send of a cycle, all workers' (``Comm.peer``: the receiver)."""
    senders: tuple[int, ...]
    """The sender of each hop."""
    elements: int
    """Parameter elements every worker's optimizer updates per cycle."""

    def cost(self, ctx: Ctx) -> Cost:
        n, w = self.stages, self.workers
        mb = ctx.compute.micro_batch_s * ctx.slowest
        imbalance = max(self.stage_fractions) * n
        t_step = (n / w) * (mb / (2 * n)) * imbalance
        tx = [0.0] * w
        rx = [0.0] * w
        stretch = [0.0] * w  # how far a worker's hops push the time steps that wait for them
        for c, src in zip(self.hops, self.senders):
            topo = Topology(src, ctx.topo.world_size, ctx.topo.nodes)
            t = ctx.links.seconds(c.link(topo), c, topo)
            tx[src] += t
            rx[c.peer] += t
            stretch[src] += max(0.0, t - t_step)
        cycle = max(self.period * t_step + max(stretch), max(tx), max(rx))
        opt = ctx.compute.optimizer_s(self.elements) * ctx.slowest
        compute = (n / w) * mb + opt
        return Cost(cycle + opt, compute, sum(tx[ctx.topo.rank:ctx.topo.rank + 1]), n / w, float(n))

    def describe(self) -> str:
        return f"cycle of {self.period} time steps, {len(self.hops)} point-to-point hops"


def cdp(w: Workload, topo: Topology, cfg: Any, opt: OptimizerState = ADAMW) -> Schedule:
    """CDP on ``world``: per cycle (committed step), each stage's gradient goes down the reduce chain and the
    mean back through the distribution chain, point to point."""
    world = topo.world_size
    n = cfg.stages if cfg.stages is not None else (world if world > 1 else 2)
    if n % world:
        raise ValueError(f"stages must be a multiple of the number of workers ({world}), got {n}")
    if n not in w.stage_numels:
        raise ValueError(f"the workload has no cut into {n} CDP stages (build it with stages=({n},))")
    stage_bytes = [s * w.dtype_bytes for s in w.stage_numels[n]]
    timeline = Timeline(n, world, cfg.rule)
    comms: list[Comm] = []
    hops: list[Comm] = []
    senders: list[int] = []
    for j in range(n):
        for m in timeline.messages_sent(1, j):  # a steady-state cycle; peers do not depend on the cycle
            send = Comm("send", "world", stage_bytes[j], f"cdp {m.kind} stage {j}", peer=m.dst)
            hops.append(send)
            senders.append(m.src)
            if m.src == topo.rank:
                comms.append(send)
            if m.dst == topo.rank:
                comms.append(Comm("recv", "world", stage_bytes[j], f"cdp {m.kind} stage {j}", peer=m.src))
    total = sum(w.stage_numels[n])
    step = CyclicTimeline(n, world, timeline.period, tuple(s / total for s in w.stage_numels[n]), tuple(hops),
                          tuple(senders), w.params)
    memory = {"params": w.param_bytes, "previous_versions": w.param_bytes, "gradient_partials": 0,
              "optimizer_state": opt.bytes(w.numels)}
    return Schedule("cdp", f"cdp {cfg.rule} N={n}", tuple(comms), step, memory, config=cfg,
                    notes=("cdp's memory_report() leaves out the optimizer state; the plan counts it",))
