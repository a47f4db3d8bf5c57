"""Held-out loss curves: fit ``L(t) = a + b·t^(−c)`` over tokens, with an uncertainty, and extrapolate to a target.

The form is the data term of the Chinchilla law (Hoffmann et al. 2022, ``E + B/D^β``) and of the learning curves
of Kaplan et al. (2020): a floor ``a`` the curve approaches, a power-law approach to it. A fit is
:func:`fit_power_law` on ``(tokens, loss)`` pairs: for each exponent ``c`` on a log grid the best ``a, b`` are a
linear least-squares problem (``b > 0``, ``0 ≤ a ≤`` the lowest loss seen), so the only search is over one number
(variable projection); the grid's best ``c`` is refined by golden-section search.

The uncertainty is a **moving-block residual bootstrap**: the fitted curve plus the residuals resampled in
blocks (consecutive evaluations of one run are correlated, so single-residual resampling would understate
it), refitted :data:`BOOTSTRAP` times; the interval of anything derived (tokens to a target, loss at a token
count) is the 10th–90th percentile over the refits. :meth:`CurveFit.tokens_to` says when the target lies
below the fitted floor (the curve is not predicted to reach it) and how often the refits reach it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..validate import check_float

BOOTSTRAP = 200
"""Bootstrap refits behind an interval."""
QUANTILES = (0.1, 0.9)
"""The interval's percentiles (an 80% interval)."""
C_GRID = np.exp(np.linspace(math.log(0.02), math.log(4.0), 160))
"""Exponents ``c`` tried before the golden-section refinement."""


@dataclass(frozen=True)
class PowerLaw:
    """``L(t) = a + b·(t + offset)^(−c)`` over tokens ``t``."""

    a: float
    """The floor the curve approaches (the loss after infinitely many tokens)."""
    b: float
    c: float
    offset: float = 0.0
    """Tokens the curve has already run at ``t = 0`` (0 for a fit): it then starts at ``a + b·offset^(−c)``."""

    def loss(self, tokens: float | np.ndarray) -> float | np.ndarray:
        # t^(−c) is infinite at 0 tokens
        return self.a + self.b * np.power(np.maximum(np.add(tokens, self.offset), 1.0), -self.c)

    def tokens_to(self, target: float) -> float:
        """Tokens at which the curve reaches ``target`` (``inf`` when the target is at or below the floor)."""
        if target <= self.a:
            return math.inf
        t = float((self.b / (target - self.a)) ** (1.0 / self.c)) - self.offset
        # a target at or above where a shifted curve starts is reached at once: one token, not 0 (a divisor)
        return max(t, 1.0) if self.offset else t


@dataclass(frozen=True)
class Interval:
    """An estimate with its interval (``low`` ≤ ``value`` ≤ ``high``; ``inf`` where not reached)."""

    value: float
    low: float
    high: float

    def scaled(self, k: float) -> Interval:
        return Interval(self.value * k, self.low * k, self.high * k)

    @property
    def finite(self) -> bool:
        return math.isfinite(self.value)


@dataclass(frozen=True)
class Reach:
    """Tokens to a target from a fit: the estimate, its interval, and how sure the fit is that it gets there."""

    tokens: Interval
    reached_fraction: float
    """Fraction of the bootstrap refits whose floor lies below the target."""

    @property
    def reachable(self) -> bool:
        """Whether the fit predicts the target is reached (its own floor lies below it)."""
        return self.tokens.finite


@dataclass(frozen=True)
class CurveFit:
    """A fitted curve, the data it was fitted to and its bootstrap refits."""

    law: PowerLaw
    tokens: tuple[float, ...]
    losses: tuple[float, ...]
    rms: float
    """Root-mean-square residual of the fit (loss units)."""
    refits: tuple[PowerLaw, ...] = field(default=(), repr=False)

    @property
    def last_tokens(self) -> float:
        return self.tokens[-1] if self.tokens else 0.0

    def loss_at(self, tokens: float) -> Interval:
        """The fitted loss at ``tokens`` and its interval over the refits."""
        values = np.array([float(r.loss(tokens)) for r in self.refits]) if self.refits else np.array([])
        value = float(self.law.loss(tokens))
        if not len(values):
            return Interval(value, value, value)
        lo, hi = _quantiles(values)
        # the refits' percentiles need not bracket the fit itself: the interval always holds it
        return Interval(value, min(value, float(lo)), max(value, float(hi)))

    def tokens_to(self, target: float) -> Reach:
        """Tokens to ``target``: the fit's, and the interval over the refits (``inf`` where a refit's floor is at or
        above the target)."""
        value = self.law.tokens_to(target)
        if not self.refits:
            return Reach(Interval(value, value, value), 1.0 if math.isfinite(value) else 0.0)
        each = np.array([r.tokens_to(target) for r in self.refits])
        reached = float(np.mean(np.isfinite(each)))
        lo, hi = _quantiles(each)  # inf sorts last: a high quantile past the reached share is inf
        lo = min(value, float(lo))
        hi = max(value, float(hi))
        return Reach(Interval(value, lo, hi), reached)


def _quantiles(values: np.ndarray) -> tuple[float, float]:
    """The :data:`QUANTILES` of ``values`` by rank (``inf`` allowed: no interpolation across it)."""
    v = np.sort(values)
    n = len(v)
    return tuple(float(v[min(n - 1, max(0, int(round(q * (n - 1)))))]) for q in QUANTILES)  # type: ignore[return-value]


def _solve_ab(x: np.ndarray, y: np.ndarray, a_max: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least squares ``y ≈ a + b·x`` along the first axis (the points), for every other index of ``x`` and ``y``
    (broadcast together: exponents, curves), with ``b ≥ 0`` and ``0 ≤ a ≤ a_max``; returns ``a``, ``b`` and the
    sum of squared residuals, shaped as the broadcast minus the points."""
    xm, ym = x.mean(0), y.mean(0)
    sxx = ((x - xm) ** 2).sum(0)
    sxy = ((x - xm) * (y - ym)).sum(0)
    # np.where computes both branches: the inner one keeps a zero sxx out of the division
    b = np.where(sxx > 0, sxy / np.where(sxx > 0, sxx, 1.0), 0.0)
    b = np.maximum(b, 0.0)
    a = ym - b * xm
    # the floor is a loss: between 0 and the lowest loss seen; where it is clipped, b is refitted for that a
    clipped = (a < 0) | (a > a_max)
    if clipped.any():
        a_c = np.clip(a, 0.0, a_max)
        sx2 = (x * x).sum(0)
        b_c = np.where(sx2 > 0, ((y - a_c) * x).sum(0) / np.where(sx2 > 0, sx2, 1.0), 0.0)
        a = np.where(clipped, a_c, a)
        b = np.where(clipped, np.maximum(b_c, 0.0), b)
    sse = ((y - a - b * x) ** 2).sum(0)
    return a, b, sse


def _best(t: np.ndarray, ys: np.ndarray, floor_cap: float = 1.0) -> tuple[list[PowerLaw], np.ndarray]:
    """The least-squares power law of ``(t, y)`` with ``a ≤ floor_cap·min(y)`` for every column ``y`` of ``ys``
    (points × curves) and its sum of squared residuals: the exponent grid for all curves in one pass, then one
    golden-section search per curve, all curves' brackets stepped together (the bootstrap's refits share ``t``)."""
    curves = ys.shape[1]
    a_max = floor_cap * ys.min(0)
    logt = np.log(np.maximum(t, 1.0))
    x = np.exp(-np.outer(logt, C_GRID))
    a, b, sse = _solve_ab(x[:, :, None], ys[:, None, :], a_max)  # (exponents, curves)
    i = np.argmin(sse, axis=0)
    every = np.arange(curves)

    def sse_at(c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return _solve_ab(np.exp(-logt[:, None] * c), ys, a_max)

    lo = C_GRID[np.maximum(0, i - 1)]
    hi = C_GRID[np.minimum(len(C_GRID) - 1, i + 1)]
    g = (math.sqrt(5) - 1) / 2
    c1, c2 = hi - g * (hi - lo), lo + g * (hi - lo)
    f1, f2 = sse_at(c1)[2], sse_at(c2)[2]
    # 40 steps shrink each bracket to 0.618^40 ≈ 4e-9 of its width
    for _ in range(40):  # golden section on the bracket around each curve's best grid exponent
        left = f1 < f2  # the minimum lies in [lo, c2]: c1 becomes the upper probe; else in [c1, hi]
        hi = np.where(left, c2, hi)
        lo = np.where(left, lo, c1)
        kept_c, kept_f = np.where(left, c1, c2), np.where(left, f1, f2)
        new_c = np.where(left, hi - g * (hi - lo), lo + g * (hi - lo))
        new_f = sse_at(new_c)[2]
        c1, f1 = np.where(left, new_c, kept_c), np.where(left, new_f, kept_f)
        c2, f2 = np.where(left, kept_c, new_c), np.where(left, kept_f, new_f)
    c = (lo + hi) / 2
    ac, bc, s = sse_at(c)
    grid = s > sse[i, every]  # the grid point was better (flat objective)
    c, s = np.where(grid, C_GRID[i], c), np.where(grid, sse[i, every], s)
    ac, bc = np.where(grid, a[i, every], ac), np.where(grid, b[i, every], bc)
    return [PowerLaw(float(ac[k]), float(bc[k]), float(c[k])) for k in range(curves)], s


def fit_power_law(tokens: Sequence[float], losses: Sequence[float], *, bootstrap: int = BOOTSTRAP,
                  seed: int = 0, floor_cap: float = 1.0) -> CurveFit:
    """Fit ``L(t) = a + b·t^(−c)`` to held-out losses at token counts (see the module docstring), the floor ``a``
    between 0 and ``floor_cap`` times the lowest loss seen.

    Needs at least 4 points with positive, increasing token counts and finite losses; raises ``ValueError``
    otherwise."""
    t = np.asarray(tokens, dtype=float)
    y = np.asarray(losses, dtype=float)
    if t.shape != y.shape or t.ndim != 1:
        raise ValueError(f"tokens and losses must be two sequences of one length, got {t.shape} and {y.shape}")
    keep = np.isfinite(y) & (t > 0)
    t, y = t[keep], y[keep]
    if len(t) < 4:
        raise ValueError(f"a loss curve fit needs at least 4 evaluations after the first token, got {len(t)}")
    if np.any(np.diff(t) <= 0):
        raise ValueError("a loss curve's token counts must increase")
    check_float("floor_cap", floor_cap, 0, 1)
    (law,), (sse,) = _best(t, y[:, None], floor_cap)
    fitted = np.asarray(law.loss(t))
    resid = y - fitted
    rms = math.sqrt(sse / len(t))
    refits: list[PowerLaw] = []
    if bootstrap > 0:
        rng = np.random.default_rng(seed)  # seeded: the same evaluations give the same interval in every plan
        n = len(t)
        block = max(1, n // 5)
        starts = np.arange(0, n - block + 1)
        # -(-n // block) is ceil(n / block): enough blocks to cover every point, the excess cut off
        samples = [fitted + np.concatenate([resid[s:s + block] for s in rng.choice(starts, size=-(-n // block))])[:n]
                   for _ in range(bootstrap)]
        refits = _best(t, np.stack(samples, axis=1), floor_cap)[0]
    return CurveFit(law, tuple(float(v) for v in t), tuple(float(v) for v in y), rms, tuple(refits))


__all__ = ["BOOTSTRAP", "CurveFit", "Interval", "PowerLaw", "Reach", "fit_power_law"]
