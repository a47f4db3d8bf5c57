"""Replicators: what a decoupled strategy (DeMo / FlexDeMo) sends across the replicate group.

``dct`` (DeMo top-k DCT, all-gather), ``random`` and ``striding`` (shared-seed positions, values
only, all-reduce), ``full`` (all-reduce of everything), ``none`` (nothing). All share one
``compression`` knob: bytes sent per step / bytes of the full fp32 gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from ...validate import check_choice
from .base import Message, Replicator, Segments, SparseUpdate
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


def convert_momentum(delta: torch.Tensor, shape: tuple[int, ...] | torch.Size, domain: str,
                     replicator: Replicator) -> torch.Tensor:
    """One parameter's momentum (of a parameter of ``shape``) from ``domain`` (``spatial`` or ``dct:<chunk>``,
    as :attr:`Replicator.momentum_domain` names them) into ``replicator``'s domain -- for a checkpoint written
    with another replicator, or before momenta had domains (then ``spatial``)."""
    seg = Segments([tuple(shape)])
    if domain == "spatial":
        source: Replicator = REPLICATORS["full"]()
    elif domain.startswith("dct:") and domain[4:].isdigit():
        source = DCTReplicator(chunk=int(domain[4:]))
    else:
        raise ValueError(f"momentum domain must be spatial or dct:<chunk>, got {domain!r}")
    if delta.numel() != source.momentum_numel(seg):
        raise ValueError(f"a {domain} momentum of a parameter of shape {tuple(shape)} has "
                         f"{source.momentum_numel(seg)} elements, got {delta.numel()}")
    spatial = source.momentum_to_spatial(delta.reshape(-1).to(torch.float32), seg)
    # shaped as the optimizer keeps state["delta"] in that domain ((blocks, chunk, chunk) for dct)
    return replicator.momentum_views(replicator.momentum_from_spatial(spatial, seg), seg)[0]


__all__ = [
    "Message",
    "SparseUpdate",
    "convert_momentum",
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
