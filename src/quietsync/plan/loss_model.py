"""Tokens to a target loss per candidate, as a multiplier over the synchronous baseline's, and time to it.

The **baseline curve** is the synchronous baseline's held-out loss over tokens, ``L_b(t) = a + b·t^(−c)``
(:mod:`~quietsync.plan.curve_fit`): fitted to its pilot run (:mod:`~quietsync.plan.pilots`), or — with
``--what-if``, where nothing runs — the data term of the Chinchilla law at the model's size (Hoffmann et al.
2022, approach 3: ``E + A/N^α + B/D^β``, E = 1.69, A = 406.4, B = 410.7, α = 0.34, β = 0.28), carried to a smaller
vocabulary and started at the untrained loss ``ln(vocabulary)`` (:func:`chinchilla_curve`), an assumption stated in
the output. A candidate's curve is the baseline's transformed by its prior (:mod:`~quietsync.plan.priors`):
``L(t) = (1 + δ)·L_b(t / k)``, so its tokens to a target ``L*`` are ``k · L_b⁻¹(L* / (1 + δ))`` — a small loss
penalty costs many tokens near the curve's floor, and a penalty that lifts ``L*/(1+δ)`` to the floor means the
target is **not predicted to be reached**. A candidate whose pilot ran gives its own token multiplier at equal loss
instead (:func:`from_pilot_tokens`).

**Time to target** = tokens to target ÷ predicted tokens/s (:mod:`~quietsync.plan.table`), with an interval
that multiplies the loss model's with the speed model's (:data:`SPEED_ERROR`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from .curve_fit import CurveFit, Interval, PowerLaw
from .priors import Prior

SPEED_ERROR = 0.15
"""Relative error of the predicted time per token the interval allows: the planner's benchmark measured 43 of 51
runs within 15% (docs/plan.md)."""

CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}
"""Hoffmann et al. (2022), approach 3: ``L(N, D) = E + A/N^α + B/D^β`` (nats, MassiveText)."""
CHINCHILLA_TOKENS_PER_PARAM = 20
"""Chinchilla-optimal tokens per parameter (Hoffmann et al. 2022)."""
CHINCHILLA_FITTED = "over 400 models of 70 M to 16 B parameters trained on 5 to 500 B tokens"
"""What the Chinchilla law was fitted on (Hoffmann et al. 2022, abstract)."""
CHINCHILLA_VOCAB = 32000
"""Tokens in the vocabulary of the Chinchilla law's models (Gopher's SentencePiece vocabulary, Rae et al. 2021): its
losses are nats per one of those tokens."""


def chinchilla_curve(params: float, vocab: int | None = None) -> PowerLaw:
    """The Chinchilla law at ``params`` parameters, over tokens. With ``vocab``: for a vocabulary smaller than the
    law's, its nats scaled by ``ln(vocab) / ln(32000)``; then started at ``ln(vocab)`` (its tokens counted from where
    it reaches that loss, :attr:`PowerLaw.offset`), unless its floor is not below ``ln(vocab)``."""
    c = CHINCHILLA
    law = PowerLaw(c["E"] + c["A"] / params ** c["alpha"], c["B"], c["beta"])
    if not vocab or vocab < 2:
        return law
    # A uniform guess scores ln V nats per token. The law's losses are per token of 32,000: for fewer tokens they
    # are carried over in that proportion, else a small model's floor alone would lie near or above ln V (the
    # multipliers at equal loss do not change). A larger vocabulary's ln V lies above the law's start: kept as is.
    unit = min(1.0, math.log(vocab) / math.log(CHINCHILLA_VOCAB))
    law = PowerLaw(law.a * unit, law.b * unit, law.c)
    # An untrained model starts at that guess, but the law grows without bound towards 0 tokens and, for a model far
    # smaller than those it was fitted on, stays above ln V for many tokens: started there instead (this moves a 1 B
    # model's curve by ~1e6 tokens, nothing; a 1 M model's by 0.4× its 20 tokens per parameter).
    start = law.tokens_to(math.log(vocab))
    return replace(law, offset=start) if math.isfinite(start) else law


@dataclass(frozen=True)
class BaselineCurve:
    """The synchronous baseline's loss over tokens and where it comes from: measured evaluations (a pilot) where
    there are some, the fitted power law past them."""

    law: PowerLaw
    source: str
    """``"pilot"`` (fitted to the baseline's pilot) or ``"chinchilla"`` (what-if)."""
    description: str
    fit: CurveFit | None = None
    """The fit with its bootstrap refits (pilots)."""
    measured: tuple[tuple[float, float], ...] = ()
    """``(tokens, loss)`` of the pilot's evaluations, in order (empty: the law alone)."""
    brackets: tuple[Any, ...] = ()
    """Other fits of the same evaluations whose extrapolations the interval must contain (the floor's range)."""

    def _crossing(self, target: float) -> float | None:
        """Tokens at which the measured curve first reaches ``target`` (linear between evaluations), None if not."""
        prev = None
        for t, y in self.measured:
            if y <= target:
                # the first evaluation is already at the target: nothing before it to interpolate from
                if prev is None or prev[1] <= y:
                    return t
                (t0, y0) = prev
                return t0 + (t - t0) * (y0 - target) / (y0 - y)
            prev = (t, y)
        return None

    def tokens_at(self, target: float) -> float:
        """Tokens to ``target``: measured where the pilot got there, else the law's (``inf`` below its floor)."""
        hit = self._crossing(target)
        return hit if hit is not None else self.law.tokens_to(target)

    def tokens_to(self, target: float) -> Interval:
        hit = self._crossing(target)
        if hit is not None:
            return Interval(hit, hit, hit)
        if self.fit is not None:
            reach = self.fit.tokens_to(target).tokens
            ends = [law.tokens_to(target) for law in self.brackets]
            low, high = min([reach.low, *ends]), max([reach.high, *ends])
            # the pilot had not reached it by its last evaluation: no fewer tokens than that
            return Interval(reach.value, max(low, self.last_tokens), max(high, self.last_tokens))
        t = self.law.tokens_to(target)
        return Interval(t, t, t)

    @property
    def last_tokens(self) -> float:
        return self.measured[-1][0] if self.measured else 0.0

    def point(self, tokens: float) -> float:
        """The loss after ``tokens``: interpolated between evaluations, the law past the last one."""
        if self.measured and tokens <= self.last_tokens:
            ts = [t for t, _ in self.measured]
            ys = [y for _, y in self.measured]
            if tokens <= ts[0]:
                # before the first evaluation there is nothing to interpolate from: the law
                return float(self.law.loss(tokens)) if tokens < ts[0] else ys[0]
            i = next(k for k, t in enumerate(ts) if t >= tokens)
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (tokens - ts[i - 1]) / (ts[i] - ts[i - 1])
        return float(self.law.loss(tokens))

    def loss_at(self, tokens: float) -> Interval:
        v = self.point(tokens)
        if self.fit is not None and tokens > self.last_tokens:
            return self.fit.loss_at(tokens)
        return Interval(v, v, v)


@dataclass
class LossEstimate:
    """A candidate's tokens to the target (or loss at a token count), as the loss model predicts them."""

    multiplier: Interval
    """Tokens to the target over the baseline's (``inf``: not reached)."""
    tokens: Interval
    """Tokens to the target, all workers together."""
    source: str
    """``exact`` (the baseline's own trajectory), ``prior`` (the papers) or ``pilot`` (its own pilot's curve)."""
    notes: list[str] = field(default_factory=list)
    penalty: tuple[float, float, float] = (0.0, 0.0, 0.0)
    factor: tuple[float, float, float] = (1.0, 1.0, 1.0)

    @property
    def reachable(self) -> bool:
        """Whether the point estimate reaches the target."""
        return self.tokens.finite

    @property
    def certain(self) -> bool:
        """Whether even the interval's pessimistic end reaches it."""
        return math.isfinite(self.tokens.high)

    def to_dict(self) -> dict[str, Any]:
        return {"multiplier": vars(self.multiplier), "tokens": vars(self.tokens), "source": self.source,
                "notes": self.notes, "reachable": self.reachable}


def _transformed_tokens(baseline: BaselineCurve, target: float, delta: float, k: float) -> float:
    return k * baseline.tokens_at(target / (1 + delta))


def from_prior(prior: Prior, baseline: BaselineCurve, target: float) -> LossEstimate:
    """Tokens to ``target`` of a candidate whose curve is the baseline's transformed by ``prior``."""
    base = baseline.tokens_to(target)
    if prior.exact:
        return LossEstimate(Interval(1.0, 1.0, 1.0), base, "exact", list(prior.notes))
    (d_lo, d, d_hi), (k_lo, k, k_hi) = prior.penalty, prior.multiplier
    t0 = baseline.tokens_at(target)
    point = _transformed_tokens(baseline, target, d, k)
    best = _transformed_tokens(baseline, target, d_lo, k_lo)
    worst = _transformed_tokens(baseline, target, d_hi, k_hi)
    mult = Interval(point / t0, best / t0, worst / t0) if math.isfinite(t0) else Interval(math.inf, math.inf, math.inf)
    # the baseline curve's own uncertainty widens the tokens (it does not change the multiplier)
    tokens = Interval(point, mult.low * base.low if math.isfinite(mult.low) else math.inf,
                      mult.high * base.high if math.isfinite(mult.high) else math.inf)
    return LossEstimate(mult, tokens, "prior", list(prior.notes), prior.penalty, prior.multiplier)


RATIO_TAIL = 0.5
"""The last fraction of a pilot (by tokens) whose evaluations give its token multiplier."""
K_MARGIN = 0.03
"""Relative half-width added to the spread of the multiplier over the tail (held-out evaluations scatter by ~1%,
which the baseline curve's slope turns into a few percent of tokens)."""
K_DRIFT = 0.15
"""How far a pilot's multiplier may drift per doubling of the extrapolation past the pilot, each way: on the
equal-loss runs (benchmarks/results/equal_loss.md) DeMo's fell from ×1.79 at 0.22 M tokens to ×1.21 at the target
(2.3 M, 3.4 doublings: 11% per doubling) and DiLoCo H = 16's rose from ×1.9 to ×3.26 (4.8 doublings: 12%)."""


def matched_multipliers(tokens: list[float], losses: list[float], baseline: BaselineCurve
                        ) -> list[tuple[float, float]]:
    """``(tokens, k)`` for each evaluation in a pilot's tail: its tokens over the baseline's to the same held-out
    loss (the baseline's measured curve where it got there, its fitted law past it)."""
    pts = [(t, y) for t, y in zip(tokens, losses) if t > 0 and math.isfinite(y)]
    if not pts:
        raise ValueError("a pilot needs evaluations after its first step")
    start = pts[-1][0] * (1 - RATIO_TAIL)
    out = []
    for t, y in (p for p in pts if p[0] >= start):
        tb = baseline.tokens_at(y)
        # a loss below the baseline's floor has no baseline tokens to compare with
        if math.isfinite(tb) and tb > 0:
            out.append((t, t / tb))
    return out


def from_pilot_tokens(tokens: list[float], losses: list[float], baseline: BaselineCurve, target: float,
                      notes: list[str], reached: float | None = None) -> LossEstimate:
    """Tokens to ``target`` of a piloted candidate, by the **token multiplier at equal loss**: each evaluation in
    the last part of its pilot reached its held-out loss after ``k`` times the tokens the baseline needed for the
    same loss; ``k`` (the mean over the last third) times the baseline's tokens to the target is the candidate's.
    The interval spans the tail's ``k`` and lets it drift by :data:`K_DRIFT` per doubling of the extrapolation.
    A pilot that reached the target (``reached``: its tokens then) is its own measurement.

    Why not a loss penalty at equal tokens, ``L = (1 + δ)·L_b``: a pilot sees the early curve, where a slower
    method's loss is several percent above the baseline's while the curves fall fast; carried to the target, near
    the curve's floor, that ratio costs far more tokens than the methods need (on the equal-loss runs it predicted
    SparseLoCo ×11.8 and DeMo ×2.9 for measured ×2.07 and ×1.21; the multiplier at equal loss gave ×2.9 and
    ×1.8 from the same pilots)."""
    t0 = baseline.tokens_at(target)
    if reached is not None:
        m = reached / t0 if math.isfinite(t0) and t0 > 0 else math.inf
        return LossEstimate(Interval(m, m, m), Interval(reached, reached, reached), "pilot",
                            notes + [f"reached the target in its pilot at {reached:,.0f} tokens"])
    ks = matched_multipliers(tokens, losses, baseline)
    if not ks or not math.isfinite(t0) or t0 <= 0:
        inf = Interval(math.inf, math.inf, math.inf)
        why = ("its pilot's losses are beyond the baseline's curve" if not ks
               else "the baseline is not predicted to reach the target")
        return LossEstimate(inf, inf, "pilot", notes + [why])
    last = [k for _, k in ks[-max(1, len(ks) // 3):]]
    k = sum(last) / len(last)
    span = [x for _, x in ks] + [k]
    # how far the target lies past the pilot's last evaluation, in doublings of its tokens
    doublings = max(0.0, math.log2(k * t0 / ks[-1][0]))
    drift = 1 + K_DRIFT * doublings
    k_lo, k_hi = min(span) * (1 - K_MARGIN) / drift, max(span) * (1 + K_MARGIN) * drift
    base = baseline.tokens_to(target)
    note = (f"×{k:.3g} the baseline's tokens to the same held-out loss over its last "
            f"{ks[-1][0] - ks[0][0]:,.0f} tokens (×{min(span):.3g}–×{max(span):.3g}; the interval lets it drift "
            f"{K_DRIFT:.0%} per doubling over the {doublings:.1f} doublings to the target)")
    return LossEstimate(Interval(k, k_lo, k_hi), Interval(k * t0, k_lo * base.low, k_hi * base.high), "pilot",
                        notes + [note], factor=(k_lo, k, k_hi))


def from_pilot_batch(tokens: list[float], losses: list[float], batch: float, baseline_batch: float,
                     baseline: BaselineCurve, target: float, notes: list[str]) -> LossEstimate:
    """Tokens to ``target`` of a piloted candidate whose steps hold more tokens than the baseline's (ACCO/DPU/WP
    stages, accumulation): by the critical-batch rule a batch ``B`` needs ``k = (1 + B/B_crit)/(1 + B0/B_crit)``
    times the tokens of the baseline's ``B0`` (McCandlish et al. 2018), and ``B_crit(L) = B*/L^(1/α_B)`` grows as
    the loss falls (Kaplan et al. 2020). Each evaluation in the pilot's tail gives ``k`` (its tokens over the
    baseline's to the same loss) and so ``B*``; their mean, at Kaplan's ``α_B``, gives ``k`` at the target. The
    interval spans the tail's ``B*``."""
    from .priors import KAPLAN_ALPHA_B

    pts = [(t, y) for t, y in zip(tokens, losses) if t > 0 and math.isfinite(y)]
    if not pts:
        raise ValueError("a pilot needs evaluations after its first step")
    start = pts[-1][0] * (1 - RATIO_TAIL)
    stars = []
    for t, y in (p for p in pts if p[0] >= start):
        tb = baseline.tokens_at(y)
        if not math.isfinite(tb) or tb <= 0:
            continue
        k = t / tb
        # only there does k = (B + B_crit)/(B0 + B_crit) give a positive, finite B_crit
        if 1 < k < batch / baseline_batch:
            # B_crit at this evaluation's loss y, carried to B* = B_crit·y^(1/α_B)
            stars.append((batch - k * baseline_batch) / (k - 1) * y ** (1 / KAPLAN_ALPHA_B))
    t0 = baseline.tokens_at(target)
    if not stars or not math.isfinite(t0):  # no batch effect seen (k ≤ 1 or beyond the rule): k itself
        return from_pilot_tokens(tokens, losses, baseline, target, notes)
    last = stars[-max(1, len(stars) // 3):]
    b_star = sum(last) / len(last)

    def k_at(bs: float) -> float:
        bc = bs / target ** (1 / KAPLAN_ALPHA_B)
        return (1 + batch / bc) / (1 + baseline_batch / bc)

    # a larger B* means a larger B_crit and fewer extra tokens: the optimistic end
    k, k_lo, k_hi = k_at(b_star), k_at(max(stars)), k_at(min(stars))
    base = baseline.tokens_to(target)
    mult = Interval(k, k_lo, k_hi)
    note = (f"{batch:,.0f} tokens per step against the baseline's {baseline_batch:,.0f}; B_crit fitted to "
            f"its last {len(stars)} evaluations (B* = {b_star:.3g} at α_B = {KAPLAN_ALPHA_B}) gives ×{k:.3g} the "
            f"baseline's tokens at the target (×{k_lo:.3g}–×{k_hi:.3g})")
    return LossEstimate(mult, Interval(k * t0, k_lo * base.low, k_hi * base.high), "pilot", notes + [note],
                        factor=(k_lo, k, k_hi))


def loss_at(estimate: LossEstimate, baseline: BaselineCurve, tokens: float) -> Interval:
    """The candidate's predicted held-out loss after ``tokens`` (budget mode, predicted curves)."""
    (d_lo, d, d_hi), (k_lo, k, k_hi) = estimate.penalty, estimate.factor
    b = baseline.loss_at(tokens / k)
    lo = (1 + d_lo) * baseline.point(tokens / k_lo)
    hi = (1 + d_hi) * baseline.point(tokens / k_hi)
    return Interval((1 + d) * b.value, min(lo, (1 + d) * b.low), max(hi, (1 + d) * b.high))


@dataclass(frozen=True)
class TimeToTarget:
    """Seconds to the target: tokens ÷ tokens/s, with the interval of both."""

    seconds: Interval
    tokens_per_s: float

    @property
    def reachable(self) -> bool:
        return self.seconds.finite


def time_to_target(estimate: LossEstimate, tokens_per_s: float, speed_error: float = SPEED_ERROR) -> TimeToTarget:
    """Seconds to the target at ``tokens_per_s`` (the cost model's), the speed taken within ``speed_error``."""
    if tokens_per_s <= 0:
        inf = math.inf
        return TimeToTarget(Interval(inf, inf, inf), tokens_per_s)
    t = estimate.tokens
    return TimeToTarget(Interval(t.value / tokens_per_s, t.low / (tokens_per_s * (1 + speed_error)),
                                 t.high / (tokens_per_s * (1 - speed_error))), tokens_per_s)


__all__ = ["CHINCHILLA", "CHINCHILLA_FITTED", "CHINCHILLA_VOCAB", "SPEED_ERROR", "BaselineCurve", "LossEstimate",
           "TimeToTarget", "chinchilla_curve", "from_pilot_batch", "from_pilot_tokens", "from_prior", "loss_at",
           "matched_multipliers", "time_to_target"]
