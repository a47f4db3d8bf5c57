"""``wp``: Weight Prediction (ACCO-wp; papers 000/003, eq. WP).

DPU's state machine with another job (so ``WP`` is a :class:`~quietsync.strategies.overlap.dpu.DPU`): like
DPU, the communication worker applies the previous round's gradients while the main thread computes,
but the main thread computes at a *prediction* of the next parameters instead of the stale ones::

    gᵢ⁽ᵗ⁺¹⁾ = Σₖ ∇F(θ̃⁽ᵗ⁾, ξᵢₖ)   ‖   θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, ḡ⁽ᵗ⁾),   θ̃⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁺¹⁾, ḡ⁽ᵗ⁾)

The prediction is a second optimizer step with the same gradient, taken on a scratch copy of the shard
state: it never commits optimizer state (moments, step counter). The first overlapped round computes at
θ (the paper's ``Est(•)`` is free there). ``sync_warmup_steps`` blocking steps may come first, as for DPU.

The model holds θ̃, not θ, between committed steps: ``committed_params()`` all-gathers θ from the master
shards (a snapshot of the shard is kept so that it works while the next update is in flight), so every
worker must enter it at the same committed step (the trainer does, right after ``step()`` returned True).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..registry import register
from . import facts
from .dpu import DPU, DPUConfig


@dataclass
class WPConfig(DPUConfig):
    """Knobs of ``wp`` (those of ``dpu``)."""


@register("wp", WPConfig, facts=facts.WP)
class WP(DPU):
    """Weight prediction; see the module docstring."""

    predicts = True

    config: WPConfig

    def _job(self, local_count: int, step: int, overlapped: bool, scale: float | None = None,
             max_norm: float | None = None, probe: tuple[float, float] | None = None) -> dict[str, Any]:
        """θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, ḡ⁽ᵗ⁾) committed; B ← the prediction θ̃⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁺¹⁾, ḡ⁽ᵗ⁾), a second step
        with the same (clipped) gradient on the scratch state (uncommitted) — or θ⁽ᵗ⁺¹⁾ itself in a blocking
        warm-up step, or θ⁽ᵗ⁾ when fp16 skipped the update."""
        _, result = self._update(local_count, step, scale, max_norm, probe)
        if overlapped and not result["skipped"]:
            self.overlap.gather(self.overlap.estimator.estimate(self._lr_scale(step + 1)), "wp_prediction")
        else:
            self.overlap.gather(self.shard.master, "params")
        return result

    @contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """θ, all-gathered from the master shards (or their snapshot): every worker must enter it."""
        with self.overlap.committed_params(self.model, self.steps) as model:
            yield model
