"""The plan's table: one row per strategy and knob setting, evaluated from its schedule.

A :class:`Row` holds the predicted step time and what fills it (compute, exposed communication), the
compute-busy fraction, micro-batches and tokens per step and per second, bytes per step per group and per link,
and memory per worker (the strategy's buffers plus one micro-batch's activations).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..cost.compute import ComputeProfile
from ..cost.costmodel import Ctx, Links
from ..cost.schedule import Schedule
from ..cost.workload import Workload
from ..topology import Topology
from .schedules import schedule, strategy_config


@dataclass
class Row:
    """One strategy at one knob setting, predicted."""

    strategy: str
    label: str
    knobs: dict[str, Any]
    """The knobs that differ from the strategy's defaults."""
    step_s: float
    """Wall seconds per committed step."""
    compute_s: float
    """Main-thread compute seconds per step (this worker)."""
    exposed_comm_s: float
    """Seconds per step the main thread waits on the network."""
    comm_s: float
    """Wire seconds per step, hidden or not."""
    micro_batches: float
    """Micro-batches per step, all workers."""
    tokens_per_step: float
    tokens_per_s: float
    bytes_per_step: dict[str, float]
    """Bytes this worker sends per step, by group."""
    bytes_per_link: dict[str, float]
    """Bytes this worker sends per step, by link kind (``inter``, ``intra``)."""
    memory: dict[str, int]
    """Bytes per buffer this worker holds (the strategy's ``memory_report()`` names)."""
    activation_bytes: int
    notes: list[str] = field(default_factory=list)
    timeline: str = ""
    """The step's terms, for the report."""

    @property
    def spec(self) -> str:
        """The setting as a ``NAME[:FIELD=VALUE,...]`` spec (knobs that differ from the defaults, in field order)."""
        from .candidates import spec_string

        return spec_string(self.strategy, self.knobs)

    @property
    def compute_busy(self) -> float:
        return self.compute_s / self.step_s if self.step_s > 0 else 1.0

    @property
    def memory_bytes(self) -> int:
        """Memory per worker: the strategy's buffers plus one micro-batch's activations."""
        return sum(self.memory.values()) + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(compute_busy=self.compute_busy, memory_bytes=self.memory_bytes, spec=self.spec)
        return out


def knob_diff(name: str, config: Any) -> dict[str, Any]:
    """The fields of ``config`` that differ from strategy ``name``'s defaults."""
    default = strategy_config(name)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(default, f.name)}


def evaluate(name: str, config: Any, workload: Workload, topo: Topology, compute: ComputeProfile, links: Links,
             label: str | None = None) -> Row:
    """Predict one row: strategy ``name`` with ``config`` on worker ``topo.rank``."""
    cfg = strategy_config(name, config)
    sched = schedule(name, workload, topo, cfg)
    return row_of(sched, workload, topo, compute, links, label)


def row_of(sched: Schedule, workload: Workload, topo: Topology, compute: ComputeProfile, links: Links,
           label: str | None = None) -> Row:
    """Evaluate an already built schedule."""
    cost = sched.step.cost(Ctx(compute, links, topo))
    tokens = cost.global_micro_batches * workload.tokens_per_micro_batch
    sent = {g: v["sent"] for g, v in sched.bytes_per_step(topo).items()}
    return Row(
        strategy=sched.strategy, label=label or sched.label, knobs=knob_diff(sched.strategy, sched.config),
        step_s=cost.time, compute_s=cost.compute, exposed_comm_s=cost.exposed_comm, comm_s=cost.comm,
        micro_batches=cost.global_micro_batches, tokens_per_step=tokens,
        tokens_per_s=tokens / cost.time if cost.time > 0 else float("inf"),
        bytes_per_step=sent, bytes_per_link=sched.bytes_per_link(topo), memory=dict(sched.memory),
        activation_bytes=compute.activation_bytes, notes=list(sched.notes), timeline=sched.step.describe())


def fmt_bytes(b: float) -> str:
    """``12.3 MB`` (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


TARGET_HEADS = ("tokens to target", "time to target")
"""The objective's columns when ranking by time to a target loss."""


def markdown(rows: list[Row], extra: dict[str, tuple[str, ...]] | None = None,
             order: list[str] | None = None, heads: tuple[str, ...] = TARGET_HEADS) -> str:
    """The table as Markdown: one row per setting. ``extra``: spec → the objective's columns, headed ``heads``
    (default: tokens to target, time to target); ``order``: specs in the order to print (default: fastest tokens/s
    first)."""
    head = ("| setting | step | compute | exposed comm | compute-busy | micro-batches/step | tokens/s "
            "| inter B/step | intra B/step | memory/worker |")
    cols = 10
    if extra is not None:
        head += "".join(f" {h} |" for h in heads)
        cols += len(heads)
    lines = [head, "|" + "---|" * cols]
    by_spec = {r.spec: r for r in rows}
    specs = order if order is not None else [r.spec for r in sorted(rows, key=lambda r: -r.tokens_per_s)]
    for spec in specs:
        r = by_spec[spec]
        line = (
            f"| `{r.spec}` | {fmt_seconds(r.step_s)} | {fmt_seconds(r.compute_s)} | {fmt_seconds(r.exposed_comm_s)} "
            f"| {r.compute_busy:.0%} | {r.micro_batches:.3g} | {r.tokens_per_s:,.0f} "
            f"| {fmt_bytes(r.bytes_per_link.get('inter', 0))} | {fmt_bytes(r.bytes_per_link.get('intra', 0))} "
            f"| {fmt_bytes(r.memory_bytes)} |")
        if extra is not None:
            line += "".join(f" {v} |" for v in extra.get(spec, ("—",) * len(heads)))
        lines.append(line)
    return "\n".join(lines) + "\n"
