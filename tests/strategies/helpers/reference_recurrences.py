"""Plain single-process reference implementations of DPU, WP and ACCO (papers 000 and 003).

Written from the papers' equations, independently of the library: N workers are simulated by a loop,
parameters are a list of tensors, gradients come from ``torch.autograd.grad`` and the optimizers (SGD with
momentum, AdamW) are pure functions ``(params, grad, state, lr) -> (params, state)`` so that an *estimate*
(ACCO's θ̃⁽ᵗ⁺¹⁾, WP's prediction) is simply a call whose returned state is thrown away.

Conventions shared with the distributed tests:

* ``batches[i]`` is an iterator over worker ``i``'s micro-batches, consumed in order.
* ``counts(i)`` is the number of micro-batches worker ``i`` accumulates in one stage (deterministic mode);
  the same count is used for the initial stage (Algorithm 1, line 2) and for each warm-up step. ``counts``
  may instead be a sequence with one entry per stage, in the order the stages are computed, each a list of
  per-worker counts (to replay an adaptive run whose counts varied).
* A micro-batch gradient is the gradient of the micro-batch's mean loss; a stage's gradient is the sum of
  the micro-batch gradients of all workers divided by the global micro-batch count (ΣᵢNᵢ).
* ``lr(s)`` is the learning rate used by an optimizer step taken when ``s`` steps have been committed.

Recurrences (paper 000 Sec. 3, paper 003 eq. DPU / WP / ACCO, Algorithm 1):

* DPU   : gᵢ⁽ᵗ⁾ at θ⁽ᵗ⁾ ‖ θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σgᵢ⁽ᵗ⁻¹⁾/ΣNᵢ⁽ᵗ⁻¹⁾), g⁽⁻¹⁾ computed at θ⁽⁰⁾;
          ``warmup`` non-delayed steps θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, ḡ(θ⁽ᵗ⁾)) come first.
* WP    : like DPU but the gradients of round t+1 are computed at θ̃⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁺¹⁾, ḡ⁽ᵗ⁾), a second
          optimizer step with the same gradient whose state is never committed; θ̃ of the first round is θ⁽⁰⁾.
* ACCO  : (1) gᵢ⁽ᵗ⁾ at θ⁽ᵗ⁾ ‖ θ̃⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σg̃ᵢ⁽ᵗ⁾/ΣÑᵢ⁽ᵗ⁾)  (state not committed)
          (2) g̃ᵢ⁽ᵗ⁺¹⁾ at θ̃⁽ᵗ⁺¹⁾ ‖ θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σ(gᵢ⁽ᵗ⁾+g̃ᵢ⁽ᵗ⁾)/Σ(Nᵢ⁽ᵗ⁾+Ñᵢ⁽ᵗ⁾))
          with g̃ᵢ⁽⁰⁾ computed at θ⁽⁰⁾ (Algorithm 1, line 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

Params = list[torch.Tensor]
LossFn = Callable[[Params, object], torch.Tensor]


# ----------------------------------------------------------------------------------------------------------
# Pure optimizers (torch.optim semantics, written out)
# ----------------------------------------------------------------------------------------------------------
def _per_param(value: float | list[float], params: Params) -> list[float]:
    return list(value) if isinstance(value, (list, tuple)) else [value] * len(params)


@dataclass
class SGDRef:
    """SGD with momentum and L2 weight decay, as torch.optim.SGD (dampening 0, no Nesterov)."""

    momentum: float = 0.0
    weight_decay: float | list[float] = 0.0
    """One value, or one per parameter (to mirror parameter groups)."""

    def init(self, params: Params) -> dict:
        return {"buf": None}

    def step(self, params: Params, grad: Params, state: dict, lr: float) -> tuple[Params, dict]:
        wd = _per_param(self.weight_decay, params)
        d = [g + w * p if w else g.clone() for p, g, w in zip(params, grad, wd)]
        if self.momentum:
            if state["buf"] is None:
                buf = [x.clone() for x in d]
            else:
                buf = [self.momentum * b + x for b, x in zip(state["buf"], d)]
            d = buf
            state = {"buf": buf}
        return [p - lr * x for p, x in zip(params, d)], state


@dataclass
class AdamWRef:
    """AdamW (Loshchilov & Hutter), as torch.optim.AdamW with amsgrad=False."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float | list[float] = 0.01
    """One value, or one per parameter (to mirror parameter groups)."""

    def init(self, params: Params) -> dict:
        return {
            "step": 0,
            "m": [torch.zeros_like(p) for p in params],
            "v": [torch.zeros_like(p) for p in params],
        }

    def step(self, params: Params, grad: Params, state: dict, lr: float) -> tuple[Params, dict]:
        b1, b2 = self.betas
        step = state["step"] + 1
        m = [b1 * m + (1 - b1) * g for m, g in zip(state["m"], grad)]
        v = [b2 * v + (1 - b2) * g * g for v, g in zip(state["v"], grad)]
        bc1 = 1 - b1**step
        bc2 = 1 - b2**step
        out = []
        for p, mi, vi, w in zip(params, m, v, _per_param(self.weight_decay, params)):
            p = p * (1 - lr * w)
            denom = vi.sqrt() / math.sqrt(bc2) + self.eps
            out.append(p - (lr / bc1) * mi / denom)
        return out, {"step": step, "m": m, "v": v}


# ----------------------------------------------------------------------------------------------------------
# Gradients of one stage, summed over simulated workers
# ----------------------------------------------------------------------------------------------------------
@dataclass
class Trace:
    """What a reference run produced: θ after each committed step and the parameters each stage used."""

    committed: list[Params] = field(default_factory=list)
    compute_params: list[Params] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


class _Counts:
    """Per-stage micro-batch counts: a fixed ``counts(i)`` or one list of per-worker counts per stage."""

    def __init__(self, counts) -> None:
        self.counts = counts
        self.stage = 0

    def next(self) -> Callable[[int], int]:
        k = self.stage
        self.stage += 1
        if callable(self.counts):
            return self.counts
        if k >= len(self.counts):  # a stage whose gradient is never applied: its count does not matter
            return lambda i: 1
        row = self.counts[k]
        return lambda i: int(row[i])


def stage_gradient(
    params: Params,
    loss_fn: LossFn,
    batches: Sequence[Iterator],
    counts,
    trace: Trace | None = None,
) -> tuple[Params, int]:
    """Σᵢ Σₖ ∇F(θ, ξᵢₖ) over workers i and their ``counts(i)`` micro-batches, and ΣᵢNᵢ."""
    if isinstance(counts, _Counts):
        counts = counts.next()
    total = [torch.zeros_like(p) for p in params]
    n = 0
    leaf = [p.detach().clone().requires_grad_(True) for p in params]
    for i, it in enumerate(batches):
        for _ in range(counts(i)):
            loss = loss_fn(leaf, next(it))
            grads = torch.autograd.grad(loss, leaf)
            total = [t + g for t, g in zip(total, grads)]
            n += 1
    if trace is not None:
        trace.compute_params.append([p.detach().clone() for p in params])
        trace.counts.append(n)
    return total, n


def _scale(g: Params, n: int) -> Params:
    return [x / n for x in g]


def _add(a: Params, b: Params) -> Params:
    return [x + y for x, y in zip(a, b)]


def _copy(p: Params) -> Params:
    return [x.detach().clone() for x in p]


# ----------------------------------------------------------------------------------------------------------
# The recurrences
# ----------------------------------------------------------------------------------------------------------
def synchronous_reference(
    params0: Params, loss_fn: LossFn, batches, opt, steps: int, counts, lr: Callable[[int], float]
) -> Trace:
    """DDP / ZeRO-1: θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, ḡ(θ⁽ᵗ⁾))."""
    trace = Trace()
    counts = _Counts(counts)
    theta, state = _copy(params0), opt.init(params0)
    for t in range(steps):
        g, n = stage_gradient(theta, loss_fn, batches, counts, trace)
        theta, state = opt.step(theta, _scale(g, n), state, lr(t))
        trace.committed.append(_copy(theta))
    return trace


def dpu_reference(
    params0: Params,
    loss_fn: LossFn,
    batches,
    opt,
    steps: int,
    counts,
    lr: Callable[[int], float],
    warmup: int = 0,
    predict: bool = False,
) -> Trace:
    """DPU (``predict=False``) or WP (``predict=True``), after ``warmup`` non-delayed steps.

    Round t ≥ warmup: gradients are computed at ``at`` (θ⁽ᵗ⁾ for DPU; the prediction θ̃⁽ᵗ⁾ for WP, equal to
    θ⁽ᵗ⁾ in the first overlapped round) while θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, previous round's gradient).
    """
    trace = Trace()
    counts = _Counts(counts)
    theta, state = _copy(params0), opt.init(params0)
    t = 0
    while t < min(warmup, steps):
        g, n = stage_gradient(theta, loss_fn, batches, counts, trace)
        theta, state = opt.step(theta, _scale(g, n), state, lr(t))
        trace.committed.append(_copy(theta))
        t += 1
    if t >= steps:
        return trace
    at = _copy(theta)
    pending = stage_gradient(at, loss_fn, batches, counts, trace)  # g⁽⁻¹⁾ of the overlapped phase
    while t < steps:
        current = stage_gradient(at, loss_fn, batches, counts, trace)  # computed while the update runs
        g_prev = _scale(*pending)
        theta, state = opt.step(theta, g_prev, state, lr(t))
        trace.committed.append(_copy(theta))
        t += 1
        if predict:
            at, _ = opt.step(theta, g_prev, state, lr(t))  # second step, state discarded
        else:
            at = _copy(theta)
        pending = current
    return trace


def acco_reference(
    params0: Params,
    loss_fn: LossFn,
    batches,
    opt,
    steps: int,
    counts,
    lr: Callable[[int], float],
    stage2_counts=None,
) -> Trace:
    """ACCO, eq. (1)-(2) of paper 000 / eq. ACCO of paper 003, initialised as in Algorithm 1.

    ``counts`` gives each worker's micro-batches in stage 1 and in the initial stage, ``stage2_counts``
    (default: the same) in stage 2.
    """
    if stage2_counts is not None and callable(counts):
        c1, c2 = counts, stage2_counts
        counts = _Counts(lambda i: c1(i))
        stage2_counts = _Counts(lambda i: c2(i))
    else:
        counts = stage2_counts = _Counts(counts)
    trace = Trace()
    theta, state = _copy(params0), opt.init(params0)
    g_tilde, n_tilde = stage_gradient(theta, loss_fn, batches, counts, trace)  # g̃⁽⁰⁾ at θ⁽⁰⁾
    for t in range(steps):
        # Stage 1: g⁽ᵗ⁾ at θ⁽ᵗ⁾ ‖ θ̃⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σg̃/ΣÑ), optimizer state not committed.
        g, n = stage_gradient(theta, loss_fn, batches, counts, trace)
        theta_tilde, _ = opt.step(theta, _scale(g_tilde, n_tilde), state, lr(t))
        # Stage 2: g̃⁽ᵗ⁺¹⁾ at θ̃⁽ᵗ⁺¹⁾ ‖ θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σ(g+g̃)/Σ(N+Ñ)), committed.
        g_tilde_next, n_tilde_next = stage_gradient(theta_tilde, loss_fn, batches, stage2_counts, trace)
        theta, state = opt.step(theta, _scale(_add(g, g_tilde), n + n_tilde), state, lr(t))
        trace.committed.append(_copy(theta))
        g_tilde, n_tilde = g_tilde_next, n_tilde_next
    return trace
