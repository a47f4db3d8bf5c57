"""Which strategies and knob settings the plan evaluates, and knobs chosen to a compute-busy target.

:func:`default_candidates` lists every strategy at its defaults plus the settings worth comparing (the random
replicator, Streaming DiLoCo). The tuners search a knob for the cheapest setting that keeps the workers at least
``target`` busy, using the cost model itself:

* :func:`tune_diloco` — the smallest H (fewest inner steps between syncs, the least drift), and for it the
  fewest fragments, with the exchange overlapped (τ = H/F) where that helps;
* :func:`tune_localsgd` — the smallest K;
* :func:`tune_demo` — the largest compression (the most of the momentum sent) per replicator;
* :func:`tune_overlap_cap` — ACCO's ``max_accumulation`` when the link is so slow that its stages would grow
  to many micro-batches (an upper bound keeps the batch from growing without limit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..cost.workload import Workload
from ..topology import Topology
from .table import Row

Score = Callable[[str, dict[str, Any]], Row]
"""Evaluate strategy ``name`` with a dict of knobs."""


@dataclass(frozen=True)
class Tuned:
    """A knob setting chosen by a tuner, and why."""

    strategy: str
    knobs: dict[str, Any]
    row: Row
    reason: str
    reached: bool
    """Whether the target was reached (else: the best found)."""


def default_candidates(w: Workload, topo: Topology) -> list[tuple[str, dict[str, Any]]]:
    """Every strategy at its defaults, and the alternative settings worth a row."""
    out: list[tuple[str, dict[str, Any]]] = [
        ("ddp", {}), ("zero1", {}), ("fsdp", {}),
        ("acco", {}), ("dpu", {}), ("wp", {}),
        ("demo", {}), ("demo", {"replicator": "random"}),
        ("localsgd", {}), ("diloco", {}), ("diloco", {"fragments": 4, "overlap_delay": 1}),
    ]
    if topo.nodes > 1 and topo.workers_per_node > 1:
        out.insert(8, ("flexdemo", {}))
    world = topo.world_size
    if world > 1 and world in w.stage_numels:
        out.append(("cdp", {}))
    return out


def _busy(row: Row) -> float:
    return row.compute_busy


def tune_localsgd(score: Score, target: float, ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)) -> Tuned:
    """The smallest K whose predicted compute-busy fraction reaches ``target``."""
    best = None
    for k in ks:
        row = score("localsgd", {"sync_every": k})
        if _busy(row) >= target:
            return Tuned("localsgd", {"sync_every": k}, row, f"smallest K with ≥ {target:.0%} busy", True)
        best = row if best is None or _busy(row) > _busy(best) else best
    assert best is not None
    return Tuned("localsgd", best.knobs, best, f"no K up to {ks[-1]} reaches {target:.0%} busy", False)


def tune_diloco(score: Score, target: float, hs: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512),
                fragments: tuple[int, ...] = (1, 2, 4, 8)) -> Tuned:
    """The smallest H (then the fewest fragments F, blocking before overlapped) reaching ``target`` busy."""
    best = None
    for h in hs:
        for f in fragments:
            if h % f:
                continue
            for tau in (0, h // f):
                knobs = {"sync_every": h, "fragments": f, "overlap_delay": tau}
                try:
                    row = score("diloco", knobs)
                except ValueError:  # e.g. more fragments than parameter tensors
                    continue
                if _busy(row) >= target:
                    how = "blocking sync" if tau == 0 else f"each fragment's exchange hidden behind τ={tau} inner steps"
                    return Tuned("diloco", knobs, row, f"smallest H with ≥ {target:.0%} busy ({how})", True)
                best = row if best is None or _busy(row) > _busy(best) else best
    assert best is not None
    return Tuned("diloco", best.knobs, best, f"no H up to {hs[-1]} reaches {target:.0%} busy", False)


def tune_demo(score: Score, target: float, replicator: str = "dct",
              compressions: tuple[float, ...] = tuple(1 / 2**k for k in range(0, 11)), strategy: str = "demo"
              ) -> Tuned:
    """The largest compression (most bytes, least information dropped) reaching ``target`` busy."""
    best = None
    for c in compressions:
        knobs = {"replicator": replicator, "compression": c}
        row = score(strategy, knobs)
        if _busy(row) >= target:
            return Tuned(strategy, knobs, row, f"largest compression with ≥ {target:.0%} busy ({replicator})", True)
        best = row if best is None or _busy(row) > _busy(best) else best
    assert best is not None
    return Tuned(strategy, best.knobs, best, f"no compression down to 1/{1 / compressions[-1]:.0f} reaches "
                 f"{target:.0%} busy", False)


def tune_overlap_cap(score: Score, world: int, strategy: str = "acco", cap_ratio: float = 4.0) -> Tuned | None:
    """With a link so slow that a stage takes more than ``cap_ratio`` micro-batches, the cap that holds it there
    (the batch per step then stays bounded, at the cost of some waiting); None when no cap is needed."""
    row = score(strategy, {})
    per_worker = row.micro_batches / world
    stages = 2 if strategy == "acco" else 1
    if per_worker <= cap_ratio * stages * (1 + 1e-9):
        return None
    cap = int(cap_ratio)
    capped = score(strategy, {"max_accumulation": cap})
    return Tuned(strategy, {"max_accumulation": cap}, capped,
                 f"the link would grow each stage to {per_worker / stages:.1f} micro-batches; capped at {cap}", True)
