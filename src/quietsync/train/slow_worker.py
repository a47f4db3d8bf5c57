"""Simulated slow workers (``--slow-worker RANK:FACTOR``).

As in the ACCO paper's heterogeneity experiments, a worker is made ``FACTOR`` times slower by sleeping,
after each of its micro-batches, ``(FACTOR - 1)`` times the compute time that micro-batch measured. The
sleep happens on the main (compute) thread, so a strategy sees it as compute time, like a slower device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..validate import check_float, check_int


@dataclass(frozen=True)
class SlowWorker:
    """Make worker ``rank`` ``factor`` times slower."""

    rank: int
    """Global rank of the slowed worker."""
    factor: float
    """Slow-down factor (>= 1; 1 means no slow-down)."""

    def __post_init__(self) -> None:
        check_int("slow_worker rank", self.rank, 0)
        check_float("slow_worker factor", self.factor, 1)


def parse_slow_worker(spec: str) -> SlowWorker:
    """Parse ``"RANK:FACTOR"`` (e.g. ``"1:2.5"``)."""
    rank_s, sep, factor_s = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        rank, factor = int(rank_s), float(factor_s)
    except ValueError:
        raise ValueError(f"slow_worker must look like RANK:FACTOR (e.g. 1:2.0), got {spec!r}") from None
    return SlowWorker(rank, factor)


class MicroBatchTimer:
    """Times each micro-batch of this worker and sleeps after it when this worker is the slow one."""

    def __init__(self, slow: SlowWorker | None, rank: int, device: torch.device | None = None) -> None:
        self.factor = slow.factor if slow is not None and slow.rank == rank else 1.0
        self.device = device
        self.slept_s = 0.0
        """Total seconds slept so far."""
        self._t0 = 0.0

    @property
    def active(self) -> bool:
        """Whether this worker is slowed down."""
        return self.factor > 1.0

    def start(self) -> None:
        """Mark the start of a micro-batch."""
        if self.active:
            self._sync()
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        """End of the micro-batch: sleep ``(factor - 1)`` × its compute time; return the seconds slept."""
        if not self.active:
            return 0.0
        self._sync()
        pause = (self.factor - 1.0) * (time.perf_counter() - self._t0)
        time.sleep(pause)
        self.slept_s += pause
        return pause

    def _sync(self) -> None:
        # CUDA runs asynchronously: wait for the queued kernels, so the time is the micro-batch's
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
