"""What a plan ranks by, and scoring one row against it.

:class:`Objective` holds the target (a held-out loss, or a time budget), the synchronous baseline's loss curve and
where it comes from, the priors' context, the pilot estimates, and the evaluation overhead of the planned run;
:meth:`Objective.score` turns a predicted row (speed) into a :class:`~quietsync.plan.recommend.Scored` (tokens and
time to target, or loss after the budget). :func:`initial_objective` builds it before any pilot: the Chinchilla
law's shape for the baseline, started at the untrained model's loss (what-if, or a measured plan without a target),
with the assumption stated.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .config import PlanConfig, PlanError
from .curve_fit import Interval
from .loss_model import (
    CHINCHILLA_FITTED,
    CHINCHILLA_TOKENS_PER_PARAM,
    CHINCHILLA_VOCAB,
    SPEED_ERROR,
    BaselineCurve,
    LossEstimate,
    TimeToTarget,
    chinchilla_curve,
    from_prior,
    loss_at,
    time_to_target,
)
from .priors import PriorContext, prior_for
from .recommend import Scored
from .schedules import strategy_config
from .table import Row

MIN_STEP_SHARE = 0.25
"""A pilot's correction of the cost model (:attr:`Objective.step_overhead_s`, which may be negative) never takes a
step below this share of the model's own step time."""


@dataclass
class Objective:
    """The ranking's target and the loss model's inputs."""

    baseline: BaselineCurve
    target: float | None
    """Held-out loss to reach (None: budget mode)."""
    budget_s: float | None
    priors: PriorContext
    notes: list[str] = field(default_factory=list)
    """Where the target and the baseline curve come from (printed as assumptions)."""
    pilots: dict[str, LossEstimate] = field(default_factory=dict)
    """Spec → estimate measured by its pilot."""
    eval_every: int = 0
    """The planned run's evaluation cadence in steps (0: evaluations not counted)."""
    eval_s: float = 0.0
    """Seconds one evaluation takes (measured by the pilots)."""
    max_steps: int | None = None
    """The planned run's step budget: a setting needing more steps is not reached within the run."""
    step_overhead_s: dict[str, float] = field(default_factory=dict)
    """Spec → seconds per step its pilot spent beyond (negative: short of) the cost model's prediction on the same
    (delay-free) link: main-thread work the model leaves out (a communication thread sharing the core, codec time),
    or a compute profile measured slow or fast; 0 for a setting whose pilot measured its whole step through the
    link."""
    overhead_per_micro_batch_s: float = 0.0
    """Seconds per micro-batch the baseline's pilot spent beyond (negative: short of) the cost model's prediction (the
    trainer's work the model leaves out: data, control plane; a compute profile measured slow or fast), added to
    every setting without a pilot of its own."""
    link_phases: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """Spec → ``(start seconds, tokens/s)`` of each steady stretch of a link that varies during the run (given as a
    schedule), the cost model's; empty for steady links. Time to target then integrates the speed over the
    stretches (the last one lasting to the end), each scaled as the pilots corrected the row's first stretch."""

    @property
    def description(self) -> str:
        if self.budget_s is not None:
            return f"held-out loss after {self.budget_s:g} s"
        return f"time to held-out loss {self.target:.4g}"

    def estimate(self, row: Row) -> LossEstimate:
        """Row's tokens to the target: its pilot's, else its prior on the baseline curve."""
        if row.spec in self.pilots:
            return self.pilots[row.spec]
        cfg = strategy_config(row.strategy, row.knobs)
        # budget mode has no target, but B_crit(L) needs a loss: the baseline's after this row's budget
        target = self.target if self.target is not None else self._budget_target(row)
        prior = prior_for(row.strategy, cfg, self.prior_context(target), row.tokens_per_step)
        return from_prior(prior, self.baseline, target)

    def prior_context(self, target: float) -> PriorContext:
        """The priors' context at ``target``: the baseline's tokens to it (what the warm-up is weighed against)."""
        if self.priors.baseline_tokens is not None:
            return self.priors
        return dataclasses.replace(self.priors, baseline_tokens=self.baseline.tokens_at(target))

    def _budget_target(self, row: Row) -> float:
        return self.baseline.point(max(1.0, row.tokens_per_s * (self.budget_s or 0.0)))

    def _eval_seconds(self, row: Row, tokens: float) -> float:
        if not self.eval_every or not self.eval_s or not math.isfinite(tokens) or row.tokens_per_step <= 0:
            return 0.0
        return math.floor(tokens / row.tokens_per_step / self.eval_every) * self.eval_s

    def tokens_per_s(self, row: Row) -> float:
        """The row's predicted tokens/s, with the overhead its pilot (or else the baseline's) measured."""
        extra = self.step_overhead_s.get(row.spec, self.overhead_per_micro_batch_s * row.micro_batches)
        if not extra or row.tokens_per_s <= 0:
            return row.tokens_per_s
        step = row.tokens_per_step / row.tokens_per_s
        return row.tokens_per_step / max(step + extra, MIN_STEP_SHARE * step)

    def score(self, row: Row) -> Scored:
        """The row's estimate and objective (time to target, or loss after the budget)."""
        # copies: the notes and tokens changed below must not leak into the shared pilot estimate
        est = dataclasses.replace(self.estimate(row))
        est.notes = list(est.notes)
        tps = self.tokens_per_s(row)
        if self.budget_s is not None:
            per_s = tps
            if self.eval_every and self.eval_s and row.tokens_per_step > 0:  # evaluations take part of the budget
                per_s = row.tokens_per_step / (row.tokens_per_step / tps + self.eval_s / self.eval_every)
            return Scored(row, est, loss=loss_at(est, self.baseline, per_s * self.budget_s))
        if self.max_steps is not None and row.tokens_per_step > 0 and est.tokens.finite \
                and est.tokens.value / row.tokens_per_step > self.max_steps:
            est.notes.append(f"needs {est.tokens.value / row.tokens_per_step:,.0f} steps, more than the run's "
                             f"--max-steps {self.max_steps}")
            inf = math.inf
            est.tokens = Interval(inf, est.tokens.low, inf)
        phases = self.link_phases.get(row.spec)
        if phases and phases[0][1] > 0:  # the first stretch is what the row (and a pilot's correction) speak of
            t = _phased_time(est, phases, tps / phases[0][1])
        else:
            t = time_to_target(est, tps)
        extra = self._eval_seconds(row, est.tokens.value)
        if extra:
            s = t.seconds
            t = type(t)(Interval(s.value + extra, s.low + self._eval_seconds(row, est.tokens.low),
                                 s.high + self._eval_seconds(row, est.tokens.high)), t.tokens_per_s)
        return Scored(row, est, time=t)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "budget_s": self.budget_s, "description": self.description,
                "baseline": {"source": self.baseline.source, "description": self.baseline.description,
                             "a": self.baseline.law.a, "b": self.baseline.law.b, "c": self.baseline.law.c,
                             "offset": self.baseline.law.offset,
                             "measured": list(self.baseline.measured)},
                "notes": self.notes, "eval_every": self.eval_every, "eval_s": self.eval_s,
                "step_overhead_s": self.step_overhead_s,
                "overhead_per_micro_batch_s": self.overhead_per_micro_batch_s}


def phased_seconds(tokens: float, phases: tuple[tuple[float, float], ...], factor: float = 1.0) -> float:
    """Seconds to train ``tokens`` on a link whose steady stretches start at ``phases[k][0]`` seconds and run at
    ``factor · phases[k][1]`` tokens/s (the last one to the end)."""
    if not math.isfinite(tokens):
        return math.inf
    left, clock = tokens, 0.0
    for k, (start, tps) in enumerate(phases):
        end = phases[k + 1][0] if k + 1 < len(phases) else math.inf
        rate = factor * tps
        if rate > 0 and left <= rate * (end - start):
            return start + left / rate
        if rate > 0:
            left -= rate * (end - start)
        clock = end
    # the last stretch never ends: only one at no speed leaves tokens over
    return math.inf if left > 0 else clock


def _phased_time(est: LossEstimate, phases: tuple[tuple[float, float], ...], factor: float) -> TimeToTarget:
    """Time to target over a varying link, its interval as :func:`~quietsync.plan.loss_model.time_to_target`'s (the
    speed within ``SPEED_ERROR`` either way); ``tokens_per_s``: the mean over the run."""
    tk = est.tokens
    value = phased_seconds(tk.value, phases, factor)
    low = phased_seconds(tk.low, phases, factor * (1 + SPEED_ERROR))
    high = phased_seconds(tk.high, phases, factor * (1 - SPEED_ERROR))
    mean = tk.value / value if 0 < value < math.inf else factor * phases[0][1]
    return TimeToTarget(Interval(value, low, high), mean)


def below_floor(target: float, floor: float, params: int, source: str | None = None) -> str:
    """The line refusing a target no setting is predicted to reach: below the baseline curve's floor."""
    source = source or (f"the Chinchilla law at N = {params:,} parameters, fitted on MassiveText: your data may go "
                        "lower")
    return (f"--target-loss {target:g} is below {floor:.3g}, the floor of the loss curve assumed for this model "
            f"({source}): no setting is predicted to reach it; give a higher --target-loss, --target-tokens N or "
            "--budget-s S, or plan with pilots on your data (a measured plan with --pilot-tokens N fits your curve)")


def check_target(cfg: PlanConfig, params: int, vocab: int | None) -> None:
    """Raise :class:`~quietsync.plan.config.PlanError` where the target lies below the baseline curve known before
    anything runs (no pilot to fit it): a what-if plan's, before any setting is evaluated."""
    if cfg.target_loss is None or cfg.budget_s is not None or cfg.pilot_tokens is not None:
        return
    law = chinchilla_curve(params, vocab)
    if not math.isfinite(law.tokens_to(cfg.target_loss)):
        raise PlanError(below_floor(cfg.target_loss, law.a, params))


def initial_objective(cfg: PlanConfig, params: int, workers: int, nodes: int, baseline_tokens_per_step: float,
                      vocab: int | None = None) -> Objective:
    """The objective before any pilot: the Chinchilla law's curve at ``params`` as the baseline (what-if, or a
    measured plan without a target, whose ranking is then by the priors alone), carried to a smaller vocabulary and
    started at ``ln(vocab)`` where it is known (:func:`~quietsync.plan.loss_model.chinchilla_curve`); the target as
    given or the loss after 20 tokens per parameter (Chinchilla-optimal)."""
    law = chinchilla_curve(params, vocab)
    tokens = cfg.target_tokens or CHINCHILLA_TOKENS_PER_PARAM * params
    desc = (f"the Chinchilla law at N = {params:,} parameters (Hoffmann et al. 2022, approach 3: L = 1.69 + "
            f"406.4/N^0.34 + 410.7/D^0.28, nats per token of its {CHINCHILLA_VOCAB:,}-token vocabulary on MassiveText)")
    notes = []
    untrained = math.log(vocab) if vocab and vocab >= 2 else math.inf
    if math.isfinite(untrained):
        if vocab < CHINCHILLA_VOCAB:
            desc += (f", scaled by ln {vocab:,}/ln {CHINCHILLA_VOCAB:,} = {untrained / math.log(CHINCHILLA_VOCAB):.3g} "
                     "to this vocabulary (a uniform guess scores ln V in both)")
        if law.offset:
            desc += (f", started at ln {vocab:,} = {untrained:.3g}, an untrained model's loss (D counted from the "
                     f"{law.offset:,.3g} tokens where the law reaches that loss)")
        else:
            notes.append(f"the baseline curve's floor {law.a:.4g} is not below ln {vocab:,} = {untrained:.4g}, an "
                         f"untrained model's loss: the law, fitted on {CHINCHILLA_FITTED}, cannot describe "
                         f"{params:,} parameters; give --target-loss X for your own")
    if cfg.budget_s is not None:
        target = None
        notes.insert(0, f"baseline loss curve: {desc} — an assumption: only its shape matters for the ranking")
    elif cfg.target_loss is not None:
        target = cfg.target_loss
        t = law.tokens_to(target)
        if not math.isfinite(t) and cfg.pilot_tokens is None:
            # nothing runs that could move the curve: no setting can be ranked by time to the target
            raise PlanError(below_floor(target, law.a, params))
        # a pilot fits the curve to the data: the Chinchilla floor does not bind then
        reach = (f"the baseline curve reaches it after {t:,.3g} tokens" if math.isfinite(t) else
                 f"the baseline curve never reaches it (its floor is {law.a:.3g}) until the pilot fits yours")
        notes.insert(0, f"target: held-out loss {target:g}; {reach} — an assumption about your data. Baseline "
                     f"curve: {desc}")
        if target >= untrained:
            notes.append(f"target {target:g} is not below ln {vocab:,} = {untrained:.4g}, the loss of a uniform guess: "
                         "an untrained model is about there already")
    else:
        target = float(law.loss(tokens))
        why = (f"--target-tokens {tokens:,}" if cfg.target_tokens else
               f"no target given: {CHINCHILLA_TOKENS_PER_PARAM} tokens per parameter ({tokens:,.3g}), "
               "Chinchilla-optimal")
        notes.insert(0, f"target: the loss the synchronous baseline reaches after {tokens:,.3g} tokens ({why}); "
                     f"baseline curve: {desc} — an assumption: the priors shift this curve, a pilot run "
                     "(--target-loss X --pilot-tokens N) measures yours")
        alone = float(chinchilla_curve(params).loss(tokens))
        if alone >= untrained and law.offset:
            notes.append(f"the law alone gives {alone:.4g} after {tokens:,.3g} tokens, not below ln {vocab:,} = "
                         f"{untrained:.4g} where an untrained model starts: it was fitted on {CHINCHILLA_FITTED}, "
                         f"not {params:,} parameters; the target {target:.4g} is its curve started there — give "
                         "--target-loss X for your own")
    priors = PriorContext(params=params, workers=workers, nodes=nodes,
                          baseline_tokens_per_step=baseline_tokens_per_step,
                          # budget mode: the batch rule still needs a loss to evaluate B_crit at
                          target_loss=target if target is not None else float(law.loss(tokens)))
    return Objective(BaselineCurve(law, "chinchilla", desc), target, cfg.budget_s, priors, notes)


__all__ = ["Objective", "below_floor", "check_target", "initial_objective"]
