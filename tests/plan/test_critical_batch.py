"""The critical-batch rule with the measured noise scale: McCandlish et al.'s token multiplier (an oracle written
from ``E = E_min(1 + B/B_crit)``), warm-up steps counting half, a batch far above the measured ``B_crit`` costing
many times the tokens (and not reaching the target within the run's steps), one below it about none, and which
critical batch a prior used said in its note."""

from __future__ import annotations

import math

import pytest

import quietsync
from quietsync.plan.critical_batch import (
    KAPLAN,
    KAPLAN_ALPHA_B,
    effective_steps,
    measured,
    steps_for,
    token_multiplier,
)
from quietsync.plan.priors import PriorContext, batch_prior


def mccandlish(batch: float, b0: float, b_crit: float) -> float:
    """E(B)/E(B0) with E = E_min(1 + B/B_crit)."""
    return (1 + batch / b_crit) / (1 + b0 / b_crit)


def test_without_warmup_the_multiplier_is_mccandlishs():
    for batch, b_crit in ((4096, 1e4), (1.2e5, 9e3), (2048, 500)):
        assert token_multiplier(batch, 2048, b_crit) == pytest.approx(mccandlish(batch, 2048, b_crit))
        assert token_multiplier(batch, 2048, b_crit, 1.5e6, 0) == pytest.approx(mccandlish(batch, 2048, b_crit))


def test_warmup_steps_count_half():
    # a linear warm-up over W steps, lr (s+1)/W at step s: its steps sum to (W+1)/2 full ones
    w = 50
    assert effective_steps(w, w) == pytest.approx(sum((s + 1) / w for s in range(w)))
    assert effective_steps(10, w) == pytest.approx(sum((s + 1) / w for s in range(10)))
    assert effective_steps(300, w) == pytest.approx((w + 1) / 2 + 250)
    for e in (0.3, 5.0, 25.5, 400.0):
        assert effective_steps(steps_for(e, w), w) == pytest.approx(e)


def test_a_batch_far_above_the_critical_batch_costs_many_times_the_tokens_and_one_below_about_none():
    # 1.5 M baseline tokens at 2,048 per step (732 steps), 50 warm-up steps, B_crit 9,000 tokens at the target
    few_large = token_multiplier(1.2e5, 2048, 9e3, 1.5e6, 50)
    assert few_large > mccandlish(1.2e5, 2048, 9e3) > 10  # the warm-up adds to the plain rule's ×11.6
    # its steps: S_min(1 + B_crit/B) effective ones plus the warm-up's lost (W−1)/2
    s_min = ((50 + 1) / 2 + 732.42 - 50) / (1 + 9e3 / 2048)
    assert few_large * 1.5e6 / 1.2e5 == pytest.approx(s_min * (1 + 9e3 / 1.2e5) + (50 - 1) / 2, rel=1e-3)
    assert token_multiplier(4096, 2048, 1e6, 1.5e6, 50) == pytest.approx(1.0, abs=0.05)


def test_the_measured_critical_batch_is_carried_to_the_target_by_kaplans_exponent():
    cb = measured(3500.0, 3100.0, 3900.0, 4.43, 4e5)
    low, value, high = cb.at(3.6)
    assert value == pytest.approx(3500.0 * (4.43 / 3.6) ** (1 / KAPLAN_ALPHA_B))
    assert low < value < high and cb.source == "measured"
    assert cb.at(4.43)[1] == pytest.approx(3500.0)


def test_the_prior_says_which_critical_batch_it_used():
    ctx = PriorContext(params=10**6, workers=2, nodes=2, baseline_tokens_per_step=2048, target_loss=3.6,
                       warmup_steps=50, baseline_tokens=1.5e6)
    kaplan = batch_prior(1.2e5, ctx)
    mine = batch_prior(1.2e5, PriorContext(**{**ctx.__dict__, "critical": measured(3500.0, 3100.0, 3900.0, 4.43,
                                                                                   4e5)}))
    assert "kaplan: Kaplan et al." in kaplan.notes[0] and "measured: B_simple = 3,500" in mine.notes[0]
    assert kaplan.multiplier[1] < 10 < mine.multiplier[1]
    # Kaplan's B_crit(3.6) ≈ 450 k tokens: without the warm-up 120 k tokens per step cost ×1.26
    no_warmup = batch_prior(1.2e5, PriorContext(**{**ctx.__dict__, "warmup_steps": 0}))
    kaplan_3_6 = 2e8 / 3.6 ** (1 / KAPLAN_ALPHA_B)
    assert no_warmup.multiplier[1] == pytest.approx(mccandlish(1.2e5, 2048, kaplan_3_6))
    assert "warm-up" not in no_warmup.notes[0]
    assert mine.multiplier[0] < mine.multiplier[1] < mine.multiplier[2]
    assert ctx.critical is KAPLAN


def test_a_batch_far_above_the_critical_batch_is_not_predicted_to_reach_within_the_runs_steps():
    import dataclasses

    from quietsync.plan.loss_model import PowerLaw

    result = quietsync.plan.plan(what_if=True, model="tiny", nodes=2, workers_per_node=1, seq_len=128,
                                 micro_batch_size=8, link=["inter=10mbit,5ms"], only=True, target_loss=5.0,
                                 strategies=["zero1", "acco"])
    obj = result.objective
    # 3.6 lies below the Chinchilla floor for this model (a what-if plan refuses it): a fitted curve that reaches it
    base = dataclasses.replace(obj.baseline, law=PowerLaw(2.3, 201.0, 0.355))  # reaches 3.6 after ~1.5 M tokens
    mine = dataclasses.replace(obj, baseline=base, max_steps=60, target=3.6, priors=dataclasses.replace(
        obj.priors, target_loss=3.6, warmup_steps=50, critical=measured(3500.0, 3100.0, 3900.0, 4.43, 4e5)))
    acco = next(r for r in result.rows if r.spec == "acco")
    big = dataclasses.replace(acco, tokens_per_step=1.2e5)
    scored = mine.score(big)
    assert scored.estimate.multiplier.value > 10 and not scored.reaches
    assert any("more than the run's --max-steps 60" in n for n in scored.estimate.notes)
    # without the step limit it reaches the target, after ×10 the baseline's tokens or more
    unlimited = dataclasses.replace(mine, max_steps=None).score(big)
    assert unlimited.reaches and math.isfinite(unlimited.time.seconds.value)


@pytest.mark.parametrize("call, words", [
    (lambda: token_multiplier(0, 2048, 1e4), "batches and B_crit must be above 0"),
    (lambda: measured(0.0, 0.0, 0.0, 4.4, 1e5), "needs B_simple and a loss above 0"),
])
def test_bad_input_is_one_line(call, words):
    with pytest.raises(ValueError, match=words) as e:
        call()
    assert "\n" not in str(e.value)
