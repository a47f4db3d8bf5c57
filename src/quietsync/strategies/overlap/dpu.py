"""``dpu``: Delayed Parameter Update (ZeRO-Offload's DPU as re-purposed in papers 000/003, eq. DPU).

The main thread computes gᵢ⁽ᵗ⁾ at θ⁽ᵗ⁾ while the communication worker applies the *previous* round's
gradients::

    gᵢ⁽ᵗ⁾ = Σₖ ∇F(θ⁽ᵗ⁾, ξᵢₖ)   ‖   θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σᵢgᵢ⁽ᵗ⁻¹⁾ / ΣᵢNᵢ⁽ᵗ⁻¹⁾)

(all-reduce of the counts, reduce-scatter, sharded optimizer step, all-gather — one ZeRO-1 step per round,
overlapped), so from the second overlapped step on, gradients are one step stale. ``sync_warmup_steps``
non-delayed, blocking ZeRO-1 steps come first (the recipe of ZeRO-Offload; 0 = the paper's "no warm-up").
The first overlapped round starts the pipeline like Algorithm 1: the gradient g⁽⁻¹⁾ of its first stage is
computed at the current θ, so the first delayed-mode update is not stale.

The state machine has three phases: ``warmup`` (``sync_warmup_steps`` blocking steps: the update job is run
and waited for at once), ``fill`` (the first overlapped stage: its gradient is computed at the current θ,
nothing is in flight yet) and ``overlap`` (each stage's gradients go out while the previous round's update is
collected and installed). Weight prediction (``wp``) is the same machine with another job.

Precision and clipping: the update job clips the averaged gradient Σg/ΣN by its global norm (one scalar
all-reduce) and, under fp16, skips the update on every worker when it overflowed (see
:mod:`~quietsync.strategies.overlap.machinery`); ``step()`` then returns False for that round.

``step()`` returns True each time an update is collected and the new θ installed; the model always holds
the committed θ (``committed_params()`` is free). Accumulation per stage: see
:class:`~quietsync.strategies.overlap.machinery.OverlapConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...validate import check_int
from ..base import Strategy
from ..registry import register
from .machinery import Overlap, OverlapConfig

PHASES = ("warmup", "fill", "overlap")


@dataclass
class DPUConfig(OverlapConfig):
    """Knobs of ``dpu`` (and ``wp``): accumulation per stage (see :class:`OverlapConfig`) and the warm-up."""

    sync_warmup_steps: int = 0
    """Non-delayed (blocking ZeRO-1) steps before the delayed updates start; 0 = none."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("sync_warmup_steps", self.sync_warmup_steps, 0)


@register("dpu", DPUConfig)
class DPU(Strategy):
    """Delayed Parameter Update; see the module docstring."""

    reshard_refusal = (
        "the gradients of the last round are applied one step late, so every checkpoint holds a round in "
        "flight, summed over the old workers' micro-batches"
    )

    predicts: ClassVar[bool] = False
    """Whether the update job installs a prediction rather than θ (``wp``): then the model does not hold θ."""

    config: DPUConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.overlap = self.hold("overlap", Overlap.for_strategy(self, estimate=self.predicts,
                                                                 snapshot=self.predicts))
        self.shard, self.optimizer = self.overlap.sharded.shard, self.overlap.sharded.optimizer
        self.phase = "warmup" if self.config.sync_warmup_steps > 0 else "fill"
        """``warmup``, ``fill`` or ``overlap`` (see the module docstring)."""

    def _backward(self, loss: torch.Tensor) -> None:
        self.overlap.backward(loss)

    def _step(self) -> bool:
        o = self.overlap
        if self.phase == "warmup":
            if not o.start(self._job, self.steps, False, self._stage_scale(), self.max_grad_norm):
                return False
            result = o.wait("sync_update")
            o.install()
            o.holds_committed = True
            committed = self._collected(result)
            if self.steps >= self.config.sync_warmup_steps:
                self.phase = "fill"
            return committed
        if self.phase == "fill":
            if o.start(self._job, self.steps, True, self._stage_scale(), self.max_grad_norm):
                self.phase = "overlap"
            return False
        if not o.stage_ready():
            return False
        scale = self._stage_scale()  # of the stage ending now (the scale changes only in _collected)
        result = o.wait("delayed_update")
        count = o.hand_over(install=True)  # P ← θ⁽ᵗ⁺¹⁾ (WP: θ̃⁽ᵗ⁺¹⁾), B ← gradients computed at the old P
        o.holds_committed = not self.predicts
        committed = self._collected(result)
        o.submit(self._job, count, self.steps, True, scale, self.max_grad_norm)
        return committed

    def _stage_scale(self) -> float | None:
        """The fp16 loss scale the current stage's micro-batches carry (None without fp16)."""
        return None if self.scaler is None else self.scaler.scale

    def _collected(self, result: dict[str, Any]) -> bool:
        """Commit the update job's step, or — an fp16 overflow, skipped by the job on every worker — nothing."""
        check = result.get("check")
        extras: dict[str, Any] | None = {}
        if check is not None:
            extras = self._gradient_extras(check, result["scale"])
            if extras is None:
                self.overlap.drop_pending()
                return False
        extra, local = self.overlap.step_record()
        self._commit({**extra, **extras}, local)
        return True

    def _update(self, local_count: int, step: int, scale: float | None,
                max_norm: float | None) -> tuple[list[int], dict[str, Any]]:
        """Job part: reduce, unscale, average, measure and clip; θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, ḡ) committed unless fp16
        found an overflow. Returns the counts and the result fields."""
        counts, total = self.overlap.reduce(local_count, "grads")
        if scale is not None:
            self.shard.grad.div_(scale)
        self.shard.grad.div_(total)
        check = self.overlap.prepare(max_norm, scale is not None)
        skipped = check is not None and scale is not None and not check.finite
        if not skipped:
            self.overlap.commit_shard(self._lr_scale(step))
        return counts, {"kind": "update", "counts": counts, "check": check, "scale": scale, "skipped": skipped}

    def _job(self, local_count: int, step: int, overlapped: bool, scale: float | None = None,
             max_norm: float | None = None) -> dict[str, Any]:
        """θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σg/ΣN), committed and all-gathered into B (the same job, overlapped or not)."""
        _, result = self._update(local_count, step, scale, max_norm)
        self.overlap.gather(self.shard.master, "params")
        return result

    def _position(self) -> dict[str, int]:
        return {"phase": PHASES.index(self.phase)}

    def _state(self) -> dict[str, Any]:
        return {"phase": self.phase}

    def _load_state(self, state: dict[str, Any]) -> None:
        if state["phase"] not in PHASES:
            raise ValueError(f"checkpoint phase must be one of {', '.join(PHASES)}, got {state['phase']!r}")
        self.phase = state["phase"]
