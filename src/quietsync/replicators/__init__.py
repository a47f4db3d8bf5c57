"""Replicators: what a decoupled strategy (DeMo / FlexDeMo) sends across the replicate group.

``dct`` (DeMo top-k DCT, all-gather), ``random`` and ``striding`` (shared-seed positions, values
only, all-reduce), ``full`` (all-reduce of everything), ``none`` (nothing). All share one
``compression`` knob: bytes sent per step / bytes of the full fp32 gradient.
"""

from __future__ import annotations

from typing import Any

from .base import Message, Replicator, Segments
from .dct import DCTReplicator
from .full import FullReplicator
from .none import NoReplicator
from .random import RandomReplicator
from .striding import StridingReplicator

REPLICATORS: dict[str, type[Replicator]] = {
    "dct": DCTReplicator,
    "random": RandomReplicator,
    "striding": StridingReplicator,
    "full": FullReplicator,
    "none": NoReplicator,
}


def make_replicator(name: str, **kwargs: Any) -> Replicator:
    """Build a replicator by name; keyword arguments a replicator does not take are ignored
    (``chunk``/``topk`` only matter to ``dct``, ``seed`` to ``random``)."""
    if name not in REPLICATORS:
        raise ValueError(f"replicator must be one of {sorted(REPLICATORS)}, got {name!r}")
    cls = REPLICATORS[name]
    common = {k: kwargs[k] for k in ("compression", "transfer_dtype", "transport", "group") if k in kwargs}
    extra: dict[str, Any] = {}
    if cls is DCTReplicator:
        extra = {k: kwargs[k] for k in ("chunk", "topk") if k in kwargs}
    elif cls is RandomReplicator:
        extra = {k: kwargs[k] for k in ("seed",) if k in kwargs}
    return cls(**common, **extra)


__all__ = [
    "Message",
    "Replicator",
    "Segments",
    "DCTReplicator",
    "FullReplicator",
    "NoReplicator",
    "RandomReplicator",
    "StridingReplicator",
    "REPLICATORS",
    "make_replicator",
]
