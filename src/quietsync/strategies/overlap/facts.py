"""What acco, dpu and wp declare beside their code (:mod:`~quietsync.strategies.declaration`): their loss per token
from ACCO's paper, their adaptive stages (the planner pilots them through the emulated link), and why torchft
cannot run them (an update is always in flight)."""

from __future__ import annotations

from typing import Any

from ..declaration import Declaration, PlanFacts, Prior, Scale, multiplier, penalty
from . import cost

SOURCES = {"nabli2025": "Nabli et al., \"ACCO: Accumulate While You Communicate\" (shared/papers/003), §4.3"}

DPU_MULTIPLIER = (2.0, 4.0)
"""DPU without warm-up: "if we train for twice as long, the DPU training curve approaches the baseline one, without
totally catching it" (Nabli et al., §4.3): more than 2× the tokens; 4× is this prior's assumed upper end."""

CAPPED = ({}, {"max_accumulation": 4})
"""The grid of each: adaptive, and capped at 4 micro-batches per stage."""
ADAPTED = ({"adapt": True, "max_accumulation": 4},)
"""ACCO's setting for a link that varies during the run: the cap re-picked from the measured link (``--adapt``,
adapt_cap.py), from the grid's 4."""


def acco_prior(cfg: Any, scale: Scale) -> Prior:
    return penalty(-0.005, 0.0, 0.005, "ACCO's training curves match DDP at equal batch [nabli2025]", "nabli2025")


def dpu_prior(cfg: Any, scale: Scale) -> Prior:
    if cfg.sync_warmup_steps:
        return multiplier(1.1, 1.5, DPU_MULTIPLIER[1], f"DPU with {cfg.sync_warmup_steps} warm-up steps: the one-step "
                          "delay still had a noticeable effect [nabli2025] (assumption: ×1.5, ×1.1–×4)", "nabli2025")
    return multiplier(DPU_MULTIPLIER[0], 2.5, DPU_MULTIPLIER[1], "DPU without warm-up: twice the tokens approach the "
                      "baseline without catching it [nabli2025] (assumption: ×2.5, ×2–×4)", "nabli2025")


def wp_prior(cfg: Any, scale: Scale) -> Prior:
    return multiplier(1.0, 1.3, 2.0, "WP: worse than DDP, especially early [nabli2025] (assumption: ×1.3, ×1–×2)",
                      "nabli2025")


IN_FLIGHT = "so no moment holds a committed state a returning replica could take"
HIDES = ("hides the {what} behind {per_stage:.3g} micro-batches per stage per worker ({tokens_per_step:,.0f} tokens "
         "per step)")
FIXED = ["--deterministic-accumulation", "1"]  # fixed stages: the CPU and CUDA trajectories are comparable

ACCO = Declaration(
    schedule=cost.acco,
    plan=PlanFacts(prior=acco_prior, sources=SOURCES, grid=CAPPED, stages=2, advice=HIDES.replace("{what}", "network"),
                   varying=ADAPTED),
    faults="its update of one step is computed while the next step's gradients accumulate (the overlap that hides "
           f"the network), {IN_FLIGHT}",
    gpu_flags=tuple(FIXED), order=3)

DPU = Declaration(
    schedule=cost.dpu,
    plan=PlanFacts(prior=dpu_prior, sources=SOURCES, grid=CAPPED, stages=1, advice=HIDES.replace("{what}", "update")),
    faults=f"its update of one step is applied while the next step computes (the delay that hides the network), "
           f"{IN_FLIGHT}",
    gpu_flags=tuple(FIXED), order=4)

WP = Declaration(
    schedule=cost.wp,
    plan=PlanFacts(prior=wp_prior, sources=SOURCES, grid=CAPPED, stages=1, advice=HIDES.replace("{what}", "update")),
    faults=f"its update of one step is applied while the next step computes on a predicted model, {IN_FLIGHT}",
    gpu_flags=tuple(FIXED), order=5)
