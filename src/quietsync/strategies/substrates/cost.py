"""The cost of the substrates (for the ``cost.py`` beside each family): the flat ZeRO-1 state padded to the group,
dim-0 shards (FSDP2's unpadded chunks, the flat dim-0 substrate's padded rows), FSDP2's per-unit gathers and
scatters, and the memory each holds — as :mod:`.sharded_state`, :mod:`.dim0_shards` and :mod:`.fsdp_shards`
lay them out; and the step of a strategy on the replicated substrate (:func:`replicated_cost`), a new strategy's
schedule in one line.
"""

from __future__ import annotations

from typing import Any

from ...cost.costmodel import Comm, chunk_rows, numel
from ...cost.schedule import Schedule
from ...cost.terms import MicroBatches, Seq, Wire, optimizer
from ...cost.workload import Shape, Workload
from ...topology import Topology
from ..parts.cost import ADAMW, OptimizerState, dtype_bytes, group_of


def replicated_cost(w: Workload, topo: Topology, cfg: Any, name: str, element_bytes: float,
                    opt: OptimizerState = ADAMW) -> Schedule:
    """The step of strategy ``name`` on the :class:`~.replicated.Replicated` substrate whose round ends in one
    blocking all-reduce of every parameter element over ``world`` (``element_bytes`` each): ``accumulation``
    micro-batches, the all-reduce, the optimizer step on every worker; parameters, gradients and optimizer state
    held in full."""
    comms = (Comm("all_reduce", "world", w.params * element_bytes, f"{name}: all-reduce"),) \
        if group_of(topo, "world") > 1 else ()
    step = Seq(MicroBatches(cfg.accumulation), Wire(comms), optimizer(w.params))
    memory = {"params": w.param_bytes, "grads": w.param_bytes, "optimizer_state": opt.bytes(w.numels)}
    label = name + (f" acc={cfg.accumulation}" if cfg.accumulation > 1 else "")
    return Schedule(name, label, comms, step, memory, config=cfg)


def flat_shard(w: Workload, n: int) -> int:
    """Elements of one worker's shard of the flat buffer padded to ``n`` (ZeRO-1's master shard)."""
    return w.padded(n) // n


def flat_group_views(w: Workload, n: int, index: int) -> list[int]:
    """Elements of each parameter group's part of flat shard ``index`` (one optimizer tensor per group)."""
    lo, hi = index * flat_shard(w, n), (index + 1) * flat_shard(w, n)
    out, at = [], 0
    for idx in w.groups():
        size = sum(w.numels[i] for i in idx)
        a, b = max(at, lo), min(at + size, hi)
        out.append(max(0, b - a))  # 0 where a group misses the shard: it still gets an empty optimizer tensor
        at += size
    return out


def sharded_state_memory(w: Workload, topo: Topology, group: str, opt: OptimizerState) -> dict[str, int]:
    """``ShardedState.memory_report()``: the padded flat parameters, the fp32 master and gradient shards and
    the optimizer state over the shard's per-group views."""
    n = group_of(topo, group)
    shard = flat_shard(w, n)
    index = topo.ranks(group).index(topo.rank)
    return {"params": w.padded(n) * w.dtype_bytes, "master_shard": shard * 4, "grad_shard": shard * 4,
            "optimizer_state": opt.bytes(flat_group_views(w, n, index))}


def flat_collectives(w: Workload, topo: Topology, group: str, reduce_dtype: str, name: str
                     ) -> tuple[Comm, Comm]:
    """ZeRO-1's two collectives on the flat buffer: reduce-scatter of the gradients (in ``reduce_dtype``) and
    all-gather of the parameters (in their own dtype)."""
    n = group_of(topo, group)
    padded = w.padded(n)
    return (Comm("reduce_scatter", group, padded * dtype_bytes(reduce_dtype), f"{name}: reduce-scatter grads"),
            Comm("all_gather", group, padded * w.dtype_bytes, f"{name}: all-gather params"))


def padded_rows_numel(shape: Shape, n: int) -> int:
    """Elements of ``shape`` with dim 0 padded to a multiple of ``n`` (what FSDP2 gathers and scatters)."""
    shape = shape or (1,)
    return -(-shape[0] // n) * n * numel(shape[1:])


def chunk_shape(shape: Shape, n: int, index: int) -> Shape:
    """Shape of chunk ``index`` of ``torch.chunk(tensor, n, dim=0)`` (FSDP2's local shard, unpadded)."""
    shape = shape or (1,)
    return (chunk_rows(shape[0], n, index), *shape[1:])


def padded_shard_shape(shape: Shape, n: int) -> Shape:
    """Shape of a dim-0 shard with rows padded to a multiple of ``n`` (the flat dim-0 substrate's shard)."""
    shape = shape or (1,)
    return (-(-shape[0] // n), *shape[1:])


def fsdp_unit_bytes(w: Workload, n: int) -> list[int]:
    """Bytes FSDP2 all-gathers (and reduce-scatters) for each unit: its parameters, dim 0 padded to ``n``."""
    return [sum(padded_rows_numel(w.shapes[i], n) for i in unit) * w.dtype_bytes for unit in w.units]


def fsdp_per_micro_batch(w: Workload, topo: Topology, group: str, accumulation: int, name: str
                         ) -> tuple[list[Comm], list[Comm]]:
    """FSDP2 inside ``group`` (``reshard_after_forward``): each micro-batch all-gathers every unit twice
    (forward, backward); the last backward of a round reduce-scatters every unit's gradients. Returns
    ``(all-gathers of a round, reduce-scatters of a round)``."""
    n = group_of(topo, group)
    if n == 1:
        # a shard group of one is not sharded (FsdpShards skips fully_shard): nothing moves
        return [], []
    gathers = [Comm("all_gather", group, b, f"{name}: all-gather unit {k}", count=2 * accumulation)
               for k, b in enumerate(fsdp_unit_bytes(w, n))]
    scatters = [Comm("reduce_scatter", group, b, f"{name}: reduce-scatter unit {k}")
                for k, b in enumerate(fsdp_unit_bytes(w, n))]
    return gathers, scatters


def local_shapes(w: Workload, topo: Topology, group: str, padded: bool) -> list[Shape]:
    """This worker's dim-0 shard of every parameter over ``group``: FSDP2's unpadded chunk, or the flat
    dim-0 substrate's padded shard."""
    n = group_of(topo, group)
    index = topo.ranks(group).index(topo.rank)
    if n == 1:
        # one worker: FSDP2 leaves the shapes as they are, the flat substrate counts a 0-dim one as a row
        return [s or (1,) for s in w.shapes] if padded else list(w.shapes)
    return [padded_shard_shape(s, n) if padded else chunk_shape(s, n, index) for s in w.shapes]
