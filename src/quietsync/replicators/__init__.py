"""Replicators: what a decoupled strategy (DeMo / FlexDeMo) sends across the replicate group.

``dct`` (DeMo top-k DCT, all-gather), ``random`` and ``striding`` (shared-seed positions, values
only, all-reduce), ``full`` (all-reduce of everything), ``none`` (nothing). All share one
``compression`` knob: bytes sent per step / bytes of the full fp32 gradient.
"""

from __future__ import annotations

from typing import Any

from ..validate import check_choice
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


def replicator_knobs() -> frozenset[str]:
    """Every knob some registered replicator declares (see :attr:`Replicator.knobs`)."""
    return frozenset(k for cls in REPLICATORS.values() for k in cls.knobs)


def make_replicator(name: str, **knobs: Any) -> Replicator:
    """Build the replicator registered as ``name``, passing it the ``knobs`` its class declares.

    Knobs only another replicator declares are ignored (``chunk``/``topk`` matter to ``dct`` alone,
    ``seed`` to ``random``), so one call can serve every replicator; a knob no replicator declares is a
    ``ValueError`` naming it.
    """
    check_choice("replicator", name, REPLICATORS)
    unknown = sorted(set(knobs) - replicator_knobs())
    if unknown:
        raise ValueError(f"make_replicator knobs must be among {', '.join(sorted(replicator_knobs()))}, "
                         f"got {', '.join(unknown)}")
    cls = REPLICATORS[name]
    return cls(**{k: v for k, v in knobs.items() if k in cls.knobs})


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
    "replicator_knobs",
]
