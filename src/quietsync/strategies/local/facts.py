"""What localsgd and diloco declare beside their code (:mod:`~quietsync.strategies.declaration`): their loss per
token from the DiLoCo scaling laws (Charles et al. 2025) and Streaming DiLoCo / SparseLoCo's comparisons, their
grid (H, fragments, overlap, low-bit and sparse outer steps), their sync period (pilots evaluate right after
syncs), and their policy under ``--fault-tolerance torchft`` (a missing replica's inner steps are lost with it; a
returning one starts from the agreed parameters)."""

from __future__ import annotations

import math
from typing import Any

from ..declaration import MISSING_DATA, Declaration, PlanFacts, Prior, ReplicaPolicy, Scale, penalty
from . import cost

SOURCES = {
    "charles2025": "Charles et al. 2025, \"Scaling Laws for DiLoCo\" (arXiv:2503.09799), Table 8 and §5",
    "douillard2025": "Douillard et al. 2025, \"Streaming DiLoCo with overlapping communication\" (arXiv:2501.18512), "
                     "Table 1 and §2.4",
    "kale2025": "Kale, Douillard, Donchev 2025, \"Eager Updates For Overlapped Communication and Computation in "
                "DiLoCo\" (arXiv:2502.12996), Table 2",
    "sarfi2025": "Sarfi et al. 2025, \"Communication Efficient LLM Pre-training with SparseLoCo\" "
                 "(arXiv:2508.15706), abstract",
}

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
SPARSELOCO_DENSITY = (0.01, 0.03)
"""SparseLoCo outperforms full-precision DiLoCo at 1–3% density with 2-bit values (Sarfi et al. 2025)."""

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


def diloco_like(cfg: Any, ctx: Scale, replicas: int, local_sgd: bool) -> Prior:
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
    prior = penalty(lo, delta, hi, "; ".join(notes), "charles2025")
    if getattr(cfg, "inner_steps", "fixed") == "adaptive":
        # no published loss comparison at equal tokens; this project's own runs show none (docs/local.md)
        prior = prior.combine(penalty(0.0, 0.0, 0.0, "adaptive inner steps: each worker's share of the round by its "
                                       "speed, the average weighted by tokens (Async Local-SGD, DyLU) — the prior of "
                                       "the same setting with fixed inner steps at the fastest worker's H "
                                       "(assumption; measured here with one 3× slower worker: 0.68–0.98× the "
                                       "synchronous run's tokens to the same loss, benchmarks/results/uneven.md)"))
    largest = max(cfg.adapt_candidates(cfg.sync_every, getattr(cfg, "fragments", 1),
                                       getattr(cfg, "overlap_delay", 0))) if getattr(cfg, "adapt", False) else 0
    if largest > cfg.sync_every:  # --adapt may take H up to its largest candidate (H ... 16H by default)
        widen = H_WIDENING * math.log2(largest / cfg.sync_every)
        prior = prior.combine(penalty(0.0, 0.0, widen, f"--adapt: H re-picked from the measured link, from H up to "
                                       f"{largest / cfg.sync_every:g}·H when the link cannot carry it; the prior is "
                                       f"at the H chosen, the "
                                       f"interval widened by {widen:.1%} for the largest (assumption: "
                                       f"{H_WIDENING:.1%} per doubling) [charles2025]", "charles2025"))
    if local_sgd:
        prior = prior.combine(penalty(
            0.0, 0.0, 0.02, "Local SGD is DiLoCo with outer SGD lr 1 and no momentum; the DiLoCo fits use Nesterov "
            "momentum 0.9 (assumption: up to 2% worse)", "charles2025"))
        return prior
    if not 0.2 <= cfg.outer_lr <= 1.0 and getattr(cfg, "outer", "sgd") == "sgd":
        prior = prior.combine(penalty(0.0, 0.0, 0.03, f"outer lr {cfg.outer_lr:g} is outside the swept 0.2–1.0 "
                                       "(assumption: up to 3% worse)", "charles2025"))
    tau = getattr(cfg, "overlap_delay", 0)
    if tau:
        # one inner step of overlap costs nothing; a whole outer step of (naive) delay costs 12.7%
        frac = max(0.0, (tau - 1) / max(1, h - 1))
        d = DELAYED_OUTER_STEP * frac * (1 - cfg.mixing)
        prior = prior.combine(penalty(
            0.0, d, 2 * d, f"τ = {tau} of H = {h}, mixing {cfg.mixing:g}: δ = {d:+.2%} (assumption: linear in "
            f"(τ−1)/(H−1) between no loss at τ = 1 and +{DELAYED_OUTER_STEP:.1%} for a whole outer step of delay "
            "[kale2025], scaled by 1 − mixing; Streaming DiLoCo's overlapped run matched Data-Parallel "
            "[douillard2025])", "kale2025", "douillard2025"))
    if cfg.fragments > 1:
        prior = prior.combine(penalty(-0.005, 0.0, 0.005, f"{cfg.fragments} fragments: Streaming DiLoCo matched or "
                                       "beat DiLoCo (2.66 vs 2.67 eval loss at 25B tokens, 1B model) "
                                       "[douillard2025]", "douillard2025"))
    dtype = cfg.pseudo_grad_dtype
    if cfg.outer == "sparseloco":
        lo_d, hi_d = SPARSELOCO_DENSITY
        inside = lo_d <= cfg.topk_density <= hi_d and dtype in ("int2", "int4", "fp4", "fp4_e3m0", "bf16", "fp32")
        prior = prior.combine(penalty(
            -0.01, 0.0, 0.0 if inside else 0.05,
            f"SparseLoCo at density {cfg.topk_density:.3g}, {dtype} values: outperforms full-precision DiLoCo at "
            f"1–3% density and 2-bit values [sarfi2025]" + ("" if inside else " (outside that range: up to 5% worse, "
                                                                             "assumption)"), "sarfi2025"))
    elif dtype in ("bf16", "fp4", "fp4_e3m0", "int8"):
        prior = prior.combine(penalty(0.0, 0.0, 0.005, f"{dtype} pseudo-gradients: no regression from bf16/fp8/fp4 "
                                       "outer gradients [douillard2025]", "douillard2025"))
    elif dtype in ("int4", "int2"):
        ef = cfg.pseudo_grad_error_feedback
        prior = prior.combine(penalty(0.0, 0.005 if ef else 0.02, 0.02 if ef else 0.08,
                                       f"{dtype} pseudo-gradients{' with' if ef else ' without'} error feedback: "
                                       "no published comparison (assumption)"))
    if cfg.pseudo_grad_replicator != "none":
        prior = prior.combine(penalty(0.0, 0.01, 0.05, f"{cfg.pseudo_grad_replicator} replicator on the "
                                       "pseudo-gradient at {:.3g}: no published comparison for LLMs (assumption: "
                                       "+1%, up to +5%)".format(cfg.compression)))
    return prior



def localsgd_prior(cfg: Any, scale: Scale) -> Prior:
    """Local SGD: DiLoCo's fits at one replica per worker, with plain averaging."""
    return diloco_like(cfg, scale, scale.workers, local_sgd=True)


def diloco_prior(cfg: Any, scale: Scale) -> Prior:
    """DiLoCo: one replica per worker with local inner steps, one per node with an inner ddp/zero1."""
    return diloco_like(cfg, scale, scale.workers if cfg.inner == "local" else scale.nodes, local_sgd=False)


def localsgd_first_sync(cfg: Any) -> int | None:
    return int(cfg.sync_every)


def diloco_first_sync(cfg: Any) -> int | None:
    """A worker of inner local steps trains alone H / fragments steps before its first fragment syncs."""
    return max(1, int(cfg.sync_every) // int(cfg.fragments)) if cfg.inner == "local" else None


def sync_every(cfg: Any) -> int:
    return int(cfg.sync_every)


def diloco_one_worker(cfg: Any) -> bool:
    """Inner local steps keep the state per worker; an inner ddp/zero1 keeps it per node."""
    return getattr(cfg, "inner", "local") == "local"


STREAMING = {"sync_every": 16, "fragments": 4, "overlap_delay": 4}

LOCALSGD = Declaration(
    schedule=cost.localsgd,
    plan=PlanFacts(prior=localsgd_prior, sources=SOURCES, grid=({"sync_every": 16},), sync_period=sync_every,
                   uneven=({"sync_every": 16, "inner_steps": "adaptive"},),
                   first_sync=localsgd_first_sync, advice="averages parameters every {config.sync_every} steps"),
    faults=ReplicaPolicy(
        missing="its local steps since the last average are lost (its parameters never reach the average); the "
                "average is over the replicas present; " + MISSING_DATA,
        joining="the last averaged parameters as its own, and the peer's optimizer moments (exact with "
                "--average-optimizer-state, else the moments of one replica stand for the mean)",
        workers="one", one_worker=True,
        skip_refusal="localsgd and diloco take their inner steps alone between commits"),
    gpu_flags=("--sync-every", "4"),
    order=8)

DILOCO = Declaration(
    schedule=cost.diloco,
    plan=PlanFacts(
        prior=diloco_prior, sources=SOURCES,
        grid=({"sync_every": 16}, {"sync_every": 64}, STREAMING, {**STREAMING, "pseudo_grad_dtype": "fp4"},
              {"sync_every": 16, "outer": "sparseloco", "outer_lr": 1.0}),
        wide=({"sync_every": 128, "fragments": 4, "overlap_delay": 32}, {"sync_every": 512},
              {"sync_every": 512, "fragments": 4, "overlap_delay": 128, "pseudo_grad_dtype": "fp4"},
              {"sync_every": 128, "outer": "sparseloco", "outer_lr": 1.0}),
        uneven=({"sync_every": 16, "inner_steps": "adaptive"},
                {**STREAMING, "pseudo_grad_dtype": "fp4", "inner_steps": "adaptive"}),
        varying=({"sync_every": 16, "adapt": True}, {"sync_every": 16, "pseudo_grad_dtype": "fp4", "adapt": True}),
        sync_period=sync_every, first_sync=diloco_first_sync, advice="{setting}: outer sync every H inner steps"),
    faults=ReplicaPolicy(
        missing="its inner steps since its last sync are lost (its pseudo-gradient never reaches the average); "
                "with error feedback (SparseLoCo, low-bit with --pseudo-grad-error-feedback, a replicator) its "
                "residual -- what it had not yet sent -- is lost with it; the outer step averages the replicas "
                "present; " + MISSING_DATA,
        joining="theta_global, the outer optimizer's momentum, the fragment schedule and a fragment in flight; its "
                "local parameters start from theta_global (no drift), its residual empty (it owes nothing), its "
                "inner optimizer state the peer's (inner ddp/zero1: worker i from worker i)",
        workers="one (inner local); any (inner ddp, zero1)", one_worker=diloco_one_worker,
        one_worker_hint=(" with --inner local", "; diloco --inner ddp or zero1 runs several"),
        skip_refusal="localsgd and diloco take their inner steps alone between commits"),
    gpu_flags=("--sync-every", "4", "--fragments", "2", "--overlap-delay", "1"),  # outer step on the comm worker
    order=9)
