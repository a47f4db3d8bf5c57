"""The loss model: a candidate's curve is the baseline's transformed by its prior, ``(1+δ)·L_b(t/k)``; its tokens to
the target follow from the inverse (checked against a hand inversion), a penalty that lifts the target to the
baseline's floor is reported as not reached, and time to target is tokens over tokens/s with the speed's error."""

from __future__ import annotations

import math

import pytest

from quietsync.plan.curve_fit import PowerLaw
from quietsync.plan.loss_model import BaselineCurve, chinchilla_curve, from_prior, loss_at, time_to_target
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
