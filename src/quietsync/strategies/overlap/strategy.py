"""What the overlap family's strategies (acco, dpu, wp) share around their background job, as functions.

Each runs its optimizer step as a job on the communication thread (:mod:`.machinery`) and commits the job's
result on the training thread. The pieces that are the same for all of them — the fp16 loss scale a stage's
micro-batches carry, and the commit of a job's result (or nothing, when the job found an fp16 overflow and
skipped the step on every worker) — live here once. Functions rather than a base class: strategies stay at most
two levels below :class:`~quietsync.strategies.base.Strategy` (wp is a dpu).
"""

from __future__ import annotations

from typing import Any

from ..base import Strategy
from .machinery import Overlap


def stage_scale(strategy: Strategy) -> float | None:
    """The fp16 loss scale the current stage's micro-batches carry (None without fp16)."""
    return None if strategy.scaler is None else strategy.scaler.scale


def collected(strategy: Strategy, overlap: Overlap, result: dict[str, Any], extra: dict[str, Any] | None = None
              ) -> bool:
    """Commit the job's step on ``strategy`` (``extra``: more entries of its metrics' ``extra``, e.g. an ``--adapt``
    decision), or — an fp16 overflow, skipped by the job on every worker — nothing (the overlap's pending record
    is dropped). Returns whether a step was committed."""
    check = result.get("check")
    extras: dict[str, Any] | None = {}
    if check is not None:
        extras = strategy._gradient_extras(check, result["scale"])  # noqa: SLF001 - the family's own commit path
        if extras is None:
            overlap.drop_pending()
            return False
    record, local = overlap.step_record()
    strategy._commit({**record, **extras, **(extra or {})}, local)  # noqa: SLF001
    return True
