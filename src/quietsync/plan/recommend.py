"""Recommendations: which strategies to try first, why, and what is known about their loss per token.

The diagnosis compares the synchronous baseline's communication with its computation (``link-bound: comm
3.4× compute`` or ``compute-bound``). The strategies to try first are the ones with the highest predicted
tokens per second (each strategy's best setting, tuned knobs included), each with the reason the model gives —
how much of the step is computing, what hides or shrinks the traffic — and the equal-token findings of
:mod:`~quietsync.plan.knowledge` that say what it may cost in loss per token. Workers of different speeds
(calibrated, or ``--slow-worker``) bring ACCO in: it lets fast workers compute while slow ones finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..cost.compute import ComputeProfile
from .candidates import Tuned
from .knowledge import findings_for
from .table import Row, fmt_bytes

EXACT = ("ddp", "zero1", "fsdp")
_BIG_BATCH = ("; the link makes each step's batch large — tokens per step grow, and so may the tokens a target loss "
              "needs (max_accumulation caps it)")
HETEROGENEOUS = 1.15
"""Slowest / fastest worker compute above which workers count as heterogeneous."""
MAX_STAGE = 4.0
"""Micro-batches per stage per worker beyond which an adaptive ACCO/DPU/WP setting is not recommended: its batch
per step has grown so much with the slow link that its speed would be paid for in tokens per target loss (the
capped setting, ``max_accumulation``, is ranked instead)."""
STAGES = {"acco": 2, "dpu": 1, "wp": 1}


@dataclass
class Recommendation:
    """One strategy to try, with its setting and the reasons."""

    rank: int
    strategy: str
    label: str
    knobs: dict[str, Any]
    tokens_per_s: float
    speedup: float
    """Predicted tokens/s over the synchronous baseline's."""
    reason: str
    loss_per_token: list[str] = field(default_factory=list)
    """Findings ``"text (source)"`` about its loss per token."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Advice:
    """The diagnosis, the strategies to try first and the knobs chosen to the target."""

    diagnosis: str
    baseline: str
    recommendations: list[Recommendation]
    tuned: list[str]
    """One line per tuned knob: what was chosen and why."""

    def to_dict(self) -> dict[str, Any]:
        return {"diagnosis": self.diagnosis, "baseline": self.baseline,
                "recommendations": [r.to_dict() for r in self.recommendations], "tuned": self.tuned}

    def markdown(self) -> str:
        lines = [f"**Diagnosis**: {self.diagnosis}", "", "**Try first**:", ""]
        for r in self.recommendations:
            knobs = ", ".join(f"{k}={fmt_knob(v)}" for k, v in r.knobs.items()) or "defaults"
            lines.append(f"{r.rank}. `{r.label}` ({knobs}): {r.tokens_per_s:,.0f} tokens/s, {r.speedup:.2f}× the "
                         f"baseline — {r.reason}")
            for f in r.loss_per_token:
                lines.append(f"   - loss per token: {f}")
        if self.tuned:
            lines += ["", "**Knobs chosen to the target**:", ""] + [f"- {t}" for t in self.tuned]
        return "\n".join(lines) + "\n"


def diagnosis(baseline: Row) -> str:
    """``link-bound: comm 3.4× compute (zero1 ...)`` or ``compute-bound ...`` from the synchronous baseline."""
    ratio = baseline.comm_s / baseline.compute_s if baseline.compute_s > 0 else float("inf")
    where = f"{baseline.label}: {baseline.comm_s:.3g} s of communication per {baseline.compute_s:.3g} s of compute"
    if baseline.compute_busy >= 0.9:
        return f"compute-bound: comm {ratio:.2g}× compute ({where}); synchronous training keeps the workers busy"
    return (f"link-bound: comm {ratio:.2g}× compute ({where}); "
            f"the workers compute {baseline.compute_busy:.0%} of the time")


def _reason(r: Row, baseline: Row, world: int) -> str:
    busy = f"busy {r.compute_busy:.0%}"
    inter = r.bytes_per_link.get("inter", 0.0)
    if r.strategy in EXACT:
        return f"{busy}; exact synchronous gradients"
    if r.strategy == "acco":
        per = r.micro_batches / world / 2
        out = (f"{busy}; hides the network behind {per:.2g} micro-batches per stage per worker (two stages per step:"
               f" a larger batch per step)")
        return out + (_BIG_BATCH if per > 4 else "")
    if r.strategy in ("dpu", "wp"):
        per = r.micro_batches / world
        out = f"{busy}; hides the update behind {per:.2g} micro-batches, applying gradients one step late"
        return out + (_BIG_BATCH if per > 4 else "")
    if r.strategy in ("demo", "flexdemo"):
        return (f"{busy}; sends {fmt_bytes(inter or sum(r.bytes_per_link.values()))} per step across nodes "
                "instead of "
                f"{fmt_bytes(baseline.bytes_per_link.get('inter', 0.0) or sum(baseline.bytes_per_link.values()))}")
    if r.strategy == "localsgd":
        return f"{busy}; averages parameters every {r.knobs.get('sync_every', 8)} steps"
    if r.strategy == "diloco":
        return f"{busy}; {r.label.removeprefix('diloco ')}: outer sync every H inner steps"
    if r.strategy == "cdp":
        return f"{busy}; gradients travel point to point over the cycle, no collective"
    return busy


def grown(r: Row, world: int) -> bool:
    """Whether an adaptive ACCO/DPU/WP row's stages grew past :data:`MAX_STAGE` micro-batches per worker."""
    return r.strategy in STAGES and r.micro_batches / world / STAGES[r.strategy] > MAX_STAGE * (1 + 1e-9)


def ranked(rows: list[Row], world: int) -> list[Row]:
    """Each strategy's fastest row that may be recommended (grown adaptive stages excluded), fastest first."""
    best: dict[str, Row] = {}
    for r in rows:
        if not grown(r, world) and (r.strategy not in best or r.tokens_per_s > best[r.strategy].tokens_per_s):
            best[r.strategy] = r
    return sorted(best.values(), key=lambda r: -r.tokens_per_s)


def fmt_knob(v: Any) -> str:
    """``0.0009765625`` → ``1/1024``; other values as they are."""
    if isinstance(v, float) and 0 < v < 1 and abs(1 / v - round(1 / v)) < 1e-9:
        return f"1/{round(1 / v)}"
    return str(v)


def advise(rows: list[Row], tuned: list[Tuned], compute: ComputeProfile, world: int, target: float,
           top: int = 3) -> Advice:
    """The diagnosis and the ``top`` strategies to try first (see the module docstring)."""
    exact = [r for r in rows if r.strategy in EXACT and r.strategy != "fsdp"] or rows
    baseline = max(exact, key=lambda r: r.tokens_per_s)
    everything = rows + [t.row for t in tuned]
    best = {r.strategy: r for r in ranked(everything, world)}
    ranked_rows = list(best.values())
    chosen = ranked_rows[:top]
    scales = compute.scales(world)
    spread = max(scales) / min(scales)
    tuned_lines = [f"{t.strategy}: {', '.join(f'{k}={fmt_knob(v)}' for k, v in t.knobs.items())} — {t.reason} "
                   f"(predicted busy {t.row.compute_busy:.0%}, {t.row.tokens_per_s:,.0f} tokens/s)" for t in tuned]
    if spread > HETEROGENEOUS and "acco" in best and best["acco"] not in chosen:
        chosen = chosen[: top - 1] + [best["acco"]]
    recs = []
    for i, r in enumerate(chosen, 1):
        reason = _reason(r, baseline, world)
        if spread > HETEROGENEOUS and r.strategy == "acco":
            reason += (f"; workers differ in speed (slowest {spread:.2f}× the fastest): ACCO's fast workers compute "
                       "more micro-batches instead of waiting")
        recs.append(Recommendation(i, r.strategy, r.label, r.knobs, r.tokens_per_s,
                                   r.tokens_per_s / baseline.tokens_per_s, reason,
                                   [f"{f.text} ({f.source})" for f in findings_for(r.strategy)]))
    for r in [r for r in everything if grown(r, world)]:
        tuned_lines.append(f"{r.label}: not ranked — the link grows its stages to "
                           f"{r.micro_batches / world / STAGES[r.strategy]:.3g} micro-batches per worker (more than "
                           f"{MAX_STAGE:g}); its max_accumulation={int(MAX_STAGE)} setting is ranked instead")
    if spread > HETEROGENEOUS:
        tuned_lines.append(f"heterogeneous workers (slowest {spread:.2f}× the fastest): synchronous strategies run at "
                           "the slowest worker's pace; ACCO does not")
    return Advice(diagnosis(baseline), baseline.label, recs, tuned_lines)
