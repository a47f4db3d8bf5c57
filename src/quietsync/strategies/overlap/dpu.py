"""``dpu``: Delayed Parameter Update (ZeRO-Offload's DPU as re-purposed in papers 000/003, eq. DPU).

The main thread computes gᵢ⁽ᵗ⁾ at θ⁽ᵗ⁾ while the communication worker applies the *previous* round's
gradients::

    gᵢ⁽ᵗ⁾ = Σₖ ∇F(θ⁽ᵗ⁾, ξᵢₖ)   ‖   θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σᵢgᵢ⁽ᵗ⁻¹⁾ / ΣᵢNᵢ⁽ᵗ⁻¹⁾)

(all-reduce of the counts, reduce-scatter, sharded optimizer step, all-gather — one ZeRO-1 step per round,
overlapped), so from the second overlapped step on, gradients are one step stale. ``sync_warmup_steps``
non-delayed, blocking ZeRO-1 steps come first (the recipe of ZeRO-Offload; 0 = the paper's "no warm-up").
The first overlapped round starts the pipeline like Algorithm 1: the gradient g⁽⁻¹⁾ of its first stage is
computed at the current θ, so the first delayed-mode update is not stale.

``step()`` returns True each time an update is collected and the new θ installed; the model always holds
the committed θ (``committed_params()`` is free). Accumulation per stage: see
:class:`~quietsync.strategies.overlap.machinery.OverlapConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..base import Strategy
from ..registry import register
from .machinery import DelayedConfig, DelayedPipeline, Overlap


@dataclass
class DPUConfig(DelayedConfig):
    """Knobs of ``dpu`` (see :class:`~quietsync.strategies.overlap.machinery.DelayedConfig`)."""


@register("dpu", DPUConfig)
class DPU(Strategy):
    """Delayed Parameter Update; see the module docstring."""

    reshard_refusal = (
        "the gradients of the last round are applied one step late, so every checkpoint holds a round in "
        "flight, summed over the old workers' micro-batches"
    )

    config: DPUConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.overlap = self.hold("overlap", Overlap.for_strategy(self, estimate=False, snapshot=False),
                                 takes_micro_batches=True)
        self.pipeline = self.hold("pipeline", DelayedPipeline(self.overlap, self.config.sync_warmup_steps,
                                                              predicts=False))
        self.shard, self.optimizer = self.overlap.sharded.shard, self.overlap.sharded.optimizer

    def _step(self) -> bool:
        return self.pipeline.step(self._update_job, self.steps, lambda: self._commit(*self.overlap.step_record()))

    def _update_job(self, local_count: int, step: int, overlapped: bool) -> dict[str, Any]:
        """θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σg/ΣN), committed and all-gathered into B (the same job, overlapped or not)."""
        counts, total = self.overlap.reduce(local_count, "grads")
        self.shard.grad.div_(total)
        self.overlap.commit_shard(self._lr_scale(step))
        self.overlap.gather(self.shard.master, "params")
        return {"kind": "update", "counts": counts}

