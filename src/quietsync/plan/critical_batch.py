"""The critical batch at the target loss, and the tokens a batch per step above the baseline's costs, warm-up included.

**The critical batch.** Kaplan et al. (2020, "Scaling Laws for Neural Language Models", eq. 1.4 / 5.3) found
``B_crit(L) = B*/L^(1/α_B)`` tokens with ``B* ≈ 2·10^8`` and ``α_B ≈ 0.21`` — for their models and data (WebText2,
models of 10^5–10^9 non-embedding parameters); the absolute ``B*`` does not carry to another model and data. Where
the plan measured the simple noise scale of the user's model at the end of the baseline's pilot
(:mod:`~quietsync.plan.noise_scale`: ``B_simple`` at held-out loss ``L_p``), that measurement fixes ``B*`` for this
job — ``B* = B_simple · L_p^(1/α_B)`` — and only Kaplan's exponent carries ``B_crit`` from ``L_p`` to the target
(``B_crit(L*) = B_simple·(L_p/L*)^(1/α_B)``). ``B_simple`` approximates the critical batch up to the Hessian's
conditioning (McCandlish et al. 2018, §2.2 and Fig. 4: ``B_crit`` and ``B_simple`` agree within about an order of
magnitude over their tasks, and closely on language models); the interval lets ``B_crit`` be :data:`SPREAD` times
off either way beyond the measurement's own jackknife range.

**Tokens to the target at batch B.** McCandlish et al.'s model: to a given loss a batch ``B`` needs
``S = S_min(1 + B_crit/B)`` steps of the learning rate the run trains with. The baseline (``B0`` tokens per step)
reached the target after ``T0`` tokens, ``S0 = T0/B0`` steps. A run's first ``W`` steps warm the learning rate up
linearly (``(s+1)/W`` at step ``s``, :mod:`quietsync.train.schedule`); to first order a step moves the model in
proportion to its learning rate, so ``s ≤ W`` warm-up steps are worth ``s(s+1)/(2W)`` full steps — the whole
warm-up ``(W+1)/2``: **warm-up steps count half**. So the baseline's effective steps ``E0 = eff(S0)`` give
``S_min = E0/(1 + B_crit/B0)``; a batch ``B`` needs ``eff⁻¹(S_min(1 + B_crit/B))`` steps, and

    k = eff⁻¹(S_min(1 + B_crit/B)) · B / T0

times the baseline's tokens. Without warm-up this is McCandlish's ``(1 + B/B_crit)/(1 + B0/B_crit)``; with it, a
run of few large steps spends a large share of its tokens warming up (the equal-loss job warms up over 50 steps).
The rule assumes the learning rate the run uses at every batch (quietsync does not scale it with the batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KAPLAN_B_STAR = 2e8
"""``B*`` of ``B_crit(L) = B*/L^(1/α_B)`` in tokens (Kaplan et al. 2020, eq. 1.4: B* ≈ 2·10^8)."""
KAPLAN_ALPHA_B = 0.21
"""``α_B`` of the critical batch (Kaplan et al. 2020: α_B ≈ 0.21)."""
SPREAD = 2.0
"""The interval allows ``B_crit`` this many times off either way (of ``B_simple``, of Kaplan's fit): McCandlish et
al. show ``B_simple`` tracking ``B_crit`` within about this on language models, more loosely elsewhere (an
assumption stated in the output)."""


@dataclass(frozen=True)
class CriticalBatch:
    """``B_crit(L) = b_star / L^(1/α_B)`` tokens, with an interval, and where ``b_star`` comes from."""

    b_star: float
    low_star: float
    high_star: float
    source: str
    """``"measured"`` (the noise scale of the baseline's pilot) or ``"kaplan"`` (Kaplan et al.'s fit)."""
    description: str

    def at(self, loss: float) -> tuple[float, float, float]:
        """``(low, value, high)`` of ``B_crit`` at ``loss`` in tokens."""
        scale = loss ** (1 / KAPLAN_ALPHA_B)
        return self.low_star / scale, self.b_star / scale, self.high_star / scale


KAPLAN = CriticalBatch(KAPLAN_B_STAR, KAPLAN_B_STAR / SPREAD, KAPLAN_B_STAR * SPREAD, "kaplan",
                       f"Kaplan et al.'s B_crit(L) = {KAPLAN_B_STAR:.3g}/L^(1/{KAPLAN_ALPHA_B}) tokens [kaplan2020] "
                       f"(assumption: within {SPREAD:g}× for this model and data)")


def measured(b_simple: float, low: float, high: float, loss: float, tokens: float) -> CriticalBatch:
    """The critical batch from ``B_simple`` (with its interval) measured at held-out ``loss`` after ``tokens``."""
    if not (b_simple > 0 and math.isfinite(b_simple)) or not loss > 0:
        raise ValueError(f"a measured critical batch needs B_simple and a loss above 0, got {b_simple} and {loss}")
    scale = loss ** (1 / KAPLAN_ALPHA_B)
    # the jackknife's high end is inf when a leave-one-out estimate was not finite and positive: capped at 10×
    hi = high if math.isfinite(high) else b_simple * 10
    # token_multiplier refuses a B_crit of 0: the low end stays above it
    return CriticalBatch(b_simple * scale, max(low, 1e-9) / SPREAD * scale, hi * SPREAD * scale, "measured",
                         f"B_simple = {b_simple:,.0f} tokens ({low:,.0f}–{high:,.0f}) measured on the baseline's "
                         f"model after {tokens:,.0f} tokens (held-out loss {loss:.3f}) [mccandlish2018], carried "
                         f"by B_crit ∝ L^(−1/{KAPLAN_ALPHA_B}) [kaplan2020] (assumption: B_crit within {SPREAD:g}× "
                         "of B_simple)")


def effective_steps(steps: float, warmup: int) -> float:
    """Full-learning-rate steps ``steps`` steps are worth under a linear warm-up over ``warmup`` steps."""
    if warmup <= 0:
        return steps
    if steps <= warmup:
        return steps * (steps + 1) / (2 * warmup)
    return (warmup + 1) / 2 + steps - warmup


def steps_for(effective: float, warmup: int) -> float:
    """Steps worth ``effective`` full-learning-rate steps (the inverse of :func:`effective_steps`)."""
    if warmup <= 0:
        return effective
    if effective <= (warmup + 1) / 2:
        return (-1 + math.sqrt(1 + 8 * warmup * effective)) / 2  # the positive root of s(s+1)/(2W) = effective
    return effective - (warmup + 1) / 2 + warmup


def token_multiplier(batch: float, baseline_batch: float, b_crit: float, baseline_tokens: float | None = None,
                     warmup: int = 0) -> float:
    """Tokens to the target at ``batch`` tokens per step over the baseline's at ``baseline_batch``, which needed
    ``baseline_tokens`` (None or ``inf``: the warm-up is left out), ``warmup`` steps warming up (module
    docstring)."""
    if batch <= 0 or baseline_batch <= 0 or b_crit <= 0:
        raise ValueError(f"batches and B_crit must be above 0, got {batch}, {baseline_batch} and {b_crit}")
    plain = (1 + batch / b_crit) / (1 + baseline_batch / b_crit)
    if not warmup or baseline_tokens is None or not math.isfinite(baseline_tokens) or baseline_tokens <= 0:
        return plain
    s_min = effective_steps(baseline_tokens / baseline_batch, warmup) / (1 + b_crit / baseline_batch)
    return steps_for(s_min * (1 + b_crit / batch), warmup) * batch / baseline_tokens


__all__ = ["KAPLAN", "KAPLAN_ALPHA_B", "KAPLAN_B_STAR", "SPREAD", "CriticalBatch", "effective_steps", "measured",
           "steps_for", "token_multiplier"]
