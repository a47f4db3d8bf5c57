"""The cost of the baselines, beside them: ``ddp``, ``zero1``, ``fsdp`` — what each step moves over which group,
and when (in the words of :mod:`quietsync.cost`; each strategy registers its function here as its schedule, and
the tests hold each schedule's bytes to the transport's meter)."""

from __future__ import annotations

from typing import Any

from ...cost.costmodel import Comm
from ...cost.schedule import Schedule
from ...cost.terms import Buckets, MicroBatches, Seq, Wire, optimizer
from ...cost.workload import Workload
from ...topology import Topology
from ..parts.cost import ADAMW, OptimizerState, group_of
from ..substrates.cost import (
    flat_collectives,
    flat_shard,
    fsdp_per_micro_batch,
    local_shapes,
    sharded_state_memory,
)
from .powersgd import PowerSGDState

MIB = 1024 * 1024
DDP_FIRST_BUCKET_BYTES = MIB
"""torch DDP's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``): small, so communication
starts early in the backward."""

def ddp_buckets(w: Workload, cap_mb: float) -> list[list[int]]:
    """DDP's gradient buckets: parameters in reverse ``model.parameters()`` order (the order backward frees
    them), a bucket closed once it holds at least its limit — 1 MiB for the first, ``bucket_cap_mb`` after."""
    limit = DDP_FIRST_BUCKET_BYTES
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(w.module_order):
        buckets[-1].append(i)
        size += w.numels[i] * w.dtype_bytes
        if size >= limit:
            buckets.append([])
            size = 0
            limit = int(cap_mb * MIB)
    return [b for b in buckets if b]



def ddp(w: Workload, topo: Topology, cfg: Any, group: str = "world", opt: OptimizerState = ADAMW) -> Schedule:
    """torch DDP: ``accumulation`` micro-batches, the last one's backward all-reducing gradient buckets through
    the transport as they fill (1 MiB first, then ``bucket_cap_mb``), then the full optimizer on every worker."""
    acc = cfg.accumulation
    hook = getattr(cfg, "comm_hook", "allreduce")
    buckets = ddp_buckets(w, cfg.bucket_cap_mb) if group_of(topo, group) > 1 else []
    psgd = None
    if hook == "powersgd":
        psgd = PowerSGDState(rank=cfg.powersgd_rank, start_iter=cfg.powersgd_start_iter,
                             warm_start=cfg.powersgd_warm_start, error_feedback=cfg.powersgd_error_feedback)
    element = 2 if hook in ("fp16", "bf16") else w.dtype_bytes
    comms, ready, done, factors = [], [], 0, 0
    for k, b in enumerate(buckets):
        done += sum(w.numels[i] for i in b)
        ready.append(done / w.params)
        if psgd is None:
            comms.append(Comm("all_reduce", group, sum(w.numels[i] for i in b) * element, f"ddp bucket {k}"))
            continue
        # PowerSGD after its warm-up: the uncompressed tensors, then the P and Q factors (summed all-reduces)
        parts = psgd.bucket_bytes([w.shapes[i] for i in b], w.dtype_bytes)
        factors += parts["P"] + parts["Q"]
        comms += [Comm("all_reduce", group, parts[what], f"ddp bucket {k}: powersgd {what}")
                  for what in ("uncompressed", "P", "Q") if parts[what]]
    step = Seq(MicroBatches(acc - 1), Buckets(tuple(ready), tuple(comms)), optimizer(w.params))
    memory = {"params": w.param_bytes, "grads": w.param_bytes, "optimizer_state": opt.bytes(w.numels)}
    notes = ["bucket all-reduces overlap the last micro-batch's backward, in proportion to the parameter elements "
             "it has freed"]
    if psgd is not None:
        memory.update({"powersgd_error": w.param_bytes if psgd.error_feedback and buckets else 0,
                       "powersgd_pq": factors if psgd.warm_start else 0})
        notes.append(f"PowerSGD's steady state: its first {psgd.start_iter} steps all-reduce the fp32 buckets")
    label = ("ddp" + (f" acc={acc}" if acc > 1 else "")
             + (f" buckets {cfg.bucket_cap_mb:g}MB" if cfg.bucket_cap_mb != 25 else ""))
    if hook != "allreduce":
        label += f" {hook}" + (f" r={cfg.powersgd_rank}" if psgd is not None else "")
    return Schedule("ddp", label, tuple(comms), step, memory, config=cfg, notes=tuple(notes))


def zero1(w: Workload, topo: Topology, cfg: Any, group: str = "world", opt: OptimizerState = ADAMW) -> Schedule:
    """Blocking ZeRO-1: ``accumulation`` micro-batches, reduce-scatter the flat gradients, the optimizer on this
    worker's shard, all-gather the flat parameters."""
    acc = cfg.accumulation
    n = group_of(topo, group)
    comms = flat_collectives(w, topo, group, cfg.reduce_dtype, "zero1") if n > 1 else ()
    step = Seq(MicroBatches(acc), Wire(comms[:1]), optimizer(flat_shard(w, n)), Wire(comms[1:]))
    memory = {**sharded_state_memory(w, topo, group, opt), "grads": w.padded(n) * w.dtype_bytes}
    label = ("zero1" + (f" acc={acc}" if acc > 1 else "")
             + (f" {cfg.reduce_dtype}" if cfg.reduce_dtype != "float32" else ""))
    return Schedule("zero1", label, tuple(comms), step, memory, config=cfg)


def fsdp(w: Workload, topo: Topology, cfg: Any, opt: OptimizerState = ADAMW) -> Schedule:
    """HSDP on FSDP2: every micro-batch all-gathers each unit for its forward and again for its backward
    (inside the node, blocking through the transport), the last backward reduce-scatters the gradients inside
    the node, one all-reduce of this worker's gradient shards across nodes, the optimizer on the shard."""
    acc = cfg.accumulation
    gathers, scatters = fsdp_per_micro_batch(w, topo, "shard", acc, "fsdp")
    shard = local_shapes(w, topo, "shard", padded=False)
    shard_numels = [_numel(s) for s in shard]
    local = sum(shard_numels)
    across = []
    if group_of(topo, "replicate") > 1:
        across = [Comm("all_reduce", "replicate", local * w.dtype_bytes, "fsdp: all-reduce gradient shards")]
    comms = (*gathers, *scatters, *across)
    step = Seq(MicroBatches(acc), Wire(gathers), Wire(scatters), Wire(across), optimizer(local))
    memory = {"param_shard": local * w.dtype_bytes, "grad_shard": 0, "params": local * w.dtype_bytes, "grads": 0,
              "optimizer_state": opt.bytes(shard_numels)}
    return Schedule("fsdp", "fsdp" + (f" acc={acc}" if acc > 1 else ""), comms, step, memory, config=cfg,
                    notes=("FSDP2's all-gathers run blocking through the transport: no prefetch overlap",))


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
