"""``acco``: ACcumulate while COmmunicate (papers 000 and 003; Algorithm 1).

Each round t has two stages, both starting from θ⁽ᵗ⁾, each overlapping computation on the main thread with
a job on the communication worker:

* **stage 1** — the main thread accumulates gᵢ⁽ᵗ⁾ at θ⁽ᵗ⁾ while the worker all-reduces the micro-batch
  counts Ñᵢ⁽ᵗ⁾, reduce-scatters g̃ᵢ⁽ᵗ⁾ (kept as a shard Σᵢg̃ᵢ⁽ᵗ⁾), computes the estimate
  θ̃⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σg̃/ΣÑ) on the shard **without committing optimizer state** (moments and step counter
  untouched, also before the first committed step) and all-gathers it;
* **stage 2** — the main thread accumulates g̃ᵢ⁽ᵗ⁺¹⁾ at θ̃⁽ᵗ⁺¹⁾ while the worker all-reduces Nᵢ⁽ᵗ⁾,
  reduce-scatters gᵢ⁽ᵗ⁾ and commits θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, (Σg⁽ᵗ⁾ + Σg̃⁽ᵗ⁾)/(ΣN⁽ᵗ⁾ + ΣÑ⁽ᵗ⁾)), then all-gathers it.

Initialisation as in Algorithm 1: the first stage computes g̃ᵢ⁽⁰⁾ at θ⁽⁰⁾ with nothing to overlap
(``deterministic_accumulation`` micro-batches in deterministic mode, ``min_accumulation`` — by default the
paper's one — otherwise). ``step()`` returns True when stage 2's job is collected: θ⁽ᵗ⁺¹⁾ is then installed
in the model, so evaluation right after a committed step sees θ, never θ̃.

Precision and clipping: both jobs clip the gradient their optimizer step uses (the estimate's Σg̃/ΣÑ, the
commit's (Σg + Σg̃)/(ΣN + ΣÑ)) by its global norm, one scalar all-reduce each; under fp16 each stage's
gradient is unscaled by its own stage's scale and an overflow skips the commit on every worker (see
:mod:`~quietsync.strategies.overlap.machinery`).

Per committed step, ``last_step_metrics().extra`` holds the micro-batches each worker contributed to it
(Nᵢ⁽ᵗ⁾ + Ñᵢ⁽ᵗ⁾), the per-stage counts, and how long the main thread waited on the worker
(``compute_wait_s``) and the worker on the main thread (``comm_wait_s``).

Traffic per committed step is two reduce-scatters and two all-gathers (twice ZeRO-1's), all hidden behind
computation when the link allows; memory is ZeRO-1's plus one communication buffer (Table 1,
(2+2+2+K/N)Ψ), plus here the estimate's scratch copy of the shard state and a shard of Σg̃ (see
``docs/acco.md``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..base import Strategy
from ..registry import register
from .machinery import Overlap, OverlapConfig

STAGES = ("init", "stage1", "stage2")


@dataclass
class ACCOConfig(OverlapConfig):
    """Knobs of ``acco`` (accumulation per stage; see
    :class:`~quietsync.strategies.overlap.machinery.OverlapConfig`)."""


@register("acco", ACCOConfig)
class ACCO(Strategy):
    """ACCO on the flat sharded substrate; see the module docstring."""

    reshard_refusal = (
        "every worker holds its part of a round in flight (the gradients of the estimate stage, not yet "
        "applied, and the estimate θ̃ they were computed at), which has no counterpart on another number of "
        "workers"
    )

    config: ACCOConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.overlap = self.hold("overlap", Overlap.for_strategy(self, estimate=True, snapshot=True))
        self.shard, self.optimizer = self.overlap.sharded.shard, self.overlap.sharded.optimizer
        self.stage = "init"
        """``init`` (computing g̃⁽⁰⁾ at θ⁽⁰⁾), ``stage1`` (computing g at θ) or ``stage2`` (g̃ at θ̃)."""
        self.tilde_sum = torch.zeros_like(self.shard.grad)  # shard of Σᵢg̃ᵢ⁽ᵗ⁾, kept from stage 1 to stage 2
        self._tilde_count = 0.0  # ΣᵢÑᵢ⁽ᵗ⁾

    # ------------------------------------------------------------------ main thread
    def _backward(self, loss: torch.Tensor) -> None:
        self.overlap.backward(loss)

    def _step(self) -> bool:
        o = self.overlap
        if self.stage == "init":  # g̃⁽⁰⁾ at θ⁽⁰⁾, nothing to overlap with yet
            if o.start(self._estimate_job, self.steps, self._stage_scale(), self.max_grad_norm):
                self.stage = "stage1"
            return False
        if not o.stage_ready():
            return False
        scale = self._stage_scale()  # of the stage ending now (the scale changes only when a commit is collected)
        if self.stage == "stage1":
            o.wait("acco/estimate")
            count = o.hand_over(install=True)  # P ← θ̃⁽ᵗ⁺¹⁾, B ← gᵢ⁽ᵗ⁾
            o.holds_committed = False
            o.submit(self._commit_job, count, self.steps, scale, self.max_grad_norm)
            self.stage = "stage2"
            return False
        result = o.wait("acco/commit")
        count = o.hand_over(install=True)  # P ← θ⁽ᵗ⁺¹⁾, B ← g̃ᵢ⁽ᵗ⁺¹⁾
        o.holds_committed = True
        committed = self._collected(result)
        o.submit(self._estimate_job, count, self.steps, scale, self.max_grad_norm)
        self.stage = "stage1"
        return committed

    def _stage_scale(self) -> float | None:
        """The fp16 loss scale the current stage's micro-batches carry (None without fp16)."""
        return None if self.scaler is None else self.scaler.scale

    def _collected(self, result: dict[str, Any]) -> bool:
        """Commit the round, or — an fp16 overflow, skipped by the commit job on every worker — nothing."""
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

    # ------------------------------------------------------------------ communication worker
    def _estimate_job(self, local_count: int, step: int, scale: float | None = None,
                      max_norm: float | None = None) -> dict[str, Any]:
        """Stage 1: θ̃⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, Σg̃/ΣÑ) on the shard (state not committed), all-gathered into B. With
        clipping the estimate's gradient is clipped as the real step would clip its own; under fp16 an
        overflow (agreed) makes the estimate θ⁽ᵗ⁾ itself, and the commit that includes Σg̃ is skipped."""
        counts, total = self.overlap.reduce(local_count, "acco_tilde")
        if scale is not None:
            self.shard.grad.div_(scale)
        self.tilde_sum.copy_(self.shard.grad)
        self._tilde_count = total
        self.shard.grad.div_(total)
        check = self.overlap.prepare(max_norm, scale is not None)
        if check is not None and scale is not None and not check.finite:
            estimate = self.shard.master
        else:
            estimate = self.overlap.estimator.estimate(self._lr_scale(step))
        self.overlap.gather(estimate, "acco_estimate")
        return {"kind": "estimate", "counts": counts}

    def _commit_job(self, local_count: int, step: int, scale: float | None = None,
                    max_norm: float | None = None) -> dict[str, Any]:
        """Stage 2: θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, (Σg + Σg̃)/(ΣN + ΣÑ)), committed, all-gathered into B. That gradient is
        clipped by its global norm; under fp16 an overflow (agreed) skips the step on every worker."""
        counts, total = self.overlap.reduce(local_count, "acco_grad")
        if scale is not None:
            self.shard.grad.div_(scale)
        self.shard.grad.add_(self.tilde_sum).div_(total + self._tilde_count)
        check = self.overlap.prepare(max_norm, scale is not None)
        skipped = check is not None and scale is not None and not check.finite
        if not skipped:
            self.overlap.commit_shard(self._lr_scale(step))
        self.overlap.gather(self.shard.master, "acco_params")
        return {"kind": "commit", "counts": counts, "check": check, "scale": scale, "skipped": skipped}

    # ------------------------------------------------------------------ contract
    @contextmanager
    def committed_params(self) -> Iterator[torch.nn.Module]:
        """θ, not θ̃: free right after a committed step; during stage 2 all-gathered (all workers enter)."""
        with self.overlap.committed_params(self.model, self.steps) as model:
            yield model

    def _position(self) -> dict[str, int]:
        return {"stage": STAGES.index(self.stage)}

    def _memory(self) -> dict[str, int]:
        return {"tilde_grad_shard": self.tilde_sum.numel() * self.tilde_sum.element_size()}

    def _state(self) -> dict[str, Any]:
        return {"stage": self.stage, "tilde_sum": self.tilde_sum.clone(), "tilde_count": self._tilde_count}

    def _load_state(self, state: dict[str, Any]) -> None:
        if state["stage"] not in STAGES:
            raise ValueError(f"checkpoint stage must be one of {STAGES}, got {state['stage']!r}")
        self.stage = state["stage"]
        self.tilde_sum.copy_(state["tilde_sum"])
        self._tilde_count = float(state["tilde_count"])
