"""The cost of the local family, beside it: ``localsgd`` and ``diloco`` (Streaming and hierarchical DiLoCo too).

Workers train alone (or synchronously inside their node) and average every so many steps: Local SGD
all-reduces the parameters every K steps; DiLoCo syncs each of F fragments every H steps, staggered by H/F,
with the pseudo-gradient in fp32 or bf16 (all-reduce), int8 with a scale (two all-gathers), packed low-bit codes
or SparseLoCo's top-k (one all-gather of the packed payload) or through a replicator, and with τ > 0 that
exchange runs on the communication worker while τ inner steps go on. Fragments: contiguous or strided layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ...cost.costmodel import Comm, Cost, Ctx, numel
from ...cost.schedule import Schedule
from ...cost.terms import Every, Exposed, MicroBatches, Seq, Term, Wire, copy, optimizer
from ...cost.workload import Workload
from ...topology import Topology
from ...wire.packed import LOWBIT_PSEUDO_GRAD_DTYPES, packed_chain
from ..parts.cost import ADAMW, FirstThatFits, OptimizerState, group_of, replicator, replicator_comm
from ..registry import schedule_of, strategy_config
from .adaptive import plan_from_speeds
from .fragments import split_fragments, strided_fragments


@dataclass(frozen=True)
class SpeedShares(Term):
    """Adaptive inner steps (``inner_steps=adaptive``, :mod:`~quietsync.strategies.local.adaptive`): in a round of
    ``period`` (L) nominal steps worker i takes ``H_i = max(1, round(L·v_i / max v))`` inner steps at its own pace
    (the strategy's own :func:`~quietsync.strategies.local.adaptive.plan_from_speeds`; ``v_i`` its inner steps per
    second, or ``speeds`` where the run fixes them), so the round lasts the longest ``H_i·t_i`` — about the fastest
    worker's L steps — instead of L steps at the slowest worker's pace, and holds every worker's own micro-batches:
    the round's tokens are the sum over workers of speed × round time. A nominal step costs the round over L. With
    equal workers every ``H_i = L``: the ``inner`` step itself."""

    inner: Term
    period: int
    speeds: tuple[float, ...] | None = None

    def cost(self, ctx: Ctx) -> Cost:
        scales = ctx.compute.scales(ctx.topo.world_size)
        # each worker's inner step alone, at its own speed (the inner term costs the slowest of the profile's scales)
        each = [self.inner.cost(Ctx(dataclasses.replace(ctx.compute, worker_scale=(s,) * len(scales)), ctx.links,
                                    ctx.topo)) for s in scales]
        if self.speeds and len(self.speeds) != len(scales):  # as the run refuses it (adaptive.AdaptivePlan)
            raise ValueError(f"worker_speeds must have one value per worker ({len(scales)}), got {len(self.speeds)}")
        speeds = list(self.speeds) if self.speeds else [1.0 / c.time if c.time > 0 else 1.0 for c in each]
        plan = plan_from_speeds(speeds, self.period)
        ends = [h * c.time for h, c in zip(plan, each)]
        last = max(range(len(ends)), key=ends.__getitem__)  # the worker that arrives at the sync last sets the round
        n = len(plan)
        return Cost(ends[last] / self.period, plan[last] * each[last].compute / self.period,
                    plan[last] * each[last].comm / self.period,
                    sum(h * c.micro_batches for h, c in zip(plan, each)) / n / self.period,
                    sum(h * c.micro_batches for h, c in zip(plan, each)) / self.period)

    def describe(self) -> str:
        return f"[{self.inner.describe()}] at each worker's own pace, its share of {self.period} by its speed"


@dataclass(frozen=True)
class AdaptedH(FirstThatFits):
    """``--adapt``: the step at the H the run's controller picks on this link (:mod:`~quietsync.strategies.local.adapt`,
    ``pick_sync_every``'s rule) — the smallest candidate whose exposed communication is at most ``overhead`` of its
    compute, else the largest; with ``tokens`` (``adapt_objective`` time_to_target: each H's tokens to the target)
    the H of least ``tokens × step time``. ``steps``: ``(H, the step at that H)``, smallest first. On a link that
    changes, each steady stretch of it is costed with the H picked for it."""

    tokens: tuple[float, ...] | None = None

    def pick(self, ctx: Ctx) -> tuple[int, Cost]:
        """The H picked on ``ctx``'s link, and the step's cost at it."""
        if self.tokens is None:
            return super().pick(ctx)
        costs = [(h, t.cost(ctx)) for h, t in self.steps]
        # every H's step holds the same tokens: time to target ∝ tokens × step time
        best = min(k * c.time for k, (_, c) in zip(self.tokens, costs))
        return next((h, c) for k, (h, c) in zip(self.tokens, costs) if k * c.time <= best * (1 + 1e-9))


def _shares(inner: Term, cfg: Any, period: int) -> Term:
    """``inner`` as the step of ``cfg``'s inner-step mode: fixed (every worker waits for the slowest at the sync), or
    adaptive (:class:`SpeedShares`)."""
    if getattr(cfg, "inner_steps", "fixed") != "adaptive":
        return inner
    return SpeedShares(inner, period, cfg.worker_speeds)


def localsgd(w: Workload, topo: Topology, cfg: Any, opt: OptimizerState = ADAMW) -> Schedule:
    """Local SGD: a local optimizer step every ``accumulation`` micro-batches; every ``sync_every`` steps one
    all-reduce of the parameters (and of the optimizer's per-element state with ``average_optimizer_state``,
    packed into the same buffer: all fp32)."""
    k = cfg.sync_every
    n = group_of(topo, "world")
    elements = w.params * (1 + (opt.per_element // 4 if cfg.average_optimizer_state else 0))
    comms = []
    if n > 1:
        comms = [Comm("all_reduce", "world", elements * w.dtype_bytes, "localsgd: all-reduce parameters",
                      steps=(k,))]
    step = Seq(_shares(Seq(MicroBatches(cfg.accumulation), optimizer(w.params)), cfg, cfg.round_length()),
               Every(Wire(comms), k))
    memory = {"params": w.param_bytes, "grads": w.param_bytes, "optimizer_state": opt.bytes(w.numels),
              "synced_params": w.param_bytes}
    label = f"localsgd K={k}" + (" +state" if cfg.average_optimizer_state else "")
    if cfg.inner_steps == "adaptive":
        label += " adaptive"
    return Schedule("localsgd", label, tuple(comms), step, memory, period=k, config=cfg)


def fragments(w: Workload, count: int, pattern: str = "contiguous") -> list[list[int]]:
    """Parameter indices of each DiLoCo fragment: contiguous, balanced by elements (as ``split_fragments``), or
    strided whole layers (as ``strided_fragments`` over the workload's layers)."""
    if pattern == "strided":
        layers = [list(u) for u in w.layers] or [[i] for i in range(len(w.shapes))]
        return strided_fragments(layers, count)
    return split_fragments(list(w.numels), count)


def _chain(cfg: Any, sizes: list[int], f: int):
    """The packed compression chain of a fragment (low-bit dtypes, SparseLoCo), as the strategy builds it."""
    return packed_chain(dtype=cfg.pseudo_grad_dtype, sizes=sizes, sparseloco=cfg.outer == "sparseloco",
                        block=cfg.pseudo_grad_block, rounding=cfg.pseudo_grad_rounding, density=cfg.topk_density,
                        chunk=cfg.topk_chunk, seed=cfg.seed + f)


def _packed(cfg: Any) -> bool:
    return cfg.outer == "sparseloco" or cfg.pseudo_grad_dtype in LOWBIT_PSEUDO_GRAD_DTYPES


def _outer_comms(w: Workload, topo: Topology, cfg: Any, group: str) -> list[Comm]:
    """The transfers of every fragment's sync over one period of H steps."""
    n = group_of(topo, group)
    if n == 1:
        return []
    H, F = cfg.sync_every, cfg.fragments
    out: list[Comm] = []
    for f, idx in enumerate(fragments(w, F, cfg.fragment_pattern)):
        at = ((f + 1) * H // F) % H or H
        shapes = [w.shapes[i] for i in idx]
        size = sum(numel(s) for s in shapes)
        name = f"diloco fragment {f}"
        if cfg.pseudo_grad_replicator != "none":
            rep = replicator(cfg.pseudo_grad_replicator, cfg.compression, cfg.pseudo_grad_dtype, seed=cfg.seed + f,
                             transfer_block=cfg.pseudo_grad_block)
            out += replicator_comm(rep, shapes, group, n, name, (at,))
        elif _packed(cfg):  # packed codes (+ positions): gathered, decoded and averaged in fp32
            payload = _chain(cfg, [numel(s) for s in shapes], f).payload_bytes(size)
            out.append(Comm("all_gather", group, n * payload, f"{name}: all-gather packed pseudo-gradient",
                            steps=(at,)))
        elif cfg.pseudo_grad_dtype == "int8":
            out += [Comm("all_gather", group, n * size, f"{name}: all-gather int8 codes", steps=(at,)),
                    Comm("all_gather", group, 4 * n, f"{name}: all-gather scales", steps=(at,))]
        else:
            wire = 4 if cfg.pseudo_grad_dtype == "fp32" else 2
            out.append(Comm("all_reduce", group, size * wire, f"{name}: all-reduce pseudo-gradient", steps=(at,)))
    return out


def _inner(w: Workload, topo: Topology, cfg: Any, opt: OptimizerState) -> tuple[list[Comm], Term, dict[str, int]]:
    """The inner step: alone (``local``), or ``ddp``/``zero1`` on the shard group."""
    if cfg.inner == "local":
        memory = {"params": w.param_bytes, "grads": w.param_bytes, "optimizer_state": opt.bytes(w.numels)}
        return [], Seq(MicroBatches(cfg.accumulation), optimizer(w.params)), memory
    # the inner strategy's own schedule, found as diloco finds the inner strategy: by name
    inner_cfg = strategy_config(cfg.inner, {"accumulation": cfg.accumulation})
    inner = schedule_of(cfg.inner)(w, topo, inner_cfg, group="shard", opt=opt)
    return list(inner.comms), inner.step, dict(inner.memory)


def diloco(w: Workload, topo: Topology, cfg: Any, opt: OptimizerState = ADAMW) -> Schedule:
    """DiLoCo: inner steps; fragment f's pseudo-gradient exchanged and the outer step taken every H steps
    (blocking, or hidden behind τ inner steps on the communication worker)."""
    H, F, tau = cfg.sync_every, cfg.fragments, cfg.overlap_delay
    group = "world" if cfg.inner == "local" else "replicate"
    inner_comms, inner, memory = _inner(w, topo, cfg, opt)
    inner = _shares(inner, cfg, cfg.round_length())  # a round of adaptive inner steps: the steps between two syncs
    outer = _outer_comms(w, topo, cfg, group)
    frags = fragments(w, F, cfg.fragment_pattern)
    frag_sizes = [sum(w.numels[i] for i in idx) for idx in frags]
    largest = max(frag_sizes)
    # per sync: the pseudo-gradient (θ_global − θ_local), the outer SGD step, the write-back; per fragment
    sync_work = Seq(copy(3 * largest * 4, "pseudo-gradient and write-back"), optimizer(largest / 4, "outer SGD"))
    per_fragment = [[c for c in outer if c.name.startswith(f"diloco fragment {f}:")] for f in range(F)]
    syncs: list[Term] = []
    for comms in per_fragment:
        wire = Wire(comms)
        if tau == 0:
            syncs.append(Seq(sync_work, wire))
        else:  # the exchange runs on the communication worker while τ inner steps go on
            syncs.append(Seq(sync_work, Exposed(wire, Seq(*([inner] * tau)))))
    step = Seq(inner, *(Every(s, H) for s in syncs))
    rep_mem = {}
    n = group_of(topo, group)
    sparseloco = cfg.outer == "sparseloco"
    if cfg.pseudo_grad_replicator != "none" or sparseloco or (_packed(cfg) and cfg.pseudo_grad_error_feedback):
        rep_mem = {"pseudo_grad_residual": w.params * 4}
    if cfg.pseudo_grad_replicator == "none" and _packed(cfg):
        # the pseudo-gradient, and of the largest: every worker's payload gathered, then decoded one at a time
        # into an fp32 sum
        gathered = max(n * _chain(cfg, [w.numels[i] for i in idx], f).payload_bytes(size) + 2 * size * 4
                       for f, (idx, size) in enumerate(zip(frags, frag_sizes)))
        buffers = largest * 4 + gathered
    else:
        wire_bytes = {"fp32": 4, "bf16": 2, "int8": 1}.get(cfg.pseudo_grad_dtype, 4)
        buffers = largest * 4 + largest * wire_bytes * (n if cfg.pseudo_grad_dtype == "int8" else 1) * (
            cfg.pseudo_grad_dtype not in ("fp32", *LOWBIT_PSEUDO_GRAD_DTYPES))
    memory.update({"theta_global": w.params * 4,
                   "outer_state": w.params * 4 if cfg.outer_momentum > 0 and not sparseloco else 0,
                   **rep_mem,
                   "fragment_buffers": buffers})
    label = f"diloco H={H}" + (f" F={F}" if F > 1 else "") + (f" τ={tau}" if tau else "")
    if cfg.inner != "local":
        label += f" inner={cfg.inner}"
    if cfg.inner_steps == "adaptive":
        label += " adaptive"
    if cfg.fragment_pattern == "strided":
        label += " strided"
    if sparseloco:
        label += f" sparseloco top {cfg.topk_density:.3g}"
    if cfg.pseudo_grad_replicator != "none":
        label += f" {cfg.pseudo_grad_replicator} 1/{1 / cfg.compression:.4g}"
    elif cfg.pseudo_grad_dtype != "fp32":
        label += f" {cfg.pseudo_grad_dtype}"
    if cfg.adapt:  # the controller's candidates, each costed as a fixed-H run
        candidates = cfg.adapt_candidates(H, F, tau)
        tokens = cfg.token_factors(candidates, (cfg.pseudo_grad_dtype,))
        step = AdaptedH("H", tuple((h, step if h == H else diloco(w, topo, dataclasses.replace(
            cfg, sync_every=h, adapt=False), opt).step) for h in candidates), cfg.adapt_overhead,
            None if tokens is None else tuple(tokens[(h, cfg.pseudo_grad_dtype)] for h in candidates))
        label += " adapt"
    return Schedule("diloco", label, (*inner_comms, *outer), step, memory, period=H, config=cfg)
