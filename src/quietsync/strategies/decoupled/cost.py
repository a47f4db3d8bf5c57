"""The cost of the decoupled-momentum family, beside it: ``demo`` and ``flexdemo``.

A step accumulates micro-batches with no communication, then the decoupled optimizer runs: momentum update,
the replicator's extraction and error feedback, **one** collective of its payload (an all-gather for ``dct``,
whose positions differ per worker; an all-reduce for ``random``/``striding``/``full``), decoding, sign, and the
base rule. The payload size is the replicator's own declaration (``payload_bytes``), the same number the tests
check against the meter. FlexDeMo adds the node's sharding around it: FSDP2's gathers and scatters inside the
node (``params=sharded``) or one reduce-scatter and one all-gather of dim-0 shards (``params=replicated``), and
replicates only this worker's shard across nodes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...cost.compute import codec_key
from ...cost.costmodel import Comm, lcm, numel, steps_where
from ...cost.schedule import Schedule
from ...cost.terms import Every, MicroBatches, Seq, Wire, Work
from ...cost.workload import Shape, Workload
from ...topology import Topology
from ..parts.cost import ADAMW, FirstThatFits, OptimizerState, group_of, momentum_numel, replicator, replicator_comm
from ..substrates.cost import fsdp_per_micro_batch, local_shapes


def _replication(cfg: Any) -> tuple[int, tuple[int, ...] | None]:
    """The period and the replicating steps of ``replicate_every`` / ``skip_every``."""
    period = lcm(cfg.replicate_every, cfg.skip_every or 1)

    def replicates(s: int) -> bool:
        return s % cfg.replicate_every == 0 and not (cfg.skip_every and s % cfg.skip_every == 0)

    return period, steps_where(period, replicates)


def _base(cfg: Any) -> str:
    return "adamw" if cfg.base in ("adamw", "auto") else "sgd"


def _label(name: str, cfg: Any) -> str:
    parts = [name, cfg.replicator]
    if cfg.replicator not in ("full", "none"):
        parts.append(f"topk={cfg.topk}" if cfg.replicator == "dct" and cfg.topk else f"1/{1 / cfg.compression:.4g}")
    if cfg.replicate_every > 1:
        parts.append(f"every {cfg.replicate_every}")
    return " ".join(parts)


def _decoupled_step(shapes: list[Shape], cfg: Any, rep: Any, period: int, on: tuple[int, ...] | None,
                    comms: list[Comm]) -> Seq:
    """The decoupled optimizer's step over ``shapes``: codec and base rule on the main thread, the collective
    blocking, both only on replicating steps (the others apply the local gradient)."""
    elements = sum(numel(s) for s in shapes)
    key = codec_key(cfg.replicator, cfg.compression, cfg.transfer_dtype, cfg.chunk, cfg.topk, _base(cfg))
    share = 1.0 if on is None else len(on) / period
    work = Work(f"decoupled step ({cfg.replicator} codec + {_base(cfg)})",
                lambda ctx: share * ctx.compute.codec(key, elements) + (1 - share) * ctx.compute.optimizer_s(elements))
    wire = Every(Wire(comms), 1 / share) if share > 0 else Seq()
    return Seq(work, wire)


def _state_bytes(shapes: list[Shape], cfg: Any, rep: Any, scalars: bool) -> int:
    """The decoupled optimizer's state: the flat momentum in the replicator's domain, and the base rule's Adam
    moments (+ their ``step`` scalars when ``scalars``)."""
    live = [s for s in shapes if numel(s) > 0]
    out = momentum_numel(rep, live) * 4
    if _base(cfg) == "adamw":
        out += sum(2 * numel(s) * 4 + (4 if scalars else 0) for s in live)
    return out


def demo(w: Workload, topo: Topology, cfg: Any, opt: OptimizerState = ADAMW) -> Schedule:
    """DeMo over plain data parallelism: one collective of the replicator's payload over ``world`` per
    replicating step; with ``adapt``, the step at the top-k its controller picks on the link
    (:class:`~quietsync.strategies.parts.cost.FirstThatFits` over the candidates, largest first)."""
    n = group_of(topo, "world")
    rep = replicator(cfg.replicator, cfg.compression, cfg.transfer_dtype, cfg.chunk, cfg.topk, cfg.seed,
                     cfg.transfer_block)
    period, on = _replication(cfg)
    comms = replicator_comm(rep, w.shapes, "world", n, "demo", on)
    step = Seq(MicroBatches(cfg.accumulation), _decoupled_step(list(w.shapes), cfg, rep, period, on, comms))
    memory = {"params": w.param_bytes, "grads": 0, "optimizer_state": _state_bytes(list(w.shapes), cfg, rep, True)}
    label = _label("demo", cfg)
    if getattr(cfg, "adapt", False):  # the controller's candidates, each costed as a fixed-k run
        step = FirstThatFits("topk", tuple((k, step if k == cfg.topk else demo(
            w, topo, dataclasses.replace(cfg, topk=k, adapt=False), opt).step) for k in cfg.topk_candidates()),
            cfg.adapt_overhead)
        label += " adapt"
    return Schedule("demo", label, tuple(comms), step, memory, period=period, config=cfg)


def flexdemo(w: Workload, topo: Topology, cfg: Any, opt: OptimizerState = ADAMW) -> Schedule:
    """FlexDeMo: the node shards (FSDP2, or dim-0 shards of whole parameters), the replicator runs on this
    worker's shard across nodes."""
    acc = cfg.accumulation
    m = group_of(topo, "shard")
    nodes = group_of(topo, "replicate")
    rep = replicator(cfg.replicator, cfg.compression, cfg.transfer_dtype, cfg.chunk, cfg.topk, cfg.seed,
                     cfg.transfer_block)
    period, on = _replication(cfg)
    sharded = cfg.params == "sharded"
    shapes = local_shapes(w, topo, "shard", padded=not sharded)
    across = replicator_comm(rep, shapes, "replicate", nodes, "flexdemo", on)
    local = sum(numel(s) for s in shapes)
    if sharded:
        gathers, scatters = fsdp_per_micro_batch(w, topo, "shard", acc, "flexdemo")
        after: list[Comm] = []
        memory = {"param_shard": local * w.dtype_bytes, "grad_shard": 0, "params": local * w.dtype_bytes, "grads": 0}
    else:
        gathers = []
        scatters = after = []
        if m > 1:
            scatters = [Comm("reduce_scatter", "shard", m * local * 4, "flexdemo: reduce-scatter dim-0 shards")]
            after = [Comm("all_gather", "shard", m * local * 4, "flexdemo: all-gather dim-0 shards")]
        memory = {"params": w.param_bytes, "master_shard": local * 4, "grad_shard": local * 4, "grads": 0}
    memory["optimizer_state"] = _state_bytes(shapes, cfg, rep, False)
    comms = (*gathers, *scatters, *across, *after)
    step = Seq(MicroBatches(acc), Wire(gathers), Wire(scatters),
               _decoupled_step(shapes, cfg, rep, period, on, across), Wire(after))
    label = _label("flexdemo", cfg) + ("" if sharded else " replicated")
    return Schedule("flexdemo", label, comms, step, memory, period=period, config=cfg)
