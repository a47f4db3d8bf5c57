"""What cdp declares beside its code (:mod:`~quietsync.strategies.declaration`): its loss per token (Cyclic Data
Parallelism's paper), that it needs a model cut into one stage per worker (checked on the meta device before any
worker starts), and why torchft cannot run it (a missing worker stops the ring)."""

from __future__ import annotations

from typing import Any

import torch

from ...models.stages import partition, sequential_view
from ...topology import Topology
from ..declaration import Declaration, PlanFacts, Prior, Scale, penalty
from . import cost

SOURCES = {"fournier2024": "Fournier & Oyallon, \"Cyclic Data Parallelism\" (shared/papers/002), Table 2"}


def cdp_prior(cfg: Any, scale: Scale) -> Prior:
    if cfg.rule == "v1":
        return penalty(0.0, 0.01, 0.05, "CDP-v1: below CDP-v2 on CIFAR-10 [fournier2024] (assumption: +1%, up to +5%)",
                       "fournier2024")
    return penalty(-0.01, 0.0, 0.01, f"CDP-{cfg.rule}: similar or better accuracy than DP on CIFAR-10 and ImageNet "
                   "[fournier2024]", "fournier2024")


def cdp_applies(topo: Topology, stage_counts: tuple[int, ...]) -> str | None:
    if stage_counts and topo.world_size not in stage_counts:
        return f"the model cannot be cut into {topo.world_size} stages (CDP needs one stage per worker)"
    return None


def stages_problem(model: torch.nn.Module, config: Any, world: int) -> str | None:
    """Why ``--stages`` / ``--manual-stages`` cannot cut ``model`` (built on the meta device) for ``world`` workers
    (one line naming the flag), or None."""
    view = sequential_view(model)
    names = [s.name for s in view.segments]
    n = config.stages if config.stages is not None else (world if world > 1 else 2)
    flag = "--stages" if config.stages is not None else "--stages (default: the workers)"
    if n % world:
        return f"{flag} must be a multiple of the {world} workers, got {n}"
    if n > len(names):
        return (f"{flag} must be <= the {len(names)} segments this model can be cut into "
                f"({', '.join(names)}), got {n}")
    if config.partition == "manual":
        try:
            partition(view, n, "manual", config.manual_names)
        except ValueError as e:
            text = " ".join(str(e).split())
            return "--" + text.replace("_", "-", 1) if text.startswith("manual_stages") else f"--manual-stages: {text}"
    return None


CDP = Declaration(
    schedule=cost.cdp,
    plan=PlanFacts(prior=cdp_prior, sources=SOURCES, applies=cdp_applies,
                   advice="gradients travel point to point over the cycle, no collective"),
    faults="its workers pass every micro-batch's activations and gradients around a ring every time step: a missing "
           "worker stops the ring, so there is no replica the others could go on without",
    models=stages_problem,
    order=10)
