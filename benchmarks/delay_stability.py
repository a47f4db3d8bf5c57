"""How far a one-step gradient delay shrinks the stable learning rate of SGD with heavy-ball momentum.

Paper 002's rules on a quadratic ``f(θ) = λθ²/2`` (one curvature direction), with PyTorch's SGD momentum
(``b ← βb + g``, ``θ ← θ − ηb``) and the step's gradient taken partly at the fresh parameters and partly at the
previous ones: ``g_c = λ(a·θ_c + (1 − a)·θ_{c−1})``. ``a`` is the fraction of the step's micro-batches that
read the fresh version of the stage: dp ``a = 1``, CDP-v1 ``a = 0``, CDP-v2 stage ``j`` (1-based) of ``N``
``a = j/N`` (micro-batch ``i`` reads the fresh stage iff ``j ≥ N − i + 1``). Writing ``κ = ηλ``::

    θ_{c+1} = (1 + β − aκ)·θ_c − (β + (1 − a)κ)·θ_{c−1}

and Jury's conditions for ``z² − (1 + β − aκ)z + β + (1 − a)κ`` give the largest stable ``κ``::

    κ* = min((1 − β)/(1 − a)  [a < 1],   2(1 + β)/(2a − 1)  [a > 1/2])

dp: ``2(1 + β)`` (3.8 at β = 0.9); CDP-v1: ``1 − β`` (0.1 at β = 0.9) — 38× smaller; with β = 0 the gap is
only 2×. :func:`simulated_threshold` checks the closed form independently: it runs the paper's rules
micro-batch by micro-batch on a quadratic per stage and bisects on the measured growth rate.
"""

from __future__ import annotations

import math


def threshold(beta: float, fresh: float) -> float:
    """Largest stable ``κ = ηλ`` for heavy-ball momentum ``beta`` when a fraction ``fresh`` of the gradient is
    taken at the current parameters and the rest at the previous step's (closed form, see the module doc)."""
    bounds = []
    if fresh < 1:
        bounds.append((1 - beta) / (1 - fresh))
    if fresh > 0.5:
        bounds.append(2 * (1 + beta) / (2 * fresh - 1))
    return min(bounds) if bounds else math.inf


def fresh_fraction(rule: str, n: int, stage: int) -> float:
    """Fraction of the ``n`` micro-batches whose gradient of 1-based ``stage`` is taken at the fresh version."""
    if rule == "dp":
        return 1.0
    if rule == "v1":
        return 0.0
    return sum(1 for i in range(1, n + 1) if stage >= n - i + 1) / n


def growth_rate(rule: str, n: int, stage: int, beta: float, kappa: float, steps: int = 20000) -> float:
    """Per-step growth factor of ``θ`` (spectral radius, measured) when training stage ``stage`` of ``n`` on
    ``f_i(θ) = λθ²/2`` for every micro-batch ``i`` with rule ``rule``, momentum ``beta``, ``ηλ = kappa``."""
    eta, lam = kappa, 1.0
    theta, prev, buf = 1.0, 1.0, 0.0  # θ_{−1} := θ_0
    log_growth, burn = 0.0, steps // 4
    for c in range(steps):
        grads = []
        for i in range(1, n + 1):  # the paper's rules, micro-batch by micro-batch
            if rule == "dp":
                at = theta
            elif rule == "v1":
                at = prev
            else:
                at = theta if stage >= n - i + 1 else prev
            grads.append(lam * at)
        g = sum(grads) / n
        buf = beta * buf + g
        prev, theta = theta, theta - eta * buf
        scale = math.hypot(theta, prev)  # renormalise the state (θ_c, θ_{c−1}, b) to measure the growth rate
        if scale == 0:
            return 0.0
        theta, prev, buf = theta / scale, prev / scale, buf / scale
        if c >= burn:
            log_growth += math.log(scale)
    return math.exp(log_growth / (steps - burn))


def simulated_threshold(rule: str, n: int, stage: int, beta: float, hi: float = 16.0, tol: float = 1e-3) -> float:
    """The ``κ`` where :func:`growth_rate` crosses 1, by bisection (relative tolerance ``tol``)."""
    lo = 1e-4
    while hi / lo > 1 + tol:
        mid = math.sqrt(lo * hi)
        if growth_rate(rule, n, stage, beta, mid) > 1.0 + 1e-5:
            hi = mid
        else:
            lo = mid
    return math.sqrt(lo * hi)


def table(n: int = 4, betas: tuple[float, ...] = (0.9, 0.0), simulate: bool = True) -> list[dict]:
    """Closed-form and simulated thresholds for dp, CDP-v1 and every stage of CDP-v2."""
    rows = []
    for beta in betas:
        cases = [("dp", 1), ("v1", 1)] + [("v2", j) for j in range(1, n + 1)]
        for rule, stage in cases:
            a = fresh_fraction(rule, n, stage)
            row = {"beta": beta, "rule": rule, "stage": stage if rule == "v2" else None, "fresh": a,
                   "kappa_closed_form": threshold(beta, a)}
            if simulate:
                row["kappa_simulated"] = simulated_threshold(rule, n, stage, beta)
            rows.append(row)
    return rows
