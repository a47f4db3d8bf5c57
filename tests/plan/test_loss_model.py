"""The loss model: a candidate's curve is the baseline's transformed by its prior, ``(1+δ)·L_b(t/k)``; its tokens to
the target follow from the inverse (checked against a hand inversion), a penalty that lifts the target to the
baseline's floor is reported as not reached, and time to target is tokens over tokens/s with the speed's error. A
pilot gives its tokens over the baseline's to the same loss (a candidate built as the baseline stretched by k in
tokens recovers k; the closed-form inverse is the reference)."""

from __future__ import annotations

import math

import pytest

from quietsync.plan.curve_fit import PowerLaw
from quietsync.plan.loss_model import (
    K_DRIFT,
    K_MARGIN,
    BaselineCurve,
    chinchilla_curve,
    from_pilot_tokens,
    from_prior,
    loss_at,
    time_to_target,
)
from quietsync.plan.priors import Prior

BASE = BaselineCurve(PowerLaw(4.0, 200.0, 0.4), "pilot", "test")


def _inverse(target: float) -> float:  # tokens where 4 + 200 t^-0.4 = target, by hand
    return (200.0 / (target - 4.0)) ** (1 / 0.4)


def test_prior_tokens_are_the_transformed_baseline_inverse():
    p = Prior(penalty=(0.0, 0.02, 0.04), multiplier=(1.0, 1.5, 2.0))
    e = from_prior(p, BASE, 5.0)
    assert e.source == "prior" and e.reachable
    assert e.tokens.value == pytest.approx(1.5 * _inverse(5.0 / 1.02))
    assert e.tokens.low == pytest.approx(_inverse(5.0))
    assert e.tokens.high == pytest.approx(2.0 * _inverse(5.0 / 1.04))
    assert e.multiplier.value == pytest.approx(e.tokens.value / _inverse(5.0))
    assert loss_at(e, BASE, e.tokens.value).value == pytest.approx(5.0)


def test_a_penalty_that_lifts_the_target_to_the_floor_is_not_reached():
    e = from_prior(Prior(penalty=(0.2, 0.3, 0.4)), BASE, 5.0)  # 5/1.3 < 4: below the baseline's floor
    assert not e.reachable and not e.certain and math.isinf(e.multiplier.value)
    uncertain = from_prior(Prior(penalty=(0.0, 0.1, 0.3)), BASE, 5.0)  # reached, but not at the interval's high end
    assert uncertain.reachable and not uncertain.certain
    assert not time_to_target(e, 1000.0).reachable


def test_exact_and_time_interval():
    e = from_prior(Prior(exact=True), BASE, 5.0)
    assert e.source == "exact" and e.multiplier.value == 1.0
    t = time_to_target(e, 1000.0, speed_error=0.1)
    assert t.seconds.value == pytest.approx(_inverse(5.0) / 1000.0)
    assert t.seconds.low == pytest.approx(_inverse(5.0) / 1100.0)
    assert t.seconds.high == pytest.approx(_inverse(5.0) / 900.0)


def test_chinchilla_curve_is_hoffmanns_law():
    n, d = 1e9, 2e10
    assert float(chinchilla_curve(n).loss(d)) == pytest.approx(1.69 + 406.4 / n ** 0.34 + 410.7 / d ** 0.28)


def test_with_a_vocabulary_the_law_starts_at_a_uniform_guess_and_is_unchanged_where_it_was_fitted():
    for n, vocab in ((953_088, 4096), (467_200, 300), (1e9, 50257)):
        law = chinchilla_curve(n, vocab)
        assert float(law.loss(0)) == pytest.approx(math.log(vocab))  # an untrained model's loss
        assert law.a < float(law.loss(20 * n)) < math.log(vocab)
        target = (law.a + math.log(vocab)) / 2
        assert float(law.loss(law.tokens_to(target))) == pytest.approx(target)
    # at a size it was fitted on, in its own vocabulary or a larger one, it is Hoffmann's law (~1e6 tokens earlier)
    n, d = 1e9, 2e10
    for vocab in (32000, 50257):
        assert chinchilla_curve(n, vocab).a == chinchilla_curve(n).a
        assert float(chinchilla_curve(n, vocab).loss(d)) == pytest.approx(float(chinchilla_curve(n).loss(d)), rel=1e-4)
    # a target at or above where it starts is reached at once: one token, not 0 (tokens are divided by)
    assert chinchilla_curve(953_088, 4096).tokens_to(9.0) == 1.0


def _pilot(k: float, end: float, n: int = 16) -> tuple[list[float], list[float]]:
    """A candidate's pilot that needs ``k`` times the baseline's tokens for every loss: 4 + 200·(t/k)^-0.4."""
    ts = [end * (i + 1) / n for i in range(n)]
    return ts, [4.0 + 200.0 * (t / k) ** -0.4 for t in ts]


def test_a_pilot_gives_its_tokens_over_the_baselines_to_the_same_loss():
    # the baseline's own pilot measured to 20k tokens (the law's values), its law past them
    measured = tuple((t, 4.0 + 200.0 * t ** -0.4) for t in (2_500.0 * (i + 1) for i in range(8)))
    base = BaselineCurve(PowerLaw(4.0, 200.0, 0.4), "pilot", "test", measured=measured)
    ts, ys = _pilot(1.6, 20_000.0)
    e = from_pilot_tokens(ts, ys, base, 5.0, [])
    assert e.source == "pilot" and e.reachable
    assert e.multiplier.value == pytest.approx(1.6, rel=0.02)  # linear between evaluations: nearly exact
    assert e.tokens.value == pytest.approx(1.6 * _inverse(5.0), rel=0.02)
    # the target lies log2(1.6·inverse(5)/20k) doublings past the pilot: the interval widens by K_DRIFT each
    doublings = math.log2(1.6 * _inverse(5.0) / 20_000.0)
    assert e.multiplier.high == pytest.approx(1.6 * (1 + K_MARGIN) * (1 + K_DRIFT * doublings), rel=0.03)
    assert e.multiplier.low == pytest.approx(1.6 * (1 - K_MARGIN) / (1 + K_DRIFT * doublings), rel=0.03)
    # the prediction is the candidate's own curve at the target, by hand: 4 + 200·(t/1.6)^-0.4 = 5
    assert e.tokens.value == pytest.approx(1.6 * (200.0 / 1.0) ** (1 / 0.4), rel=0.02)


def test_a_pilot_ahead_of_the_baseline_needs_fewer_tokens_and_one_that_reached_is_its_own_measurement():
    ts, ys = _pilot(0.8, 20_000.0)
    assert from_pilot_tokens(ts, ys, BASE, 5.0, []).multiplier.value == pytest.approx(0.8, rel=1e-6)
    e = from_pilot_tokens(ts, ys, BASE, 5.0, [], reached=12_345.0)
    assert e.tokens.value == e.tokens.low == e.tokens.high == 12_345.0


def test_a_pilot_with_no_evaluation_past_its_first_step_is_refused():
    with pytest.raises(ValueError, match="evaluations after its first step"):
        from_pilot_tokens([0.0], [9.0], BASE, 5.0, [])
