"""Streaming DiLoCo's fragments: the model's parameter tensors split into groups synced at staggered steps, and
the schedule of those syncs.

Two patterns (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", the fragment patterns):

* ``contiguous`` -- :func:`split_fragments`: consecutive parameter tensors, balanced by element count;
* ``strided`` -- :func:`strided_fragments` over :func:`~quietsync.models.units.layer_units`: whole layers, layer
  ``l`` in fragment ``l mod F``, so every fragment holds layers from the whole depth of the network.

:class:`FragmentSchedule`: fragment f is synced after inner steps ``s`` with ``s mod H == ((f+1)·H/F) mod H``
(every H steps, fragments staggered by H/F).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...comm_worker import Job
from ...validate import check_int


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Indices of the tensors of each of ``fragments`` contiguous, non-empty fragments, balanced by element
    count (fragment k starts at the first tensor with at least k/F of all elements before it)."""
    check_int("fragments", fragments, 1, len(sizes))
    n, total = len(sizes), sum(sizes)
    before = [sum(sizes[:i]) for i in range(n)]
    bounds = [0]
    for k in range(1, fragments):
        b = next((i for i in range(n) if before[i] >= k * total / fragments), n)
        bounds.append(min(max(b, bounds[-1] + 1), n - (fragments - k)))
    bounds.append(n)
    return [list(range(bounds[k], bounds[k + 1])) for k in range(fragments)]


FRAGMENT_PATTERNS = ("contiguous", "strided")


def strided_fragments(units: list[list[int]], fragments: int) -> list[list[int]]:
    """Streaming DiLoCo's strided pattern: layer ``l`` goes to fragment ``l mod F`` (indices ascending)."""
    check_int("fragments", fragments, 1, len(units))
    return [sorted(i for u in units[f::fragments] for i in u) for f in range(fragments)]


class FragmentSchedule:
    """When each of ``fragments`` fragments syncs: every ``sync_every`` (H) inner steps, staggered by H/F."""

    def __init__(self, sync_every: int, fragments: int) -> None:
        self.H, self.F = sync_every, fragments

    def due(self, step: int) -> list[int]:
        """Fragments whose sync launches after inner step ``step`` (1-based)."""
        return [f for f in range(self.F) if step % self.H == ((f + 1) * self.H // self.F) % self.H]

    def last_launch(self, f: int, step: int) -> int:
        """The inner step after which fragment ``f``'s latest sync launched, at or before ``step`` (0: none)."""
        first = ((f + 1) * self.H // self.F) % self.H or self.H
        return 0 if step < first else first + (step - first) // self.H * self.H


@dataclass
class Pending:
    """The fragment whose sync is in flight (``overlap_delay`` τ > 0)."""

    fragment: int
    apply_after: int
    """Inner step after which its merge is applied."""
    job: Job | None
    """The outer step running on the communication worker; None once it finished."""
    patience_s: float | None = None
    """How long the job may wait for slower workers before its collectives (arrival.py); None: it does not."""
