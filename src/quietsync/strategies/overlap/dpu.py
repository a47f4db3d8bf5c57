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

``step()`` returns True each time an update is collected and the new θ installed; the model always holds
the committed θ (``committed_params()`` is free). Accumulation per stage: see
:class:`~quietsync.strategies.overlap.machinery.OverlapConfig`.

Checkpoints that reshard drain the update in flight first (:mod:`~quietsync.strategies.overlap.machinery`):
its gradients are the old workers', already reduced; the new workers install its result at their first
hand-over and send their own gradients with it, as the old ones would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...validate import check_int
from ..base import Strategy
from ..checkpoint.logical import SavedTensors
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

    reshard_refusal = None  # the round in flight is drained first (overlap/machinery.py)

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
            if not o.start(self._job, self.steps, False):
                return False
            o.wait("sync_update")
            o.install()
            o.holds_committed = True
            self._commit(*o.step_record())
            if self.steps >= self.config.sync_warmup_steps:
                self.phase = "fill"
            return True
        if self.phase == "fill":
            if o.start(self._job, self.steps, True):
                self.phase = "overlap"
            return False
        if not o.stage_ready():
            return False
        o.wait("delayed_update")
        count = o.hand_over(install=True)  # P ← θ⁽ᵗ⁺¹⁾ (WP: θ̃⁽ᵗ⁺¹⁾), B ← gradients computed at the old P
        o.holds_committed = not self.predicts
        self._commit(*o.step_record())
        o.submit(self._job, count, self.steps, True)
        return True

    def _job(self, local_count: int, step: int, overlapped: bool) -> dict[str, Any]:
        """θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σg/ΣN), committed and all-gathered into B (the same job, overlapped or not)."""
        counts, total = self.overlap.reduce(local_count, "grads")
        self.shard.grad.div_(total)
        self.overlap.commit_shard(self._lr_scale(step))
        self.overlap.gather(self.shard.master, "params")
        return {"kind": "update", "counts": counts}

    def _position(self) -> dict[str, int]:
        return {"phase": PHASES.index(self.phase)}

    def _state(self) -> dict[str, Any]:
        return {"phase": self.phase}

    def _load_state(self, state: dict[str, Any]) -> None:
        if state["phase"] not in PHASES:
            raise ValueError(f"checkpoint phase must be one of {', '.join(PHASES)}, got {state['phase']!r}")
        self.phase = state["phase"]

    # ------------------------------------------------------------------ checkpoints that reshard
    def _open_round(self) -> dict[str, int]:
        return {"stage_micro_batches": self.overlap.stage_count}

    def _logical_state(self) -> dict[str, torch.Tensor]:
        return {**self.overlap.logical_state(), "dpu.phase": torch.tensor(PHASES.index(self.phase))}

    def _logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        return {**self.overlap.logical_targets(saved), "dpu.phase": torch.zeros((), dtype=torch.int64)}

    def _load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        self.overlap.load_logical(filled)
        self.phase = PHASES[int(filled["dpu.phase"])]
