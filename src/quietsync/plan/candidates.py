"""The settings the planner ranks: the canonical candidate grid, one spec string per setting.

A candidate is a ``NAME[:FIELD=VALUE,...]`` spec — the strings ``quietsync compare --strategies`` takes — so a plan's
rows, ``quietsync compare`` runs and the equal-loss benchmark (``benchmarks/bench_equal_loss.py``) join on them.
:func:`grid` is every strategy at the knob settings it declares (``PlanFacts.grid`` of its
:class:`~quietsync.strategies.declaration.Declaration`, in the declarations' order): the settings that change
loss per token or bytes most — ACCO/DPU/WP adaptive and capped at 4 micro-batches per stage, DeMo's DCT at 1/32 and
1/256 and the random replicator, Local SGD, DiLoCo at H = 16 and 64, Streaming DiLoCo (4 fragments, each exchange
hidden behind H/F inner steps) in fp32 and in fp4 as its paper sends it, SparseLoCo (2-bit values by default, and
outer lr 1 — a plain averaged step — as its paper), CDP. ``grid(wide=True)`` adds the long-H and heavy-compression
settings a large cluster on a slow link needs (``PlanFacts.wide``, for ``--what-if``).

The knobs of each strategy are **tuned for time to target** (:mod:`~quietsync.plan.advice`): among a strategy's
settings in the grid, the one with the least predicted time to the target loss is its best, so the search space
is the grid itself and every recommendation is a setting the benchmark runs.

:func:`canonical_grid` returns the candidates that apply to a topology and, for the others, why they are left out
(each strategy declares when it applies: FlexDeMo needs several workers per node; CDP needs as many model stages
as workers).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from ..strategies.registry import declaration, ordered
from ..topology import Topology


@dataclass(frozen=True)
class Candidate:
    """One setting: its spec string and the strategy's knobs that differ from the defaults."""

    spec: str
    strategy: str
    knobs: tuple[tuple[str, Any], ...]
    """``(field, value)`` pairs in the config's field order."""

    @property
    def knob_dict(self) -> dict[str, Any]:
        return dict(self.knobs)


@dataclass(frozen=True)
class LeftOut:
    """A grid setting that does not apply here, and why."""

    spec: str
    strategy: str
    reason: str


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"  # what the spec parser turns into --field / --no-field
    if isinstance(v, float):
        return repr(v)  # the shortest text that parses back to the same float: specs round-trip
    return str(v)


def spec_string(strategy: str, knobs: dict[str, Any] | tuple[tuple[str, Any], ...]) -> str:
    """``strategy:field=value,...`` of knobs that differ from the defaults (in the config's field order)."""
    items = list(knobs.items()) if isinstance(knobs, dict) else list(knobs)
    return strategy + (":" + ",".join(f"{k}={_fmt(v)}" for k, v in items) if items else "")


def candidate(strategy: str, knobs: dict[str, Any] | None = None) -> Candidate:
    """The candidate of ``strategy`` with ``knobs``, its spec normalized: the fields that differ from the strategy's
    defaults, in the config's field order (so ``demo`` and ``demo:compression=0.03125`` are one candidate)."""
    from .schedules import strategy_config

    cfg = strategy_config(strategy, dict(knobs or {}))
    default = strategy_config(strategy)
    diff = tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                 if getattr(cfg, f.name) != getattr(default, f.name))
    return Candidate(spec_string(strategy, diff), strategy, diff)


# cached: each parse builds an argparse parser, and every re-scoring parses the same specs again
@functools.lru_cache(maxsize=512)
def parse_candidate(spec: str) -> Candidate:
    """The normalized candidate of a spec string (values checked by the strategy's config)."""
    from .strategies_spec import parse_spec

    name, knobs = parse_spec(spec)
    return candidate(name, knobs)


def grid(wide: bool = False, uneven: bool = False, varying: bool = False) -> tuple[str, ...]:
    """The canonical candidate grid (spec strings as ``quietsync compare --strategies`` takes them): every
    registered strategy's declared settings; ``wide``: and its settings for large clusters on slow links; ``uneven``:
    and those for workers of different speeds (``PlanFacts.uneven``); ``varying``: and those for a link that varies
    during the run (``PlanFacts.varying``)."""
    out = []
    for name in ordered():
        facts = declaration(name).plan
        out += [spec_string(name, dict(knobs)) for knobs in facts.grid]
    for extra, field in ((wide, "wide"), (uneven, "uneven"), (varying, "varying")):
        if extra:
            for name in ordered():
                out += [spec_string(name, dict(knobs)) for knobs in getattr(declaration(name).plan, field)]
    return tuple(out)


def applies(strategy: str, topo: Topology, stage_counts: tuple[int, ...] = (), asked: bool = False) -> str | None:
    """Why ``strategy`` does not apply to ``topo`` (None when it does): what the strategy declares
    (``PlanFacts.applies``), and for the grid's settings one worker, which has nothing to hide or shrink unless the
    strategy is exact (``asked``: a setting named in ``--strategies`` is ranked there all the same)."""
    facts = declaration(strategy).plan
    if topo.world_size == 1 and not facts.exact and not asked:
        return "one worker: nothing to hide or shrink"
    return facts.applies(topo, stage_counts) if facts.applies is not None else None


def canonical_grid(topo: Topology, stage_counts: tuple[int, ...] = (), wide: bool = False, uneven: bool = False,
                   varying: bool = False) -> tuple[list[Candidate], list[LeftOut]]:
    """The grid's candidates that apply to ``topo`` (``wide``, ``uneven``, ``varying``: with those settings, as
    :func:`grid`), and the ones left out with why. ``stage_counts``: the stage counts the model can be cut into
    (CDP); empty = not checked."""
    out: list[Candidate] = []
    left: list[LeftOut] = []
    for spec in grid(wide, uneven, varying):
        c = parse_candidate(spec)
        why = applies(c.strategy, topo, stage_counts)
        if why is not None:
            left.append(LeftOut(c.spec, c.strategy, why))
        elif c not in out:  # two grid specs may normalize to one setting
            out.append(c)
    return out, left


def default_candidates(w: Any, topo: Topology) -> list[tuple[str, dict[str, Any]]]:
    """The grid's settings that apply to ``topo`` for workload ``w`` (its CDP stage counts), as ``(strategy,
    knobs)`` pairs (the equal-loss benchmark imports this)."""
    stages = tuple(sorted(w.stage_numels)) if getattr(w, "stage_numels", None) else ()
    return [(c.strategy, c.knob_dict) for c in canonical_grid(topo, stages)[0]]


def unique(candidates: list[Candidate]) -> list[Candidate]:
    """``candidates`` without repeats (one row per setting), first occurrence kept."""
    seen: set[tuple[str, tuple[tuple[str, Any], ...]]] = set()
    out = []
    for c in candidates:
        key = (c.strategy, c.knobs)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


__all__ = ["Candidate", "LeftOut", "applies", "candidate", "canonical_grid", "default_candidates", "grid",
           "parse_candidate",
           "spec_string", "unique"]
