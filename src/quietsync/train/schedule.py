"""Learning-rate schedule: linear warm-up, then cosine decay, as a multiplier of the base lr.

Strategies take ``lr_schedule=f`` with ``f(committed_steps) -> float`` and apply it before every optimizer
step, so the schedule follows committed steps whatever the number of micro-batches per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..validate import check_float, check_int


@dataclass(frozen=True)
class WarmupCosine:
    """``f(step)``: ``(step+1)/warmup`` during warm-up, then cosine from 1 down to ``min_ratio``.

    ``step`` counts committed steps before the one being taken (0 for the first), so the first step
    already uses a non-zero lr. After ``total_steps`` the multiplier stays at ``min_ratio``.
    """

    warmup_steps: int
    """Steps of linear warm-up (0 = none)."""
    total_steps: int
    """Step at which the cosine reaches ``min_ratio``."""
    min_ratio: float = 0.1
    """Final multiplier (fraction of the base lr)."""

    def __post_init__(self) -> None:
        check_int("warmup_steps", self.warmup_steps, 0)
        check_int("total_steps", self.total_steps, 1)
        check_float("min_ratio", self.min_ratio, 0, 1)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)  # a warm-up as long as the run: no division by 0
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float = 0.1) -> WarmupCosine:
    """The schedule as a picklable callable (see :class:`WarmupCosine`)."""
    return WarmupCosine(warmup_steps, total_steps, min_ratio)
