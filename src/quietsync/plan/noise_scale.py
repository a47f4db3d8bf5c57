"""The gradient noise scale of the user's own model, measured from the baseline's pilot.

McCandlish et al. (2018), "An Empirical Model of Large-Batch Training" (arXiv:1812.06162): training at a batch
``B`` needs ``S = S_min(1 + B_noise/B)`` steps and ``E = E_min(1 + B/B_noise)`` examples to reach a loss, with the
critical batch ``B_crit ≈ B_noise``; the *simple* noise scale

    B_simple = tr(Σ) / |G|²

(``G`` the true gradient, ``Σ`` the per-example gradient covariance) approximates it. Appendix A estimates both
quantities without bias from the squared norms of gradients taken at two batch sizes, ``B_small < B_big``
(``E|g_B|² = |G|² + tr(Σ)/B``):

    |G|²  ≈ (B_big |g_big|² − B_small |g_small|²) / (B_big − B_small)
    tr Σ  ≈ (|g_small|² − |g_big|²) / (1/B_small − 1/B_big)

averaging each over many pairs before dividing (the ratio of means, not the mean of ratios, which is biased).

:func:`measure` does it on one process: ``K`` training micro-batches of the job's data per repeat, each one's
gradient (``B_small`` = a micro-batch's tokens) and their mean (``B_big`` = ``K ×`` that); the interval comes from
a jackknife over the repeats. :func:`measure_pilot` loads the model the baseline's pilot exported at its end
(``OUT/model/``) and the job's training data, so the plan measures ``B_simple`` at the loss the pilot reached; the
loss model carries it to the target (:mod:`~quietsync.plan.critical_batch`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MICRO_BATCHES = 8
"""``K``: micro-batches whose mean is the big batch (``B_big = K · B_small``)."""
REPEATS = 6
"""Independent groups of ``K`` micro-batches (the jackknife's units)."""


@dataclass(frozen=True)
class NoiseScale:
    """A measured simple noise scale (McCandlish et al. 2018, Appendix A), in the tokens a batch is counted in."""

    b_simple: float
    """``tr Σ / |G|²`` in tokens (``inf`` when the measured ``|G|²`` is not above zero: noise dominates)."""
    low: float
    """The jackknife's low end (value − 2 standard errors, on a log scale)."""
    high: float
    grad_sq: float
    """Unbiased ``|G|²``."""
    trace: float
    """Unbiased ``tr Σ`` (per token)."""
    b_small: float
    b_big: float
    repeats: int
    train_loss: float
    """Mean training loss of the micro-batches it was measured on."""
    seconds: float = 0.0
    """What the measurement cost (wall seconds, model and data loading included)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def unbiased(small_sq: Sequence[float], big_sq: Sequence[float], b_small: float, b_big: float
             ) -> tuple[float, float]:
    """``(|G|², tr Σ)`` from squared gradient norms at ``b_small`` and ``b_big`` (each averaged first)."""
    if not small_sq or not big_sq:
        raise ValueError("the noise scale needs squared gradient norms at both batch sizes")
    if not 0 < b_small < b_big:
        raise ValueError(f"b_small must be above 0 and below b_big, got {b_small} and {b_big}")
    s = sum(small_sq) / len(small_sq)
    b = sum(big_sq) / len(big_sq)
    return (b_big * b - b_small * s) / (b_big - b_small), (s - b) / (1 / b_small - 1 / b_big)


def _ratio(grad_sq: float, trace: float) -> float:
    return trace / grad_sq if grad_sq > 0 else math.inf


def estimate(small_sq: Sequence[Sequence[float]], big_sq: Sequence[float], b_small: float, b_big: float,
             train_loss: float = math.nan) -> NoiseScale:
    """``B_simple`` from ``small_sq[r]`` (the ``K`` micro-batch gradients' squared norms of repeat ``r``) and
    ``big_sq[r]`` (their mean's), with a jackknife interval over the repeats."""
    if len(small_sq) != len(big_sq) or not big_sq:
        raise ValueError("the noise scale needs one big-batch norm per repeat of small-batch norms")
    flat = [x for r in small_sq for x in r]
    g2, tr = unbiased(flat, big_sq, b_small, b_big)
    value = _ratio(g2, tr)
    n = len(big_sq)
    low = high = value
    if n >= 2 and math.isfinite(value) and value > 0:
        # on a log scale: the interval's low end, value·exp(−2 se), stays above 0
        logs = []
        for i in range(n):
            rest_small = [x for j, r in enumerate(small_sq) if j != i for x in r]
            rest_big = [x for j, x in enumerate(big_sq) if j != i]
            v = _ratio(*unbiased(rest_small, rest_big, b_small, b_big))
            logs.append(math.log(v) if math.isfinite(v) and v > 0 else math.inf)
        if all(math.isfinite(x) for x in logs):
            mean = sum(logs) / n
            se = math.sqrt((n - 1) / n * sum((x - mean) ** 2 for x in logs))
            low, high = value * math.exp(-2 * se), value * math.exp(2 * se)
        else:
            high = math.inf  # a leave-one-out estimate not finite and positive: no upper bound
    return NoiseScale(value, low, high, g2, tr, b_small, b_big, n, train_loss)


def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    # a parameter this batch left without a gradient counts as 0: every vector has the same length
    return torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                      for p in model.parameters() if p.requires_grad])


def measure(loss_of: Callable[[torch.Tensor], torch.Tensor], model: torch.nn.Module, batches: Iterator[torch.Tensor],
            tokens_per_batch: float, micro_batches: int = MICRO_BATCHES, repeats: int = REPEATS) -> NoiseScale:
    """``B_simple`` of ``model`` at its current parameters: per repeat, ``micro_batches`` gradients of
    ``loss_of(batch)`` (the mean loss over a batch of ``tokens_per_batch`` tokens) and their mean."""
    if micro_batches < 2 or repeats < 1:
        raise ValueError(f"micro_batches must be at least 2 and repeats at least 1, got {micro_batches}, {repeats}")
    small: list[list[float]] = []
    big: list[float] = []
    losses: list[float] = []
    for _ in range(repeats):
        total: torch.Tensor | None = None
        norms = []
        for _ in range(micro_batches):
            model.zero_grad(set_to_none=True)  # this micro-batch's own gradient, not a running sum
            loss = loss_of(next(batches))
            loss.backward()
            losses.append(float(loss.detach()))
            g = _flat_grad(model).double()  # float64: |G|² and tr Σ are differences of close squared norms
            norms.append(float(g.dot(g)))
            total = g if total is None else total + g
        assert total is not None
        mean = total / micro_batches
        small.append(norms)
        big.append(float(mean.dot(mean)))
    model.zero_grad(set_to_none=True)
    return estimate(small, big, tokens_per_batch, tokens_per_batch * micro_batches, sum(losses) / len(losses))


def measure_pilot(model_dir: str | Path, job: Any, micro_batches: int = MICRO_BATCHES, repeats: int = REPEATS
                  ) -> NoiseScale:
    """``B_simple`` of the model a pilot exported (``model_dir``, a Hugging Face folder) on the job's training data
    (``job``: its :class:`~quietsync.train.config.TrainConfig`), micro-batches drawn at random (another seed than
    the run's). ``ValueError`` (one line) when the folder holds no model."""
    from ..data.sequences import ShardedSequences
    from ..train.job_data import open_job_data

    t0 = time.perf_counter()
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise ValueError(f"the noise scale needs the pilot's exported model, and {folder} holds none")
    from ..models.causal_lm import load_pretrained

    data = open_job_data(job)
    model = load_pretrained(str(folder), progress=False)  # no loading bars in the plan's output
    model.train()
    stream = iter(ShardedSequences(data.train, job.seq_len, job.micro_batch_size, 0, 1, seed=job.seed + 1))

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss

    ns = measure(loss_of, model, stream, float(job.micro_batch_size * job.seq_len), micro_batches, repeats)
    # frozen: a new one, with the loading's seconds counted in
    return NoiseScale(**{**ns.__dict__, "seconds": time.perf_counter() - t0})


__all__ = ["MICRO_BATCHES", "REPEATS", "NoiseScale", "estimate", "measure", "measure_pilot", "unbiased"]
