"""What the papers say a setting costs in loss per token: the planner's priors where no pilot has run.

A prior has two parts, both relative to the synchronous baseline (DDP/ZeRO-1/FSDP, which follow one trajectory):

* a **loss penalty** ``δ`` at equal tokens — the setting's held-out loss is ``(1 + δ)`` times the baseline's after
  the same tokens — with an interval, from the published comparisons below;
* a **token multiplier** ``k`` for what changes the tokens a step holds or how stale a step is: a larger batch
  per step costs tokens by the critical-batch rule of McCandlish et al. (2018), ``E = E_min(1 + B/B_crit)``,
  with ``B_crit(L) = B*/L^(1/α_B)`` from Kaplan et al. (2020); DPU's one-step-stale update by Nabli et al.

:mod:`~quietsync.plan.loss_model` turns ``δ`` into tokens with the baseline's loss curve. The priors are declared
by each strategy beside its code (``PlanFacts.prior`` of its :class:`~quietsync.strategies.declaration.Declaration`:
the papers' numbers, each quoted from its source and cited in the plan's output; where a paper gives a knob's
effect only in a figure, the prior says so and widens its interval instead of inventing a number); this module
adds the batch rule every setting pays and asks the registry for the rest. They were measured on
C4/Dolma-scale runs of 35M–10B parameters: on a small model, a short run or other data they are directions, and
a pilot (:mod:`~quietsync.plan.pilots`) replaces them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..strategies.declaration import EXACT, Prior, multiplier
from ..strategies.registry import available, declaration
from .critical_batch import KAPLAN, KAPLAN_ALPHA_B, KAPLAN_B_STAR, CriticalBatch, token_multiplier

SOURCES: dict[str, str] = {
    "mccandlish2018": "McCandlish et al. 2018, \"An Empirical Model of Large-Batch Training\" (arXiv:1812.06162)",
    "kaplan2020": "Kaplan et al. 2020, \"Scaling Laws for Neural Language Models\" (arXiv:2001.08361), eq. 1.4",
    "hoffmann2022": "Hoffmann et al. 2022, \"Training Compute-Optimal Large Language Models\" (arXiv:2203.15556), "
                    "approach 3",
}
"""The planner's own sources (the batch rule's); each strategy declares its own (:func:`sources`)."""


def sources() -> dict[str, str]:
    """Every source a prior may cite: the planner's and those the registered strategies declare."""
    out = dict(SOURCES)
    for name in available():
        out.update(declaration(name).plan.sources)
    return out


@dataclass(frozen=True)
class PriorContext:
    """What the priors depend on besides the setting."""

    params: int
    """Model parameters N."""
    workers: int
    nodes: int
    baseline_tokens_per_step: float
    """Tokens per committed step of the synchronous baseline (the batch the loss curve was measured at)."""
    target_loss: float | None = None
    """The loss the critical batch is evaluated at (its ``B_crit(L)``); none: the batch rule is left out."""
    critical: CriticalBatch = KAPLAN
    """``B_crit(L)``: measured from the baseline's pilot (its noise scale) where it ran, else Kaplan et al.'s."""
    warmup_steps: int = 0
    """Linear warm-up steps of the planned run (a few large steps spend a large share of their tokens warming up)."""
    baseline_tokens: float | None = None
    """The baseline's tokens to the target (what the warm-up is weighed against; None: the warm-up is left out)."""


def critical_batch(loss: float) -> float:
    """``B_crit(L) = B*/L^(1/α_B)`` tokens (Kaplan et al. 2020)."""
    return KAPLAN_B_STAR / loss ** (1 / KAPLAN_ALPHA_B)


def batch_prior(tokens_per_step: float, ctx: PriorContext) -> Prior:
    """The critical-batch cost of a batch per step above the baseline's (McCandlish et al. 2018; ``B_crit`` at the
    target loss measured from the baseline's pilot, else Kaplan et al.'s; the run's warm-up counted:
    :mod:`~quietsync.plan.critical_batch`)."""
    b0 = ctx.baseline_tokens_per_step
    # the baseline's batch (up to rounding) costs nothing extra
    if ctx.target_loss is None or tokens_per_step <= b0 * (1 + 1e-9):
        return Prior()
    lo_bc, bc, hi_bc = ctx.critical.at(ctx.target_loss)

    def k_at(b_crit: float) -> float:
        return token_multiplier(tokens_per_step, b0, b_crit, ctx.baseline_tokens, ctx.warmup_steps)

    k, lo, hi = k_at(bc), k_at(hi_bc), k_at(lo_bc)  # a larger B_crit costs fewer tokens: the ends swap
    warm = (f", {ctx.warmup_steps} warm-up steps counted half" if ctx.warmup_steps and ctx.baseline_tokens
            and math.isfinite(ctx.baseline_tokens) else "")
    note = (f"batch per step {tokens_per_step:,.0f} tokens vs the baseline's {b0:,.0f}: ×{k:.3g} tokens "
            f"(×{lo:.3g}–×{hi:.3g}) by the critical-batch rule, B_crit({ctx.target_loss:g}) = {bc:,.0f} tokens "
            f"({ctx.critical.source}: {ctx.critical.description}){warm} [mccandlish2018]")
    return multiplier(lo, k, hi, note, "mccandlish2018", "kaplan2020")


def prior_for(name: str, cfg: Any, ctx: PriorContext, tokens_per_step: float) -> Prior:
    """The prior of strategy ``name`` with config ``cfg`` whose steps hold ``tokens_per_step`` tokens (all
    workers) on average: what the strategy declares (``PlanFacts.prior``), and the batch rule."""
    batch = batch_prior(tokens_per_step, ctx)
    declared = declaration(name).plan.prior
    if declared is None:
        return undeclared_prior(name)
    base = declared(cfg, ctx)
    # an exact setting stays exact unless its batch differs from the baseline's
    return base.combine(batch) if batch.notes or not base.exact else base


def undeclared_prior(name: str) -> Prior:
    """The prior of a strategy that declares none."""
    return Prior(penalty=(0.0, 0.05, 0.5), notes=(f"{name}: no published comparison (assumption: +5%, up to +50%)",))


__all__ = ["EXACT", "SOURCES", "Prior", "PriorContext", "batch_prior", "critical_batch", "prior_for", "sources"]
