"""``wp``: Weight Prediction (ACCO-wp; papers 000/003, eq. WP).

Like DPU, the communication worker applies the previous round's gradients while the main thread computes,
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

from ..base import Strategy
from ..registry import register
from .machinery import DelayedConfig, DelayedPipeline, Overlap


@dataclass
class WPConfig(DelayedConfig):
    """Knobs of ``wp`` (see :class:`~quietsync.strategies.overlap.machinery.DelayedConfig`)."""


@register("wp", WPConfig)
class WP(Strategy):
    """Weight prediction; see the module docstring."""

    reshard_refusal = (
        "the gradients of the last round are applied one step late (on the predicted weights), so every "
        "checkpoint holds a round in flight"
    )

    config: WPConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.overlap = self.hold("overlap", Overlap.for_strategy(self, estimate=True, snapshot=True),
                                 takes_micro_batches=True)
        self.pipeline = self.hold("pipeline", DelayedPipeline(self.overlap, self.config.sync_warmup_steps,
                                                              predicts=True))
        self.shard, self.optimizer = self.overlap.sharded.shard, self.overlap.sharded.optimizer

    def _step(self) -> bool:
        return self.pipeline.step(self._predict_job, self.steps, lambda: self._commit(*self.overlap.step_record()))

    def _predict_job(self, local_count: int, step: int, overlapped: bool) -> dict[str, Any]:
        """θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, ḡ⁽ᵗ⁾) committed; B ← the prediction θ̃⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁺¹⁾, ḡ⁽ᵗ⁾), a second step
        with the same gradient on the scratch state (uncommitted) — or θ⁽ᵗ⁺¹⁾ itself in a blocking warm-up step."""
        counts, total = self.overlap.reduce(local_count, "grads")
        self.shard.grad.div_(total)
        self.overlap.commit_shard(self._lr_scale(step))
        if overlapped:
            self.overlap.gather(self.overlap.estimator.estimate(self._lr_scale(step + 1)), "wp_prediction")
        else:
            self.overlap.gather(self.shard.master, "params")
        return {"kind": "update", "counts": counts}

    @contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """θ, all-gathered from the master shards (or their snapshot): every worker must enter it."""
        with self.overlap.committed_params(self.model, self.steps) as model:
            yield model

