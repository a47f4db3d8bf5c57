"""The advice: every setting ranked by predicted time to the target loss (or by loss after ``--budget-s``), the
strategies to try first, each strategy's knobs chosen for that, and what is left out and why.

**Objective.** Time to target = tokens to the target (:mod:`~quietsync.plan.loss_model`: the baseline's curve,
transformed by the papers' priors or measured by a pilot) ÷ predicted tokens/s (:mod:`~quietsync.plan.table`).
With ``--budget-s`` the objective is the held-out loss predicted after that many seconds instead.

**Knobs.** Each strategy's settings in the candidate grid (:mod:`~quietsync.plan.candidates`) compete on the
objective; the best one is the strategy's setting — DiLoCo's H, fragments and τ, DeMo's replicator and compression,
ACCO/DPU/WP's cap — chosen for time to target, not for how busy the workers are.

**The list.** Every strategy appears once: ranked at its best setting, or named with why it is left out (does not
apply to this topology, not predicted to reach the target). Settings that cannot reach the target are said so.
The diagnosis compares the synchronous baseline's communication with its computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..cost.compute import ComputeProfile
from ..strategies.registry import baselines, declaration, strategy_config
from .curve_fit import Interval
from .loss_model import LossEstimate, TimeToTarget
from .table import Row, fmt_bytes

HETEROGENEOUS = 1.15
"""Slowest / fastest worker compute above which workers count as heterogeneous."""
TRY_FIRST = 3
"""How many settings the advice lists under "Try first" (each strategy's best, best first)."""


@dataclass
class Scored:
    """One row with its loss estimate and objective."""

    row: Row
    estimate: LossEstimate
    time: TimeToTarget | None = None
    """Time to target (target mode)."""
    loss: Interval | None = None
    """Predicted loss after the budget (budget mode)."""

    @property
    def objective(self) -> float:
        """Smaller is better: seconds to target, or the loss after the budget."""
        if self.loss is not None:
            return self.loss.value
        return self.time.seconds.value if self.time is not None else math.inf

    @property
    def reaches(self) -> bool:
        return math.isfinite(self.objective)


@dataclass
class Recommendation:
    """One strategy to try, with its setting, its predicted time to target and the reasons."""

    rank: int
    strategy: str
    spec: str
    label: str
    knobs: dict[str, Any]
    tokens_per_s: float
    seconds: Interval | None
    """Predicted seconds to the target (target mode)."""
    tokens: Interval | None
    """Predicted tokens to the target (target mode)."""
    loss: Interval | None
    """Predicted loss after the budget (budget mode)."""
    speedup: float
    """The baseline's objective over this one's (time to target: × faster; budget: loss ratio)."""
    reason: str
    loss_per_token: list[str] = field(default_factory=list)
    """What the tokens to target rest on: the priors' sources and assumptions, or the pilot."""
    source: str = "prior"

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        for k in ("seconds", "tokens", "loss"):
            out[k] = vars(out[k]) if out[k] is not None else None
        return out


@dataclass
class Advice:
    """The diagnosis, the ranking, the strategies to try first, the knobs chosen and what is left out."""

    diagnosis: str
    baseline: str
    objective: str
    """What is ranked, e.g. ``time to held-out loss 4.6``."""
    recommendations: list[Recommendation]
    ranking: list[Recommendation]
    """Every ranked strategy at its best setting, best first (the first three are :attr:`recommendations`)."""
    tuned: list[str]
    """One line per strategy with several settings: which was chosen and why."""
    left_out: list[str]
    """One line per strategy not ranked: why."""
    unreachable: list[str] = field(default_factory=list)
    """Settings not predicted to reach the target."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"diagnosis": self.diagnosis, "baseline": self.baseline, "objective": self.objective,
                "recommendations": [r.to_dict() for r in self.recommendations],
                "ranking": [r.to_dict() for r in self.ranking], "tuned": self.tuned, "left_out": self.left_out,
                "unreachable": self.unreachable, "notes": self.notes}

    def markdown(self) -> str:
        lines = [f"**Diagnosis**: {self.diagnosis}", "", f"**Try first** (ranked by {self.objective}):", ""]
        for r in self.recommendations:
            lines.append(f"{r.rank}. `{r.spec}` ({r.label}): {_objective_text(r)} — {r.reason}")
            for f in r.loss_per_token:
                lines.append(f"   - loss per token ({r.source}): {f}")
        rest = self.ranking[len(self.recommendations):]
        if rest:
            lines += ["", "**Then**: " + "; ".join(f"{r.rank}. `{r.spec}` {_objective_text(r, short=True)}"
                                                   for r in rest)]
        if self.tuned:
            lines += ["", f"**Knobs chosen for {self.objective}**:", ""] + [f"- {t}" for t in self.tuned]
        if self.unreachable:
            lines += ["", "**Not predicted to reach the target**:", ""] + [f"- {t}" for t in self.unreachable]
        if self.left_out:
            lines += ["", "**Left out**:", ""] + [f"- {t}" for t in self.left_out]
        if self.notes:
            lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def fmt_duration(s: float) -> str:
    """``95 s``, ``4.2 min``, ``3.1 h``, ``9.5 days``, ``3.2 years``; ``∞`` when not reached."""
    if not math.isfinite(s):
        return "∞"
    if s < 120:
        return f"{s:.3g} s"
    if s < 7200:
        return f"{s / 60:.3g} min"
    if s < 48 * 3600:
        return f"{s / 3600:.3g} h"
    if s < 730 * 86400:  # up to two years in days (3.13e+04 h reads as nothing)
        return f"{s / 86400:.3g} days"
    return f"{s / (365 * 86400):.3g} years"


def fmt_interval(i: Interval, fmt: Any = fmt_duration) -> str:
    return f"{fmt(i.value)} ({fmt(i.low)}–{fmt(i.high)})"


def _objective_text(r: Recommendation, short: bool = False) -> str:
    if r.loss is not None:
        text = f"loss {r.loss.value:.3f} ({r.loss.low:.3f}–{r.loss.high:.3f}) after the budget"
        return text if short else f"{text}, {r.tokens_per_s:,.0f} tokens/s"
    assert r.seconds is not None and r.tokens is not None
    text = f"{fmt_interval(r.seconds)} to the target"
    if short:
        return text
    return f"{text}, {r.tokens.value:,.0f} tokens at {r.tokens_per_s:,.0f} tokens/s, {versus_baseline(r.speedup)}"


def versus_baseline(speedup: float) -> str:
    """How a time to target compares with the baseline's, ``speedup`` being the baseline's time over this one's:
    ``6.20× faster than the baseline``, ``1.25× slower than the baseline``, ``as fast as the baseline``."""
    if math.isinf(speedup):
        return "∞× faster than the baseline"
    if f"{speedup:.2f}" == "1.00":  # as printed: never "1.00× faster"
        return "as fast as the baseline"
    if speedup > 1:
        return f"{speedup:.2f}× faster than the baseline"
    return f"{1 / speedup:.2f}× slower than the baseline"


def diagnosis(baseline: Row) -> str:
    """``link-bound: comm 3.4× compute (zero1 ...)`` or ``compute-bound ...`` from the synchronous baseline."""
    ratio = baseline.comm_s / baseline.compute_s if baseline.compute_s > 0 else float("inf")
    where = f"{baseline.label}: {baseline.comm_s:.3g} s of communication per {baseline.compute_s:.3g} s of compute"
    if baseline.compute_busy >= 0.9:
        return f"compute-bound: comm {ratio:.2g}× compute ({where}); synchronous training keeps the workers busy"
    return (f"link-bound: comm {ratio:.2g}× compute ({where}); "
            f"the workers compute {baseline.compute_busy:.0%} of the time")


def _reason(r: Row, baseline: Row, world: int) -> str:
    """The busy share, then the sentence the strategy declares (``PlanFacts.advice``) filled in for this row."""
    busy = f"busy {r.compute_busy:.0%}"
    facts = declaration(r.strategy).plan
    if facts.advice is None:
        return busy

    def sent(row: Row) -> str:
        return fmt_bytes(row.bytes_per_link.get("inter", 0.0) or sum(row.bytes_per_link.values()))

    fields = {"config": strategy_config(r.strategy, r.knobs), "setting": r.label.removeprefix(f"{r.strategy} "),
              "tokens_per_step": r.tokens_per_step, "sent": sent(r), "baseline_sent": sent(baseline),
              "per_stage": r.micro_batches / world / facts.stages if facts.stages else None}
    return f"{busy}; {facts.advice.format(**fields)}"


def is_baseline(row: Row) -> bool:
    """Whether ``row`` may be the synchronous baseline: a baseline strategy at its defaults."""
    return declaration(row.strategy).plan.baseline is not None and not row.knobs


def best_per_strategy(scored: list[Scored]) -> list[Scored]:
    """Each strategy's best setting by the objective (ties: more tokens/s), best first; strategies whose every
    setting misses the target last."""
    best: dict[str, Scored] = {}
    for s in scored:
        cur = best.get(s.row.strategy)
        if cur is None or (s.objective, -s.row.tokens_per_s) < (cur.objective, -cur.row.tokens_per_s):
            best[s.row.strategy] = s
    return sorted(best.values(), key=lambda s: (s.objective, -s.row.tokens_per_s))


def advise(scored: list[Scored], compute: ComputeProfile, world: int, objective: str,
           left_out: list[tuple[str, str]], top: int = TRY_FIRST, varying: bool = False) -> Advice:
    """Rank ``scored`` (see the module docstring). ``left_out``: ``(strategy or setting, why)``; ``varying``: a link
    varies during the run (its settings that re-pick their knobs are named)."""
    # the baseline may be no row (--only, or left out): an exact setting, else any, is the reference
    exact = [s for s in scored if is_baseline(s.row)] or \
        [s for s in scored if declaration(s.row.strategy).plan.exact] or scored
    base = min(exact, key=lambda s: (s.objective, -s.row.tokens_per_s))
    ranked = best_per_strategy(scored)
    reaching = [s for s in ranked if s.reaches]
    missing = [s for s in ranked if not s.reaches]
    recs = []
    for i, s in enumerate(reaching, 1):
        r = s.row
        budget = s.loss is not None
        speedup = (base.objective / s.objective if s.objective > 0 else math.inf)
        recs.append(Recommendation(
            i, r.strategy, r.spec, r.label, dict(r.knobs), r.tokens_per_s,
            None if budget else (s.time.seconds if s.time else None),
            None if budget else s.estimate.tokens, s.loss, speedup, _reason(r, base.row, world),
            list(s.estimate.notes), s.estimate.source))
    scales = compute.scales(world)
    spread = max(scales) / min(scales)
    notes = []
    if not any(is_baseline(s.row) for s in scored):
        # the reference is then one of the ranked settings, itself "as fast as the baseline"
        notes.append(f"no synchronous baseline among the ranked settings (add {baselines()[0]} to "
                     f"--strategies): the diagnosis, the speed-ups and the bytes compare with `{base.row.spec}`")
    if spread > HETEROGENEOUS:
        notes.append(f"heterogeneous workers (slowest {spread:.2f}× the fastest): synchronous strategies run at the "
                     "slowest worker's pace; ACCO's fast workers compute more micro-batches instead of waiting"
                     + _best_of(scored, lambda c: getattr(c, "inner_steps", "fixed") == "adaptive",
                                "; with adaptive inner steps (`--inner-steps adaptive`, Local SGD and DiLoCo) a slow "
                                "worker takes fewer inner steps per round instead of every worker waiting for it"))
    if varying:
        notes.append("the link varies during the run (a schedule): each setting's time to the target follows its "
                     "speed on every stretch of it"
                     + _best_of(scored, lambda c: bool(getattr(c, "adapt", False)),
                                "; `--adapt` re-picks a setting's knob from the measured link as it changes ("
                                + ", ".join(sorted({s.row.strategy for s in scored if s.row.knobs.get("adapt")}))
                                + ")"))
    tuned = []
    for s in reaching:  # a strategy none of whose settings reaches the target has no least time: named below
        # the chosen one is the best by (objective, tokens/s): the others follow in that order, it not among them
        same = sorted((x for x in scored if x.row.strategy == s.row.strategy and x is not s),
                      key=lambda x: (x.objective, -x.row.tokens_per_s))
        if same:
            others = ", ".join(f"`{x.row.spec}` {_short(x)}" for x in same)
            tuned.append(f"{s.row.strategy}: `{s.row.spec}` {_short(s)} — least {objective} of its settings "
                         f"(then {others})")
    unreachable = [f"`{s.row.spec}` ({s.row.label}): {_why_not(s, base.reaches)}" for s in scored if not s.reaches]
    out: list[str] = []
    for name, why in left_out:  # one line per reason: a strategy whose every setting is left out for it, once
        line = f"{name}: {why}"
        if line not in out:
            out.append(line)
    out += [f"{s.row.strategy}: no setting is predicted to reach the target" for s in missing]
    return Advice(diagnosis(base.row), base.row.label, objective, recs[:top], recs, tuned, out, unreachable, notes)


def _best_of(scored: list[Scored], which: Any, what: str) -> str:
    """``what``, then the best of the settings whose config ``which`` accepts, against the best of the rest
    (empty when none is ranked)."""
    mine = [s for s in scored if which(strategy_config(s.row.strategy, s.row.knobs))]
    rest = [s for s in scored if s not in mine]
    if not mine:
        return ""
    best = min(mine, key=lambda s: (s.objective, -s.row.tokens_per_s))
    other = min(rest, key=lambda s: (s.objective, -s.row.tokens_per_s)) if rest else None
    if other is None or (best.objective, -best.row.tokens_per_s) <= (other.objective, -other.row.tokens_per_s):
        line = f"{what}: recommended, `{best.row.spec}` {_short(best)}"
        if other is not None and best.reaches and other.reaches and best.objective > 0:
            line += f", {other.objective / best.objective:.2f}× sooner than the best other setting, `{other.row.spec}`"
        return line
    return (f"{what}; its best here, `{best.row.spec}` {_short(best)}, is not predicted the fastest "
            f"(`{other.row.spec}` {_short(other)})")


def _short(s: Scored) -> str:
    if s.loss is not None:
        return f"(loss {s.loss.value:.3f})"
    if s.time is None or not s.reaches:
        return "(not reached)"
    return f"({fmt_duration(s.time.seconds.value)})"


def _why_not(s: Scored, base_reaches: bool = True) -> str:
    e = s.estimate
    if not base_reaches:
        # the baseline's own curve flattens above the target: every multiplier or penalty on it is beside the point
        return "the baseline's loss curve, which every setting's follows, flattens above the target"
    if not math.isfinite(e.multiplier.value):
        head = "no number of tokens reaches the target"
    elif e.source == "prior" and e.penalty[1] > 0:
        lo, d, hi = e.penalty
        head = (f"its loss penalty δ = {d:+.2%} ({lo:+.2%} to {hi:+.2%}) puts its floor (the "
                f"baseline curve's × (1 + δ)) above the target")
    else:
        head = f"tokens ×{e.multiplier.value:.3g} the baseline's"
    return f"{head} — " + ("; ".join(e.notes) if e.notes else "its curve flattens above the target")


__all__ = ["HETEROGENEOUS", "TRY_FIRST", "Advice", "Recommendation", "Scored", "advise", "is_baseline",
           "best_per_strategy", "diagnosis", "fmt_duration", "fmt_interval", "versus_baseline"]
