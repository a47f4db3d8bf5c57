"""A plan (:class:`PlanResult`): the table, the objective and its estimates, the advice, what they rest on; it
re-predicts at other link speeds (the bandwidth sweep and its crossovers) and writes ``plan.md``, ``plan.json`` and
``plan.png``. :mod:`~quietsync.plan.planner` makes one; :mod:`~quietsync.plan.pilot_plan` re-scores it with pilots.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cost.compute import ComputeProfile
from ..cost.costmodel import Links
from ..cost.workload import Workload
from ..link import LinkModel
from ..topology import Topology
from .candidates import LeftOut
from .cluster import Cluster
from .config import PlanConfig
from .objective import Objective
from .recommend import Advice, Scored, best_per_strategy, fmt_interval
from .table import TARGET_HEADS, Row, evaluate, markdown

TIE = 0.01
"""Strategies within 1% of each other's objective count as tied (no crossover between them)."""


@dataclass
class PlanResult:
    """A plan: the table, the objective and its estimates, the advice, and what they rest on."""

    config: PlanConfig
    workload: Workload
    cluster: Cluster
    compute: ComputeProfile
    rows: list[Row]
    """One per setting (no repeats)."""
    objective: Objective
    scored: list[Scored]
    advice: Advice
    left_out: list[LeftOut] = field(default_factory=list)
    probe: dict[str, Any] | None = None
    """The probe's samples and fits per link kind (measured plans)."""
    assumptions: list[str] = field(default_factory=list)
    pilots: dict[str, Any] = field(default_factory=dict)
    """Spec → :class:`~quietsync.plan.pilots.PilotCurve` of the pilots that ran."""
    pilot_report: list[str] = field(default_factory=list)
    noise_scale: Any = None
    """The :class:`~quietsync.plan.noise_scale.NoiseScale` measured on the baseline's pilot (None: not measured)."""

    @property
    def topology(self) -> Topology:
        return Topology(0, self.cluster.world, self.cluster.nodes)

    def predict(self, name: str, knobs: dict[str, Any], links: Links | None = None) -> Row:
        """One more row, optionally on other links."""
        return evaluate(name, knobs, self.workload, self.topology, self.compute, links or self.cluster.links)

    def score(self, row: Row) -> Scored:
        """A row's tokens and time to target (or loss after the budget) under this plan's objective."""
        return self.objective.score(row)

    def best_rows(self) -> list[Row]:
        """Each strategy's best setting by the objective, best first."""
        return [s.row for s in best_per_strategy(self.scored)]

    def sweep(self, kind: str | None = None, points: int = 41, lo_bits: float = 1e6, hi_bits: float = 1e11
              ) -> tuple[str, list[float], dict[str, list[float]], list[tuple[float, str, str]]]:
        """Each strategy's best setting (knobs fixed) at link bandwidths from ``lo_bits`` to ``hi_bits`` bit/s on link
        ``kind`` (default: inter if there are several nodes), latency kept: its objective there (seconds to the
        target, or the loss after the budget; the loss model re-evaluated for the row at that bandwidth, so adaptive
        stages that grow with a slow link pay their batch). Returns ``(kind, bandwidths in bytes/s, {spec: values},
        crossovers [(bandwidth, was best, becomes best)])``."""
        kind = kind or ("inter" if self.cluster.nodes > 1 else "intra")
        base = self.cluster.links.model.get(kind) or LinkModel(1e9 / 8)
        bws = [lo_bits / 8 * (hi_bits / lo_bits) ** (i / (points - 1)) for i in range(points)]
        rows = [r for r in self.best_rows() if self.score(r).reaches]  # inf where never reached: no curve

        def at(bw: float) -> dict[str, float]:
            links = Links(model={**self.cluster.links.model, kind: LinkModel(bw, base.latency)},
                          floor=self.cluster.links.floor, floor_by_kind=self.cluster.links.floor_by_kind)
            return {r.spec: self.score(self.predict(r.strategy, r.knobs, links)).objective for r in rows}

        grid = [at(bw) for bw in bws]
        curves = {r.spec: [g[r.spec] for g in grid] for r in rows}
        crossovers: list[tuple[float, str, str]] = []
        if not rows:
            return kind, bws, curves, crossovers
        lead = min(grid[0], key=grid[0].get)
        for i in range(1, points):
            b = min(grid[i], key=grid[i].get)
            if b != lead and grid[i][lead] > grid[i][b] * (1 + TIE):  # clearly overtaken: bisect on log bandwidth
                lo, hi = bws[i - 1], bws[i]
                for _ in range(30):
                    mid = (lo * hi) ** 0.5
                    g = at(mid)
                    lo, hi = (mid, hi) if g[lead] <= g[b] * (1 + TIE) else (lo, mid)
                crossovers.append(((lo * hi) ** 0.5, lead, b))
                lead = b
        return kind, bws, curves, crossovers

    def headings(self) -> tuple[str, ...]:
        """The objective's column headings: a budget ranks by loss, which has no tokens or time to show."""
        if self.objective.budget_s is not None:
            return (f"loss after {self.objective.budget_s:g} s",)
        return TARGET_HEADS

    def columns(self) -> dict[str, tuple[str, ...]]:
        """Spec → (tokens to target, time to target) as the table prints them (budget mode: (loss after it,))."""
        out: dict[str, tuple[str, ...]] = {}
        for s in self.scored:
            if s.loss is not None:
                out[s.row.spec] = (f"{s.loss.value:.3f} ({s.loss.low:.3f}–{s.loss.high:.3f})",)
            elif s.reaches and s.time is not None:
                t = s.estimate.tokens
                out[s.row.spec] = (f"{t.value:,.3g} (×{s.estimate.multiplier.value:.3g}, {s.estimate.source})",
                                   fmt_interval(s.time.seconds))
            else:
                out[s.row.spec] = (f"not reached ({s.estimate.source})", "—")
        return out

    def markdown(self) -> str:
        c = self.compute
        head = [
            f"# quietsync plan: {self.workload.name}, {self.cluster.describe()}",
            "",
            f"Model: {self.workload.params:,} parameters, micro-batch {self.workload.tokens_per_micro_batch:,} tokens. "
            f"Compute ({c.source}): forward {c.forward_s * 1e3:.3g} ms + backward {c.backward_s * 1e3:.3g} ms per "
            f"micro-batch, optimizer step {c.optimizer_s(self.workload.params) * 1e3:.3g} ms.",
            "",
        ]
        scales = c.scales(self.cluster.world)
        if max(scales) != min(scales):
            head += ["Per-worker compute time relative to the median: "
                     + ", ".join(f"{r}: {s:.2f}" for r, s in enumerate(scales)) + ".", ""]
        notes = self.objective.notes + self.assumptions
        if notes:
            head += ["Assumptions:", ""] + [f"- {a}" for a in notes] + [""]
        if self.pilot_report:
            head += ["Pilots:", ""] + [f"- {a}" for a in self.pilot_report] + [""]
        order = [s.row.spec for s in sorted(self.scored, key=lambda s: (s.objective, -s.row.tokens_per_s))]
        text = ("\n".join(head) + f"Ranked by {self.objective.description} (the interval: the loss model's and the "
                "speed model's):\n\n" + markdown(self.rows, self.columns(), order, self.headings()) + "\n"
                + self.advice.markdown())
        if self.cluster.world > 1:  # one worker has no link to sweep
            kind, _, _, crossovers = self.sweep()
            lines = [f"- at {b * 8 / 1e6:,.4g} Mbit/s: `{a}` → `{c}`" for b, a, c in crossovers]
            text += (f"\n**Crossovers** (the best setting by {self.objective.description} as the {kind} bandwidth "
                     "grows, each strategy's best setting above):\n\n"
                     + ("\n".join(lines) if lines else "- none between 1 Mbit/s and 100 Gbit/s") + "\n")
        return text

    def to_dict(self) -> dict[str, Any]:
        scored = {s.row.spec: {"estimate": s.estimate.to_dict(),
                               "seconds": vars(s.time.seconds) if s.time is not None else None,
                               "loss": vars(s.loss) if s.loss is not None else None} for s in self.scored}
        return {
            "workload": {"name": self.workload.name, "params": self.workload.params,
                         "tokens_per_micro_batch": self.workload.tokens_per_micro_batch},
            "cluster": {"nodes": self.cluster.nodes, "workers_per_node": self.cluster.workers_per_node,
                        "links": self.cluster.links.describe()},
            "compute": dataclasses.asdict(self.compute),
            "objective": self.objective.to_dict(),
            "rows": [{**r.to_dict(), **scored.get(r.spec, {})} for r in self.rows],
            "left_out": [dataclasses.asdict(x) for x in self.left_out],
            "advice": self.advice.to_dict(),
            "pilots": {k: v.to_dict() for k, v in self.pilots.items()},
            "pilot_report": self.pilot_report,
            "noise_scale": self.noise_scale.to_dict() if self.noise_scale is not None else None,
            "probe": self.probe,
            "assumptions": self.assumptions,
        }

    def save(self, out: str | os.PathLike[str], plot: bool = True) -> list[Path]:
        """Write ``plan.md``, ``plan.json`` and (``plot``) ``plan.png`` under ``out``; return the paths."""
        folder = Path(out)
        folder.mkdir(parents=True, exist_ok=True)
        paths = [folder / "plan.md", folder / "plan.json"]
        paths[0].write_text(self.markdown())
        paths[1].write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        if plot:
            from .plots import plot_plan

            sweep = self.sweep() if self.cluster.world > 1 else None
            planned = self.cluster.links.model.get(sweep[0]) if sweep else None
            title = f"quietsync plan: {self.workload.name}, {self.cluster.describe()}"
            budget = self.objective.budget_s is not None
            paths.append(plot_plan(self.best_rows(), sweep, planned, title, folder / "plan.png",
                                   self.objective.description if budget else "predicted seconds to the target",
                                   log_objective=not budget))
        return paths
