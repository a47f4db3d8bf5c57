"""Synchronous data parallelism under torchft (a part): inside each replica group, then across the replicas
present.

A transport whose replicate dimension is torchft's (``transport.fault_tolerant``) has no fixed ``world``: its
replicas come and go with the quorum. ddp and zero1 asked to average over ``world`` then run over ``shard`` (the
replica group's own workers: torch DDP, or ZeRO-1 sharding the optimizer inside the group) and average the
committed gradient -- the whole of it for ddp, each worker's shard for zero1 -- over ``replicate`` with one
all-reduce, which the quorum commits (retried among the survivors when a replica dies during it). On any other
transport nothing changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...transport import Transport


def split_groups(transport: Transport, group: str) -> tuple[str, str | None]:
    """``(the group the strategy runs over, the group it then averages across or None)`` for ``group``."""
    # only world spans the replicas; a group inside one replica group runs as asked
    if getattr(transport, "fault_tolerant", False) and group == "world":
        return "shard", "replicate"
    return group, None


def average_across(transport: Transport, tensors: Sequence[torch.Tensor], group: str, name: str) -> None:
    """``tensors`` ← their mean over ``group`` (one all-reduce of their concatenation; fp32 on the wire)."""
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return
    with torch.no_grad():
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        transport.all_reduce(flat, group, op="avg", name=name)
        torch._foreach_copy_(tensors, [c.view_as(t) for c, t in zip(flat.split([t.numel() for t in tensors]),
                                                                       tensors)])


__all__ = ["average_across", "split_groups"]
