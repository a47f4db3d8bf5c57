"""Fitting an alpha-beta link to measured transfer times.

Each measurement is one transfer: ``messages`` on its critical path, ``bytes`` each worker sent (both from
:func:`quietsync.link.traffic`, as the transport counts them) and the seconds it took. The model is
``seconds = messages·α + bytes/β``, linear in ``(α, 1/β)``:

1. ``1/β`` (and a first α) by least squares on the seconds themselves, both kept ≥ 0 — the large transfers
   dominate, as they dominate a training step's communication time;
2. α again, as the median over the smallest third of the transfers of ``(seconds − bytes/β) / messages``
   (≥ 0): what a small message costs beyond its bytes.

Fitting relative errors instead would let the many small transfers set β — and a shaped link's token bucket
(``tc tbf ... burst 64kb``) lets transfers below its burst through at line rate, which is not the rate a
megabyte gradient sees.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..link import LinkModel


@dataclass(frozen=True)
class Sample:
    """One measured transfer."""

    kind: str
    """``all_reduce``, ``exchange``... (for reports)."""
    messages: int
    """Messages on the critical path (α terms)."""
    nbytes: int
    """Bytes each worker sent."""
    seconds: float
    """How long it took."""


@dataclass(frozen=True)
class Fit:
    """A fitted link and how well it explains the samples."""

    link: LinkModel
    """α (latency) and β (bandwidth) as a :class:`~quietsync.link.LinkModel`."""
    rel_error: float
    """Median of |predicted − measured| / measured over the samples."""
    samples: int


def fit_link(samples: Sequence[Sample]) -> Fit:
    """α ≥ 0 and β > 0 for ``samples`` (see the module docstring); raises ``ValueError`` without at least one
    sample that moved bytes."""
    # a sample timed at 0 s says nothing, and the relative error below divides by its seconds
    rows = [(s.messages, s.nbytes, s.seconds) for s in samples if s.seconds > 0]
    if not any(b > 0 for _, b, _ in rows):
        raise ValueError("fit_link needs at least one sample that moved bytes")
    a, x = _nnls2([(m, b) for m, b, _ in rows], [t for _, _, t in rows])
    if x <= 0:  # every sample looked free of bandwidth cost: take the largest transfer's rate as the bound
        m, b, t = max(rows, key=lambda r: r[1])
        x = max(t - m * a, t * 1e-6) / b
    small = sorted(rows, key=lambda r: r[1])[: max(1, len(rows) // 3)]
    latencies = sorted(max(0.0, (t - b * x) / m) for m, b, t in small if m > 0)
    if latencies:
        a = latencies[len(latencies) // 2]
    link = LinkModel(1.0 / x, a)
    errors = sorted(abs(m * a + b * x - t) / t for m, b, t in rows)
    return Fit(link, errors[len(errors) // 2], len(rows))


def _nnls2(A: list[tuple[float, float]], y: list[float]) -> tuple[float, float]:
    """Non-negative least squares with two unknowns: the unconstrained solution if both are ≥ 0, else the best
    with one of them at 0."""
    s11 = sum(a * a for a, _ in A)
    s12 = sum(a * b for a, b in A)
    s22 = sum(b * b for _, b in A)
    r1 = sum(a * v for (a, _), v in zip(A, y))
    r2 = sum(b * v for (_, b), v in zip(A, y))
    det = s11 * s22 - s12 * s12
    # relative to the columns' scale: nearly collinear ones make the solve unstable
    if det > 1e-12 * max(s11 * s22, 1e-300):
        p, q = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
        if p >= 0 and q >= 0:
            return p, q
    only_p = (max(0.0, r1 / s11), 0.0) if s11 > 0 else (0.0, 0.0)
    only_q = (0.0, max(0.0, r2 / s22)) if s22 > 0 else (0.0, 0.0)

    def resid(pq: tuple[float, float]) -> float:
        return sum((a * pq[0] + b * pq[1] - v) ** 2 for (a, b), v in zip(A, y))

    best = min((only_p, only_q), key=resid)
    return best if math.isfinite(best[0]) and math.isfinite(best[1]) else (0.0, 0.0)
