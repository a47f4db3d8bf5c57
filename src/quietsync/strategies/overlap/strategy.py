"""The base class of the overlap family's strategies (acco, dpu, wp): what they share around the background job.

Each runs its optimizer step as a job on the communication thread (:mod:`.machinery`) and commits the job's
result on the training thread; :class:`OverlapStrategy` holds the two pieces that are the same for all of them —
the fp16 loss scale a stage's micro-batches carry, and the commit of a job's result (or nothing, when the job
found an fp16 overflow and skipped the step on every worker).
"""

from __future__ import annotations

from typing import Any

from ..base import Strategy
from .machinery import Overlap


class OverlapStrategy(Strategy):
    """A strategy whose step runs as a background job on an :class:`~.machinery.Overlap` (``self.overlap``)."""

    reshard_refusal = None  # the round in flight is drained first (overlap/machinery.py)

    lockstep = False  # see Strategy.lockstep: workers may be a stage apart

    overlap: Overlap

    def _stage_scale(self) -> float | None:
        """The fp16 loss scale the current stage's micro-batches carry (None without fp16)."""
        return None if self.scaler is None else self.scaler.scale

    def _collected(self, result: dict[str, Any]) -> bool:
        """Commit the job's step, or — an fp16 overflow, skipped by the job on every worker — nothing."""
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
