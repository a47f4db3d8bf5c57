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
:class:`~quietsync.strategies._overlap.OverlapConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._overlap import OverlapBase, OverlapConfig, _check_int
from .registry import register


@dataclass
class DPUConfig(OverlapConfig):
    """Knobs of ``dpu``."""

    sync_warmup_steps: int = 0
    """Non-delayed (blocking ZeRO-1) steps before the delayed updates start; 0 = none."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_int("sync_warmup_steps", self.sync_warmup_steps, 0)


class DelayedBase(OverlapBase):
    """DPU, and WP when :attr:`predict` is set: one overlapped sharded update per round."""

    config: DPUConfig
    predict = False
    """Compute the next round's gradients at θ̃⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁺¹⁾, same gradient) (WP) instead of θ⁽ᵗ⁺¹⁾."""

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.phase = "warmup" if self.config.sync_warmup_steps > 0 else "fill"
        """``warmup`` (blocking steps), ``fill`` (first overlapped stage, nothing in flight) or ``overlap``."""

    def _step(self) -> bool:
        self.worker.check()
        if self.phase == "warmup":
            if self._stage_count < self.blocking_count:
                return False
            count = self._hand_over(install=False)
            self._submit(self._update_job, count, self.steps, False)
            self._wait("sync_update")
            self._install()
            self._holds_committed = True
            self._commit_step()
            if self.steps >= self.config.sync_warmup_steps:
                self.phase = "fill"
            return True
        if self.phase == "fill":
            if self._stage_count < self.blocking_count:
                return False
            count = self._hand_over(install=False)
            self._submit(self._update_job, count, self.steps, self.predict)
            self.phase = "overlap"
            return False
        if not self._stage_ready():
            return False
        self._wait("delayed_update")
        count = self._hand_over(install=True)  # P ← θ⁽ᵗ⁺¹⁾ (WP: θ̃⁽ᵗ⁺¹⁾), B ← gradients computed at the old P
        self._holds_committed = not self.predict
        self._commit_step()
        self._submit(self._update_job, count, self.steps, self.predict)
        return True

    def _update_job(self, local_count: int, step: int, predict: bool) -> dict[str, Any]:
        """θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σg/ΣN) committed; B ← θ⁽ᵗ⁺¹⁾, or with ``predict`` the uncommitted
        θ̃⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁺¹⁾, Σg/ΣN) (WP's second step with the same gradient)."""
        counts, total = self._reduce(local_count, "grads")
        self.sharded.grad.div_(total)
        self._commit_shard(step)
        if predict:
            self._gather(self.estimator.estimate(self._lr_scale(step + 1)), "wp_prediction")
        else:
            self._gather(self.sharded.master, "params")
        return {"kind": "update", "counts": counts}

    def _algo_state(self) -> dict[str, Any]:
        return {"phase": self.phase}

    def _load_algo_state(self, state: dict[str, Any]) -> None:
        if state["phase"] not in ("warmup", "fill", "overlap"):
            raise ValueError(f"checkpoint phase must be warmup, fill or overlap, got {state['phase']!r}")
        self.phase = state["phase"]


@register("dpu", DPUConfig)
class DPU(DelayedBase):
    """Delayed Parameter Update; see the module docstring."""
