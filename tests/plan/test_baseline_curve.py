"""The baseline's loss curve from its pilot: the power law is fitted to the evaluations after the learning-rate
warm-up, where the loss follows the constant-rate law the plan extrapolates — evaluations taken while the rate ramps
up sit above that law and, fitted with the rest, pull the tokens to a low target short."""

from __future__ import annotations

from quietsync.plan.curve_fit import PowerLaw
from quietsync.plan.pilot_plan import MIN_FIT_EVALS, baseline_curve
from quietsync.plan.pilots import PilotCurve

LAW = PowerLaw(2.3, 150.0, 0.35)
"""The curve after the warm-up (tokens of both workers)."""
WARMUP = 50
TOKENS_PER_STEP = 2048
TARGET = 3.5


def pilot(last_step: int = 196, every: int = 12) -> PilotCurve:
    """A baseline pilot whose evaluations during the warm-up lie above the law by up to 1.2 nats (as a
    ramping learning rate leaves them), on the law exactly after it."""
    curve = PilotCurve("zero1")
    for step in range(every, last_step + 1, every):
        t = step * TOKENS_PER_STEP
        curve.steps.append(step)
        curve.tokens.append(t)
        curve.losses.append(float(LAW.loss(t)) + 1.2 * max(0.0, 1 - step / WARMUP) ** 1.5)
    return curve


def test_the_law_past_the_pilot_is_recovered_from_the_evaluations_after_the_warmup():
    curve = pilot()
    truth = LAW.tokens_to(TARGET)
    assert truth > 2 * curve.tokens[-1]  # an extrapolation, not an interpolation
    base = baseline_curve(curve, WARMUP)
    assert abs(base.law.c - LAW.c) < 0.01 and abs(base.law.a - LAW.a) < 0.02
    tokens = base.tokens_to(TARGET)
    assert abs(tokens.value / truth - 1) < 0.02
    assert tokens.low <= truth <= tokens.high
    assert f"fitted to the {sum(1 for s in curve.steps if s > WARMUP)} after the {WARMUP}-step warm-up" \
        in base.description
    # the measured points stay the measured curve, the warm-up's included
    assert [t for t, _ in base.measured] == curve.tokens


def test_fitted_with_the_warmup_the_same_pilot_falls_short():
    """What the warm-up's evaluations do to the fit (the reason they are left out)."""
    short = baseline_curve(pilot(), 0).tokens_to(TARGET).value / LAW.tokens_to(TARGET)
    assert short < 0.9


def test_too_few_evaluations_after_the_warmup_fit_them_all_and_say_so():
    curve = pilot(last_step=84)  # evaluations at 12, …, 84: three after a 50-step warm-up
    assert sum(1 for s in curve.steps if s > WARMUP) < MIN_FIT_EVALS
    base = baseline_curve(curve, WARMUP)
    assert len(base.fit.tokens) == len(curve.tokens)
    assert f"fitted to all: fewer than {MIN_FIT_EVALS} after the {WARMUP}-step warm-up" in base.description
