"""The loss-curve fit ``L(t) = a + b·t^(−c)``: synthetic curves with known parameters are recovered, their tokens to a
target extrapolated within tolerance and inside the stated interval, a target below the floor is reported as not
reached, and bad input is refused."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quietsync.plan.curve_fit import PowerLaw, fit_power_law


def _curve(a: float, b: float, c: float, tokens: np.ndarray, noise: float, seed: int) -> np.ndarray:
    """The law written out (not the library's PowerLaw), plus Gaussian noise."""
    return a + b * tokens ** (-c) + np.random.default_rng(seed).normal(0.0, noise, len(tokens))


@pytest.mark.parametrize("a,b,c", [(3.0, 60.0, 0.35), (4.2, 900.0, 0.6), (1.5, 12.0, 0.2)])
def test_known_parameters_are_recovered_and_the_extrapolation_is_inside_the_interval(a, b, c):
    tokens = np.linspace(2e4, 4e5, 40)
    fit = fit_power_law(tokens, _curve(a, b, c, tokens, 0.005, seed=1))
    assert fit.law.a == pytest.approx(a, abs=0.08 * a)
    assert fit.law.c == pytest.approx(c, rel=0.2)
    assert fit.rms < 0.01
    # a target the data never saw: three times past the last evaluation
    far = 3 * tokens[-1]
    target = a + b * far ** (-c)
    reach = fit.tokens_to(target)
    assert reach.reachable and reach.reached_fraction > 0.9
    assert reach.tokens.value == pytest.approx(far, rel=0.15)
    assert reach.tokens.low <= far <= reach.tokens.high


def test_noiseless_curve_is_recovered_exactly():
    tokens = np.geomspace(1e3, 1e6, 30)
    fit = fit_power_law(tokens, 2.0 + 40.0 * tokens ** -0.5, bootstrap=0)
    assert (fit.law.a, fit.law.b, fit.law.c) == pytest.approx((2.0, 40.0, 0.5), rel=1e-3)
    assert fit.tokens_to(2.0 + 40.0 * 1e7 ** -0.5).tokens.value == pytest.approx(1e7, rel=1e-2)


def test_a_target_below_the_fitted_floor_is_not_reached():
    tokens = np.linspace(1e4, 3e5, 30)
    fit = fit_power_law(tokens, _curve(5.0, 80.0, 0.5, tokens, 0.003, seed=2))
    reach = fit.tokens_to(4.0)
    assert not reach.reachable and math.isinf(reach.tokens.value) and reach.reached_fraction < 0.5
    assert PowerLaw(5.0, 80.0, 0.5).tokens_to(5.0) == math.inf


@pytest.mark.parametrize("tokens,losses,says", [
    ([1, 2, 3], [5, 4, 3], "at least 4 evaluations"),
    ([1, 2, 3, 4], [5, 4, 3], "two sequences of one length"),
    ([1, 3, 2, 4], [5, 4, 3, 2], "must increase"),
])
def test_bad_curves_are_refused(tokens, losses, says):
    with pytest.raises(ValueError, match=says):
        fit_power_law(tokens, losses)


def _least_squares_by_search(tokens: np.ndarray, losses: np.ndarray) -> float:
    """The smallest sum of squared residuals of ``a + b·t^(−c)`` (``b ≥ 0``, ``0 ≤ a ≤ min(losses)``) by exhaustive
    search: 1,000 exponents, and for each the best ``b`` in closed form at each of 400 floors."""
    best = math.inf
    floors = np.linspace(0.0, losses.min(), 400)
    for c in np.exp(np.linspace(math.log(0.02), math.log(4.0), 1_000)):
        x = tokens ** (-c)
        b = np.maximum(((losses[:, None] - floors) * x[:, None]).sum(0) / (x * x).sum(), 0.0)
        best = min(best, float((((losses[:, None] - floors - b * x[:, None]) ** 2).sum(0)).min()))
    return best


def test_the_bootstrap_refits_each_reach_the_least_squares_of_their_own_curve():
    """The refits are fitted side by side (one exponent grid, golden-section searches stepped together): each is
    still the least-squares fit of its own resampled curve -- no worse than an exhaustive search finds."""
    from quietsync.plan import curve_fit

    tokens = np.linspace(2e4, 4e5, 16)
    curves = np.stack([_curve(3.0, 60.0, 0.35, tokens, noise, seed) for noise, seed in
                       ((0.005, 1), (0.05, 2), (0.2, 3), (0.001, 4))], axis=1)
    laws, sse = curve_fit._best(tokens, curves)
    for k, law in enumerate(laws):
        y = curves[:, k]
        mine = float(((y - (law.a + law.b * tokens ** (-law.c))) ** 2).sum())
        assert mine == pytest.approx(float(sse[k]), rel=1e-9)
        assert 0.0 <= law.a <= y.min() and law.b >= 0.0
        assert mine <= _least_squares_by_search(tokens, y) * (1 + 1e-3) + 1e-12, k
