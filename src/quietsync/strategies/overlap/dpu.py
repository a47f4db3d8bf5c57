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

``finish()`` drains the round in flight: the update job running since the last hand-over — it applies the last
stage's gradients, as the recurrence θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, ḡ⁽ᵗ⁻¹⁾) prescribes, and has already stepped the
optimizer state on the master shard — is waited for and committed (one more step, ``steps_in_flight`` = 1),
and θ installed (``wp``: θ, not the prediction); micro-batches of an unfinished stage are dropped.
Precision and clipping: the update job clips the averaged gradient Σg/ΣN by its global norm (one scalar
all-reduce) and, under fp16, skips the update on every worker when it overflowed (see
:mod:`~quietsync.strategies.overlap.machinery`); ``step()`` then returns False for that round.

``step()`` returns True each time an update is collected and the new θ installed; the model always holds
the committed θ (``committed_params()`` is free). Accumulation per stage: see
:class:`~quietsync.strategies.overlap.machinery.OverlapConfig`; ``--adapt`` re-picks the cap on micro-batches per
stage from the measured link as ACCO's does (:mod:`~quietsync.strategies.overlap.adapt_cap`), at the hand-over
that collects an update (a stage boundary), the probe riding on the update job's count all-reduce.

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
from . import cost, facts
from .adapt_cap import CapAdaptConfig, CapController
from .machinery import Overlap
from .strategy import collected, stage_scale

PHASES = ("warmup", "fill", "overlap")


@dataclass
class DPUConfig(CapAdaptConfig):
    """Knobs of ``dpu`` (and ``wp``): accumulation per stage (see :class:`OverlapConfig`), ``--adapt`` of its cap
    (:class:`~quietsync.strategies.overlap.adapt_cap.CapAdaptConfig`) and the warm-up."""

    sync_warmup_steps: int = 0
    """Non-delayed (blocking ZeRO-1) steps before the delayed updates start; 0 = none."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("sync_warmup_steps", self.sync_warmup_steps, 0)


@register("dpu", DPUConfig, facts=facts.DPU)
class DPU(Strategy):
    """Delayed Parameter Update; see the module docstring."""

    prepares_gradient = True  # it unscales and clips the gradient it commits (docs/contract.md)

    reshard_refusal = None  # the round in flight is drained first (overlap/machinery.py)

    lockstep = False  # see Strategy.lockstep

    predicts: ClassVar[bool] = False
    """Whether the update job installs a prediction rather than θ (``wp``): then the model does not hold θ."""

    finish_policy = (
        "drains the round in flight: the update on the last stage's gradients, already running, is waited for "
        "and committed (one more step; wp installs theta, not its prediction); an unfinished stage is dropped"
    )

    config: DPUConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.overlap = self.hold("overlap", Overlap.for_strategy(self, estimate=self.predicts,
                                                                 snapshot=self.predicts))
        self.shard, self.optimizer = self.overlap.sharded.shard, self.overlap.sharded.optimizer
        self.phase = "warmup" if self.config.sync_warmup_steps > 0 else "fill"
        """``warmup``, ``fill`` or ``overlap`` (see the module docstring)."""
        self.adapter: CapController | None = None
        if self.config.adapt:  # the stage cap re-picked during the run (adapt_cap.py)
            self.adapter = self.hold("adapt", CapController(self.transport, self.overlap, self.config, model,
                                                            self.param_groups, cost.wp if self.predicts else cost.dpu))

    def _step(self) -> bool:
        # timed only for --adapt's probe (adapt_cap.py): DPU and WP have no straggler rule to feed
        return self._advance() if self.adapter is None else self.overlap.timed_step(self._advance, self.adapter)

    def _advance(self) -> bool:
        o = self.overlap
        if self.phase == "warmup":
            if not o.start(self._job, self.steps, False, stage_scale(self), self.max_grad_norm):
                return False
            result = o.wait("sync_update")
            o.install()
            committed = collected(self, self.overlap, result)
            if self.steps >= self.config.sync_warmup_steps:
                self.phase = "fill"
            return committed
        if self.phase == "fill":
            if o.start(self._job, self.steps, True, stage_scale(self), self.max_grad_norm):
                self.phase = "overlap"
            return False
        if not o.stage_ready():
            return False
        scale = stage_scale(self)  # of the stage ending now (the scale changes only in _collected)
        result = o.wait("delayed_update")
        # P ← θ⁽ᵗ⁺¹⁾ (WP: θ̃⁽ᵗ⁺¹⁾), B ← gradients computed at the old P
        count = o.hand_over(install="estimate" if self.predicts else "committed")
        # a stage boundary (G empty): a new cap holds from the stage beginning now
        extra = {} if self.adapter is None else self.adapter.metrics(self.steps + 1, result)
        committed = collected(self, self.overlap, result, extra)
        # --adapt: this worker's link and micro-batch ride on the update job's count all-reduce (adapt_cap.py)
        probe = None if self.adapter is None else self.adapter.measure()
        o.submit(self._job, count, self.steps, True, scale, self.max_grad_norm, probe)
        return committed

    @property
    def steps_in_flight(self) -> int:
        return 0 if self.overlap.job is None else 1

    def _finish(self, sync: bool) -> None:
        o = self.overlap
        if o.behind_peers():  # the loop stopped this worker one stage short of a peer: end that stage now
            with o.ending_stage():
                self._step()
        if o.job is not None:  # the update on the last stage's gradients: its optimizer step is committed
            self._collect_last()
        o.install_committed(self.steps)  # wp: θ, not the prediction B holds
        o.drop_stage()
        if self.phase == "overlap":  # nothing in flight: a run resumed from here refills the pipeline
            self.phase = "fill"

    def _level(self) -> None:
        """:meth:`_finish`, except that the stage in progress is not dropped: its gradients (computed at the
        parameters before the update in flight, as every delayed update's are) go into one more update, run at
        once on every worker (one that computed nothing since its hand-over adds none). Nothing is in flight
        afterwards; the pipeline refills. Warm-up steps are blocking: nothing is in flight between two of them."""
        o = self.overlap
        if self.phase == "warmup":
            return
        if o.behind_peers():  # a peer ended one stage more: end this one now
            with o.ending_stage():
                self._step()
        if o.job is not None:
            self._collect_last()
        if self.transport.agree(o.stage_count, "max") > 0:  # the stage in progress, on every worker or none
            o.submit(self._job, o.hand_over(install=None), self.steps, True, stage_scale(self), self.max_grad_norm)
            self._collect_last()
        o.install_committed(self.steps)  # wp: θ, not the prediction B holds
        self.phase = "fill"

    def _collect_last(self) -> None:
        """Wait for the update in flight and count it; P ← θ⁽ᵗ⁺¹⁾ (wp: B holds the prediction, gathered later)."""
        o = self.overlap
        result = o.wait("delayed_update")
        if self.predicts:
            o.outdated()
        else:
            o.install()
        collected(self, self.overlap, result)  # (an fp16 overflow was skipped by the job on every worker: no step)

    def _update(self, local_count: int, step: int, scale: float | None, max_norm: float | None,
                probe: tuple[float, float] | None = None) -> tuple[list[int], dict[str, Any]]:
        """Job part: reduce, unscale, average, measure and clip; θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, ḡ) committed unless fp16
        found an overflow. Returns the counts and the result fields (``probe``: ``--adapt``'s pair, agreed with
        the counts)."""
        counts, total = self.overlap.reduce(local_count, "grads", probe)
        if scale is not None:
            self.shard.grad.div_(scale)
        self.shard.grad.div_(total)
        check = self.overlap.prepare(max_norm, scale is not None)
        skipped = check is not None and scale is not None and not check.finite
        if not skipped:
            self.overlap.commit_shard(self._lr_scale(step))
        return counts, {"kind": "update", "counts": counts, "check": check, "scale": scale, "skipped": skipped,
                        "probe": None if probe is None else self.overlap.last_probe}

    def _job(self, local_count: int, step: int, overlapped: bool, scale: float | None = None,
             max_norm: float | None = None, probe: tuple[float, float] | None = None) -> dict[str, Any]:
        """θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σg/ΣN), committed and all-gathered into B (the same job, overlapped or not)."""
        _, result = self._update(local_count, step, scale, max_norm, probe)
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

    # ------------------------------------------------------------------ checkpoints that reshard
    def _open_round(self) -> dict[str, int]:
        return {"stage_micro_batches": self.overlap.stage_count}

    def _logical_state(self) -> dict[str, torch.Tensor]:
        return {**self.overlap.logical_state(), "dpu.phase": torch.tensor(PHASES.index(self.phase)),
                **(self.adapter.logical_state() if self.adapter is not None else {})}

    def _logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        return {**self.overlap.logical_targets(saved), "dpu.phase": torch.zeros((), dtype=torch.int64),
                **(self.adapter.logical_targets(saved) if self.adapter is not None else {})}

    def _load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        self.overlap.load_logical(filled)
        self.phase = PHASES[int(filled["dpu.phase"])]
        if self.adapter is not None:
            self.adapter.load_logical(filled)
