"""What the papers say a setting costs in loss per token: the planner's priors where no pilot has run.

A prior has two parts, both relative to the synchronous baseline (DDP/ZeRO-1/FSDP, which follow one trajectory):

* a **loss penalty** ``δ`` at equal tokens — the setting's held-out loss is ``(1 + δ)`` times the baseline's after
  the same tokens — with an interval, from the published comparisons below;
* a **token multiplier** ``k`` for what changes the tokens a step holds or how stale a step is: a larger batch
  per step costs tokens by the critical-batch rule of McCandlish et al. (2018), ``E = E_min(1 + B/B_crit)``,
  with ``B_crit(L) = B*/L^(1/α_B)`` from Kaplan et al. (2020); DPU's one-step-stale update by Nabli et al.

:mod:`~quietsync.plan.loss_model` turns ``δ`` into tokens with the baseline's loss curve. Every number below is
quoted from its source (:data:`SOURCES`, cited in the plan's output); where a paper gives a knob's effect only in
a figure, the prior says so and widens its interval instead of inventing a number. They were measured on
C4/Dolma-scale runs of 35M–10B parameters: on a small model, a short run or other data they are directions, and
a pilot (:mod:`~quietsync.plan.pilots`) replaces them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .critical_batch import KAPLAN, KAPLAN_ALPHA_B, KAPLAN_B_STAR, CriticalBatch, token_multiplier

SOURCES: dict[str, str] = {
    "charles2025": "Charles et al. 2025, \"Scaling Laws for DiLoCo\" (arXiv:2503.09799), Table 8 and §5",
    "douillard2025": "Douillard et al. 2025, \"Streaming DiLoCo with overlapping communication\" (arXiv:2501.18512), "
                     "Table 1 and §2.4",
    "kale2025": "Kale, Douillard, Donchev 2025, \"Eager Updates For Overlapped Communication and Computation in "
                "DiLoCo\" (arXiv:2502.12996), Table 2",
    "sarfi2025": "Sarfi et al. 2025, \"Communication Efficient LLM Pre-training with SparseLoCo\" "
                 "(arXiv:2508.15706), abstract",
    "peng2024": "Peng et al., \"DeMo: Decoupled Momentum Optimization\" (arXiv:2411.19870), abstract",
    "from2025": "From et al. 2025, \"FlexDeMo / DeToNATION\" (arXiv:2502.06728), §4 (shared/papers/001)",
    "nabli2025": "Nabli et al., \"ACCO: Accumulate While You Communicate\" (shared/papers/003), §4.3",
    "fournier2024": "Fournier & Oyallon, \"Cyclic Data Parallelism\" (shared/papers/002), Table 2",
    "mccandlish2018": "McCandlish et al. 2018, \"An Empirical Model of Large-Batch Training\" (arXiv:1812.06162)",
    "kaplan2020": "Kaplan et al. 2020, \"Scaling Laws for Neural Language Models\" (arXiv:2001.08361), eq. 1.4",
    "hoffmann2022": "Hoffmann et al. 2022, \"Training Compute-Optimal Large Language Models\" (arXiv:2203.15556), "
                    "approach 3",
    "vogels2019": "Vogels et al. 2019, \"PowerSGD\" (arXiv:1905.13727)",
}
"""Where each prior comes from (keys used in :attr:`Prior.notes`)."""

# Charles et al. 2025, Table 8: L(N) ≈ A·N^α at H = 30, the best hyper-parameters per N, Chinchilla-optimal tokens
DILOCO_LOSS_FITS = {0: (18.129, -0.0953), 1: (18.363, -0.0961), 2: (18.768, -0.0969), 4: (19.762, -0.0992),
                    8: (21.051, -0.1018)}
"""Replicas M (0: Data-Parallel) → (A, α) of ``L(N) ≈ A·N^α`` (Charles et al. 2025, Table 8, H = 30)."""
DILOCO_JOINT_BETA = 0.0116
"""``L(N, M) ≈ A·N^α·M^β``: β of the joint fit (Charles et al. 2025, Table 11), used past M = 8."""
DILOCO_FIT_RESIDUAL = 0.012
"""Average |log L − log L̂| of the fits at the held-out N = 2.4B (Charles et al. 2025, Table 5): the interval's
half-width on δ."""
DILOCO_FIT_RANGE = (35e6, 2.4e9)
"""Model sizes the DiLoCo fits were made on (35M–2.4B)."""
DILOCO_H = 30
"""Synchronization cadence of the DiLoCo fits."""
H_WIDENING = 0.005
"""Interval widening of δ per doubling of H away from 30 (an assumption: Charles et al. §5 and Fig. 15 show the
loss growing with H, less for larger models, but give no numbers)."""
DELAYED_OUTER_STEP = 3.01 / 2.67 - 1
"""Kale et al. 2025, Table 2: a whole outer step of delay (naive), eval loss 3.01 against 2.67 without overlap;
1 inner step of overlap: 2.67 (no loss)."""
DEMO_COMPRESSION = 1 / 85
"""DeMo: comparable loss to AdamW-DDP while sending up to 85× less data per GPU (Peng et al., abstract)."""
SPARSELOCO_DENSITY = (0.01, 0.03)
"""SparseLoCo outperforms full-precision DiLoCo at 1–3% density with 2-bit values (Sarfi et al. 2025)."""
DPU_MULTIPLIER = (2.0, 4.0)
"""DPU without warm-up: "if we train for twice as long, the DPU training curve approaches the baseline one, without
totally catching it" (Nabli et al., §4.3): more than 2× the tokens; 4× is this prior's assumed upper end."""


@dataclass(frozen=True)
class Prior:
    """A setting's loss per token against the synchronous baseline's, as the papers give it."""

    penalty: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """``δ`` (low, value, high): held-out loss at equal tokens is ``(1 + δ)`` times the baseline's."""
    multiplier: tuple[float, float, float] = (1.0, 1.0, 1.0)
    """``k`` (low, value, high): tokens to any loss are ``k`` times what they would be otherwise."""
    exact: bool = False
    """The baseline's own trajectory (DDP, ZeRO-1, FSDP: equal up to float rounding, tested)."""
    notes: tuple[str, ...] = ()
    """What the prior rests on: claims with their source key (:data:`SOURCES`) and the assumptions made."""
    sources: tuple[str, ...] = field(default=())

    def combine(self, other: Prior) -> Prior:
        """Both effects at once (penalties add, multipliers multiply)."""
        p = tuple(a + b for a, b in zip(self.penalty, other.penalty))
        m = tuple(a * b for a, b in zip(self.multiplier, other.multiplier))
        return Prior(p, m, self.exact and other.exact, self.notes + other.notes,  # type: ignore[arg-type]
                     tuple(dict.fromkeys(self.sources + other.sources)))


EXACT = Prior(exact=True, notes=("the synchronous baseline's own trajectory",))


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


def _penalty(low: float, value: float, high: float, note: str, *sources: str) -> Prior:
    return Prior(penalty=(low, value, high), notes=(note,), sources=sources)


def _multiplier(low: float, value: float, high: float, note: str, *sources: str) -> Prior:
    return Prior(multiplier=(low, value, high), notes=(note,), sources=sources)


def diloco_replica_penalty(params: float, replicas: int) -> float:
    """``δ`` of DiLoCo with ``replicas`` at H = 30 over Data-Parallel, by Charles et al.'s Table 8 fits (log-linear in
    M between the fitted 1, 2, 4, 8; the joint fit's ``M^β`` past 8)."""
    def at(m: int) -> float:
        a, alpha = DILOCO_LOSS_FITS[m]
        a0, alpha0 = DILOCO_LOSS_FITS[0]
        return a * params ** alpha / (a0 * params ** alpha0) - 1.0

    m = max(1, replicas)
    if m in DILOCO_LOSS_FITS:
        return at(m)
    if m > 8:
        return (1 + at(8)) * (m / 8) ** DILOCO_JOINT_BETA - 1
    lo = 2 ** math.floor(math.log2(m))
    hi = lo * 2
    w = (math.log2(m) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return at(lo) * (1 - w) + at(hi) * w


def critical_batch(loss: float) -> float:
    """``B_crit(L) = B*/L^(1/α_B)`` tokens (Kaplan et al. 2020)."""
    return KAPLAN_B_STAR / loss ** (1 / KAPLAN_ALPHA_B)


def batch_prior(tokens_per_step: float, ctx: PriorContext) -> Prior:
    """The critical-batch cost of a batch per step above the baseline's (McCandlish et al. 2018; ``B_crit`` at the
    target loss measured from the baseline's pilot, else Kaplan et al.'s; the run's warm-up counted:
    :mod:`~quietsync.plan.critical_batch`)."""
    b0 = ctx.baseline_tokens_per_step
    if ctx.target_loss is None or tokens_per_step <= b0 * (1 + 1e-9):
        return Prior()
    lo_bc, bc, hi_bc = ctx.critical.at(ctx.target_loss)

    def k_at(b_crit: float) -> float:
        return token_multiplier(tokens_per_step, b0, b_crit, ctx.baseline_tokens, ctx.warmup_steps)

    k, lo, hi = k_at(bc), k_at(hi_bc), k_at(lo_bc)
    warm = (f", {ctx.warmup_steps} warm-up steps counted half" if ctx.warmup_steps and ctx.baseline_tokens
            and math.isfinite(ctx.baseline_tokens) else "")
    note = (f"batch per step {tokens_per_step:,.0f} tokens vs the baseline's {b0:,.0f}: ×{k:.3g} tokens "
            f"(×{lo:.3g}–×{hi:.3g}) by the critical-batch rule, B_crit({ctx.target_loss:g}) = {bc:,.0f} tokens "
            f"({ctx.critical.source}: {ctx.critical.description}){warm} [mccandlish2018]")
    return _multiplier(lo, k, hi, note, "mccandlish2018", "kaplan2020")


def _diloco_like(cfg: Any, ctx: PriorContext, replicas: int, name: str) -> Prior:
    """DiLoCo's replicas and H (Charles et al.), Streaming DiLoCo's overlap and quantization, SparseLoCo."""
    n = ctx.params
    delta = diloco_replica_penalty(n, replicas)
    half = DILOCO_FIT_RESIDUAL
    h = cfg.sync_every
    notes = [f"{replicas} replicas at H=30: δ = {delta:+.2%} at N = {n / 1e6:,.3g}M by the Table 8 fits "
             f"[charles2025]"]
    lo_n, hi_n = DILOCO_FIT_RANGE
    if not lo_n <= n <= hi_n:
        notes.append(f"N = {n / 1e6:,.3g}M is outside the fitted 35M–2.4B: the fit is extrapolated "
                     "(assumption)")
        half *= 2
    if h != DILOCO_H:
        widen = H_WIDENING * abs(math.log2(h / DILOCO_H))
        notes.append(f"H = {h}: the paper shows loss growing with H only in a figure (less for larger N); the "
                     f"interval widens by {widen:.2%} (assumption: {H_WIDENING:.1%} per doubling away from 30) "
                     "[charles2025]")
        lo, hi = delta - half - (widen if h < DILOCO_H else 0.0), delta + half + (widen if h > DILOCO_H else 0.0)
        # H = 1 is the paper's worst setting; small H is not a free improvement either
        lo = min(lo, delta)
    else:
        lo, hi = delta - half, delta + half
    prior = _penalty(lo, delta, hi, "; ".join(notes), "charles2025")
    if name == "localsgd":
        prior = prior.combine(_penalty(
            0.0, 0.0, 0.02, "Local SGD is DiLoCo with outer SGD lr 1 and no momentum; the DiLoCo fits use Nesterov "
            "momentum 0.9 (assumption: up to 2% worse)", "charles2025"))
        return prior
    if not 0.2 <= cfg.outer_lr <= 1.0 and getattr(cfg, "outer", "sgd") == "sgd":
        prior = prior.combine(_penalty(0.0, 0.0, 0.03, f"outer lr {cfg.outer_lr:g} is outside the swept 0.2–1.0 "
                                       "(assumption: up to 3% worse)", "charles2025"))
    tau = getattr(cfg, "overlap_delay", 0)
    if tau:
        # one inner step of overlap costs nothing; a whole outer step of (naive) delay costs 12.7%
        frac = max(0.0, (tau - 1) / max(1, h - 1))
        d = DELAYED_OUTER_STEP * frac * (1 - cfg.mixing)
        prior = prior.combine(_penalty(
            0.0, d, 2 * d, f"τ = {tau} of H = {h}, mixing {cfg.mixing:g}: δ = {d:+.2%} (assumption: linear in "
            f"(τ−1)/(H−1) between no loss at τ = 1 and +{DELAYED_OUTER_STEP:.1%} for a whole outer step of delay "
            "[kale2025], scaled by 1 − mixing; Streaming DiLoCo's overlapped run matched Data-Parallel "
            "[douillard2025])", "kale2025", "douillard2025"))
    if cfg.fragments > 1:
        prior = prior.combine(_penalty(-0.005, 0.0, 0.005, f"{cfg.fragments} fragments: Streaming DiLoCo matched or "
                                       "beat DiLoCo (2.66 vs 2.67 eval loss at 25B tokens, 1B model) "
                                       "[douillard2025]", "douillard2025"))
    dtype = cfg.pseudo_grad_dtype
    if cfg.outer == "sparseloco":
        lo_d, hi_d = SPARSELOCO_DENSITY
        inside = lo_d <= cfg.topk_density <= hi_d and dtype in ("int2", "int4", "fp4", "fp4_e3m0", "bf16", "fp32")
        prior = prior.combine(_penalty(
            -0.01, 0.0, 0.0 if inside else 0.05,
            f"SparseLoCo at density {cfg.topk_density:.3g}, {dtype} values: outperforms full-precision DiLoCo at "
            f"1–3% density and 2-bit values [sarfi2025]" + ("" if inside else " (outside that range: up to 5% worse, "
                                                                             "assumption)"), "sarfi2025"))
    elif dtype in ("bf16", "fp4", "fp4_e3m0", "int8"):
        prior = prior.combine(_penalty(0.0, 0.0, 0.005, f"{dtype} pseudo-gradients: no regression from bf16/fp8/fp4 "
                                       "outer gradients [douillard2025]", "douillard2025"))
    elif dtype in ("int4", "int2"):
        ef = cfg.pseudo_grad_error_feedback
        prior = prior.combine(_penalty(0.0, 0.005 if ef else 0.02, 0.02 if ef else 0.08,
                                       f"{dtype} pseudo-gradients{' with' if ef else ' without'} error feedback: "
                                       "no published comparison (assumption)"))
    if cfg.pseudo_grad_replicator != "none":
        prior = prior.combine(_penalty(0.0, 0.01, 0.05, f"{cfg.pseudo_grad_replicator} replicator on the "
                                       "pseudo-gradient at {:.3g}: no published comparison for LLMs (assumption: "
                                       "+1%, up to +5%)".format(cfg.compression)))
    return prior


def _decoupled(cfg: Any, name: str) -> Prior:
    """DeMo (and FlexDeMo on its shard): comparable to AdamW up to 85× less data (Peng et al.)."""
    c = cfg.compression
    rep = cfg.replicator
    if rep in ("full",):
        prior = _penalty(-0.01, 0.0, 0.01, "full replication: every momentum element sent, decoupled optimizer "
                         "[peng2024]", "peng2024")
    elif rep == "dct":
        if c >= DEMO_COMPRESSION:
            prior = _penalty(-0.01, 0.0, 0.01, f"DCT top-k at {c:.3g} of the gradient's bytes: DeMo reached comparable "
                             "loss to AdamW-DDP sending up to 85× less [peng2024]; FlexDeMo ≈ hybrid-sharded AdamW "
                             "[from2025]", "peng2024", "from2025")
        else:
            doublings = math.log2(DEMO_COMPRESSION / c)
            prior = _penalty(0.0, 0.01 * doublings, 0.03 * doublings,
                             f"DCT top-k at {c:.3g}: below the 1/85 DeMo was shown at [peng2024] (assumption: +1% "
                             "per halving of the density, 0 to +3% per halving)", "peng2024")
    elif rep == "random":
        doublings = max(0.0, math.log2(DEMO_COMPRESSION / c))
        prior = _penalty(0.0, 0.02 + 0.01 * doublings, 0.1 + 0.03 * doublings,
                         f"random replicator at {c:.3g}: worse than DCT for causal language modeling (OLMo), better "
                         "for T5 [from2025] (figures only; assumption: +2%, up to +10%, more below 1/85)", "from2025")
    elif rep == "striding":
        prior = _penalty(0.0, 0.03, 0.15, "striding replicator: unstable or uncompetitive in DeToNATION's runs "
                         "[from2025] (assumption: +3%, up to +15%)", "from2025")
    else:  # none: workers never exchange momentum (local training)
        prior = _penalty(0.0, 0.1, 0.5, "no replication: workers train apart (assumption: +10%, up to +50%)")
    if not cfg.sign:
        prior = prior.combine(_penalty(0.0, 0.02, 0.1, "without sign: the signed update was clearly better "
                                       "[from2025] (assumption: +2%, up to +10%)", "from2025"))
    return prior


def prior_for(name: str, cfg: Any, ctx: PriorContext, tokens_per_step: float) -> Prior:
    """The prior of strategy ``name`` with config ``cfg`` whose steps hold ``tokens_per_step`` tokens (all
    workers) on average."""
    batch = batch_prior(tokens_per_step, ctx)
    if name in ("ddp", "zero1", "fsdp"):
        hook = getattr(cfg, "comm_hook", "allreduce")
        if hook in ("fp16", "bf16"):
            base = _penalty(0.0, 0.0, 0.005, f"{hook} gradient average (assumption: within 0.5%)")
        elif hook == "powersgd":
            base = _penalty(0.0, 0.01, 0.05, f"PowerSGD rank {cfg.powersgd_rank}: matched SGD on image models at "
                            "rank 2 [vogels2019] (assumption for LLMs: +1%, up to +5%)", "vogels2019")
        else:
            base = EXACT
        return base.combine(batch) if batch.notes else base
    if name == "acco":
        base = _penalty(-0.005, 0.0, 0.005, "ACCO's training curves match DDP at equal batch [nabli2025]",
                        "nabli2025")
        return base.combine(batch)
    if name == "dpu":
        if cfg.sync_warmup_steps:
            base = _multiplier(1.1, 1.5, DPU_MULTIPLIER[1], f"DPU with {cfg.sync_warmup_steps} warm-up steps: the "
                               "one-step delay still had a noticeable effect [nabli2025] (assumption: ×1.5, "
                               "×1.1–×4)", "nabli2025")
        else:
            base = _multiplier(DPU_MULTIPLIER[0], 2.5, DPU_MULTIPLIER[1], "DPU without warm-up: twice the tokens "
                               "approach the baseline without catching it [nabli2025] (assumption: ×2.5, ×2–×4)",
                               "nabli2025")
        return base.combine(batch)
    if name == "wp":
        base = _multiplier(1.0, 1.3, 2.0, "WP: worse than DDP, especially early [nabli2025] (assumption: ×1.3, "
                           "×1–×2)", "nabli2025")
        return base.combine(batch)
    if name in ("demo", "flexdemo"):
        return _decoupled(cfg, name).combine(batch)
    if name == "localsgd":
        return _diloco_like(cfg, ctx, ctx.workers, name).combine(batch)
    if name == "diloco":
        replicas = ctx.workers if cfg.inner == "local" else ctx.nodes
        return _diloco_like(cfg, ctx, replicas, name).combine(batch)
    if name == "cdp":
        if cfg.rule == "v1":
            base = _penalty(0.0, 0.01, 0.05, "CDP-v1: below CDP-v2 on CIFAR-10 [fournier2024] (assumption: +1%, up "
                            "to +5%)", "fournier2024")
        else:
            base = _penalty(-0.01, 0.0, 0.01, f"CDP-{cfg.rule}: similar or better accuracy than DP on CIFAR-10 and "
                            "ImageNet [fournier2024]", "fournier2024")
        return base.combine(batch)
    return _penalty(0.0, 0.05, 0.5, f"{name}: no published comparison (assumption: +5%, up to +50%)")


__all__ = ["EXACT", "SOURCES", "Prior", "PriorContext", "batch_prior", "critical_batch",
           "diloco_replica_penalty", "prior_for"]
