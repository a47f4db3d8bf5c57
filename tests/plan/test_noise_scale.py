"""The gradient noise scale (McCandlish et al. 2018, Appendix A) recovered on least squares with Gaussian inputs and
noise, where the true gradient and the per-example covariance are known in closed form; the replayed pilot; bad
input one line."""

from __future__ import annotations

import math

import pytest
import torch

from quietsync.plan.noise_scale import estimate, measure, measure_pilot, unbiased

D, SIGMA = 20, 1.0


def oracle(delta: torch.Tensor) -> tuple[float, float]:
    """``(|G|², tr Σ)`` of ℓ = ½(xᵀw − y)², y = xᵀw* + ε, x ~ N(0, I_d), ε ~ N(0, σ²), at w = w* + Δ: the
    per-example gradient g = x xᵀΔ − xε has mean G = Δ and E[g gᵀ] = |Δ|²I + 2ΔΔᵀ + σ²I (Gaussian fourth moment),
    so Σ = |Δ|²I + ΔΔᵀ + σ²I and tr Σ = (d + 1)|Δ|² + dσ²."""
    d2 = float(delta @ delta)
    return d2, (D + 1) * d2 + D * SIGMA ** 2


def test_noise_scale_of_least_squares_matches_the_closed_form():
    g = torch.Generator().manual_seed(0)
    w_star = torch.randn(D, generator=g, dtype=torch.float64)
    delta = torch.randn(D, generator=g, dtype=torch.float64)
    delta = delta / delta.norm()  # |G|² = 1
    model = torch.nn.Linear(D, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    per = 8  # examples per micro-batch: B_small = 8, B_big = 8·8

    def batches():
        while True:
            x = torch.randn(per, D, generator=g, dtype=torch.float64)
            yield x, x @ w_star + SIGMA * torch.randn(per, generator=g, dtype=torch.float64)

    def loss_of(batch):
        x, y = batch
        return 0.5 * ((model(x)[:, 0] - y) ** 2).mean()

    ns = measure(loss_of, model, batches(), per, micro_batches=8, repeats=300)
    g2, tr = oracle(delta)
    assert ns.b_small == per and ns.b_big == 64 and ns.repeats == 300
    assert ns.grad_sq == pytest.approx(g2, rel=0.1)
    assert ns.trace == pytest.approx(tr, rel=0.05)
    assert ns.b_simple == pytest.approx(tr / g2, rel=0.1)  # 41 examples
    assert ns.low < tr / g2 < ns.high


def test_the_ratio_of_means_not_the_mean_of_ratios():
    # B_small 1, B_big 2: |G|² = 2·|g_big|² − |g_small|², tr Σ = 2·(|g_small|² − |g_big|²). Repeat 1 alone gives
    # 2/1 = 2, repeat 2 alone 5/2 = 2.5; averaged first (5 and 3.25) the quantities give 3.5/1.5
    small, big = [[3.0], [7.0]], [2.0, 4.5]
    assert unbiased([3.0, 7.0], big, 1, 2) == (pytest.approx(1.5), pytest.approx(3.5))
    assert estimate(small, big, 1, 2).b_simple == pytest.approx(3.5 / 1.5)


def test_noise_dominating_the_measured_gradient_is_an_infinite_noise_scale():
    # |g_big|² no smaller than B_small/B_big of |g_small|²: the estimated |G|² is not above zero
    assert math.isinf(estimate([[1.0, 1.0]], [0.4], 1, 2).b_simple)


@pytest.mark.parametrize("call, words", [
    (lambda: unbiased([1.0], [0.5], 4, 2), "b_small must be above 0 and below b_big"),
    (lambda: unbiased([], [0.5], 1, 2), "needs squared gradient norms"),
    (lambda: estimate([[1.0]], [0.5, 0.4], 1, 2), "one big-batch norm per repeat"),
])
def test_bad_input_is_one_line(call, words):
    with pytest.raises(ValueError, match=words) as e:
        call()
    assert "\n" not in str(e.value)


def test_a_pilot_without_an_exported_model_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="needs the pilot's exported model") as e:
        measure_pilot(tmp_path / "model", object())
    assert "\n" not in str(e.value)
