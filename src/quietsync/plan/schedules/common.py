"""Pieces several strategies' schedules share: optimizer state sizes, the sharded flat substrate, DDP's buckets,
FSDP2's per-unit collectives, dim-0 shards and what a replicator puts on the wire."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...topology import Topology
from ..costmodel import Comm, chunk_rows, numel
from ..workload import Shape, Workload

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "int8": 1}
MIB = 1024 * 1024
DDP_FIRST_BUCKET_BYTES = MIB
"""torch DDP's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``): small, so communication
starts early in the backward."""


@dataclass(frozen=True)
class OptimizerState:
    """Bytes of a torch optimizer's state: per parameter element and per parameter tensor."""

    per_element: int
    """e.g. AdamW: exp_avg and exp_avg_sq in fp32, 8."""
    per_tensor: int
    """e.g. AdamW: its ``step`` counter, a float32 scalar tensor, 4."""

    def bytes(self, numels: Sequence[int]) -> int:
        """State of an optimizer over tensors of ``numels`` elements."""
        return sum(self.per_element * n + self.per_tensor for n in numels)


ADAMW = OptimizerState(8, 4)
"""torch.optim.AdamW (the trainer's optimizer)."""


def dtype_bytes(name: str) -> int:
    """Bytes of one element of dtype ``name`` (``float32``, ``bf16``, ``int8``...)."""
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {name!r}") from None


def group_of(topo: Topology, group: str) -> int:
    """Workers in ``group`` as seen from ``topo``."""
    return len(topo.ranks(group))


# ---------------------------------------------------------------------------------------------- flat sharded
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
        out.append(max(0, b - a))
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


# ---------------------------------------------------------------------------------------------- DDP buckets
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


# ---------------------------------------------------------------------------------------------- dim-0 shards
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
        return [s or (1,) for s in w.shapes] if padded else list(w.shapes)
    return [padded_shard_shape(s, n) if padded else chunk_shape(s, n, index) for s in w.shapes]


# ---------------------------------------------------------------------------------------------- replicators
def replicator(name: str, compression: float, transfer_dtype: str, chunk: int = 64, topk: int | None = None,
               seed: int = 0):
    """The library's replicator with these knobs (its declared payload is what the schedule sends)."""
    from ...replicators import make_replicator

    return make_replicator(name, compression=compression, transfer_dtype=transfer_dtype, chunk=chunk, topk=topk,
                           seed=seed)


def replicator_comm(rep, shapes: Sequence[Shape], group: str, n: int, name: str,
                    steps: tuple[int, ...] | None = None) -> list[Comm]:
    """The one collective a replicator runs for tensors of ``shapes`` over a group of ``n``: an all-gather of
    every worker's payload (``dct``), an all-reduce of it (the others), nothing (``none``, a group of one)."""
    from ...replicators import Segments

    if n == 1 or rep.collective == "none":
        return []
    shapes = [s for s in shapes if numel(s) > 0]
    payload = rep.payload_bytes(Segments(shapes))
    if rep.collective == "all_gather":
        return [Comm("all_gather", group, n * payload, f"{name}: all-gather {rep.name} payload", steps=steps)]
    return [Comm("all_reduce", group, payload, f"{name}: all-reduce {rep.name} payload", steps=steps)]


def momentum_numel(rep, shapes: Sequence[Shape]) -> int:
    """Elements of a decoupled optimizer's flat momentum for ``shapes`` in the replicator's domain."""
    from ...replicators import Segments

    return rep.momentum_numel(Segments([s for s in shapes if numel(s) > 0]))


def codec_key(replicator: str, compression: float, transfer_dtype: str = "fp32", chunk: int = 64,
              topk: int | None = None, base: str = "sgd") -> str:
    """The key of a decoupled setting in :attr:`~quietsync.plan.costmodel.ComputeProfile.codec_s`:
    ``replicator:compression:dtype[:chunk:topk]:base`` (the replicator's name first)."""
    key = replicator
    if replicator not in ("full", "none"):
        key += f":{compression:.6g}:{transfer_dtype}"
    if replicator == "dct":
        key += f":{chunk}:{topk}"
    return f"{key}:{base}"


def codec_knobs(key: str) -> dict:
    """The knobs of :func:`codec_key`'s ``key`` (for calibrating it)."""
    parts = key.split(":")
    knobs: dict = {"replicator": parts[0], "base": parts[-1]}
    if parts[0] not in ("full", "none"):
        knobs.update(compression=float(parts[1]), transfer_dtype=parts[2])
    if parts[0] == "dct":
        knobs.update(chunk=int(parts[3]), topk=None if parts[4] == "None" else int(parts[4]))
    return knobs

