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

``finish()`` drains the round in flight. During stage 2 (``steps_in_flight`` = 1) the commit job of θ⁽ᵗ⁺¹⁾
is waited for and committed. Right after a committed step (stage 1, where a loop with a step budget stops) the
running job is the estimate of θ̃⁽ᵗ⁺²⁾ on the last stage's gradients g̃⁽ᵗ⁺¹⁾, computed at θ̃⁽ᵗ⁺¹⁾: in ACCO's
recurrence those only ever enter a commit together with the next stage's gradients g⁽ᵗ⁺¹⁾ at θ⁽ᵗ⁺¹⁾, which is
never computed, so they are dropped and θ⁽ᵗ⁺¹⁾ is final. Micro-batches of an unfinished stage are dropped too.
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

Checkpoints that reshard drain the round in flight first (:mod:`~quietsync.strategies.overlap.machinery`):
after a commit that is stage 1's estimate job, whose Σᵢg̃ᵢ (a ``Shard(0)`` piece of the flat vector) and ΣÑ are
world-size independent, so a job on another number of workers commits
θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, (Σg_new + Σg̃_old)/(ΣN_new + ΣÑ_old)) — the paper's rule with the old workers' estimate-stage
micro-batches counted as they were.

``--adapt`` re-picks the cap on micro-batches per stage (``max_accumulation``) during the run from the measured link
and micro-batch, at a stage boundary only (:mod:`~quietsync.strategies.overlap.adapt_cap`: the decision, and what
a change does to the state).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..base import Strategy
from ..checkpoint.logical import SavedTensors
from ..registry import register
from . import cost, facts
from .adapt_cap import CapAdaptConfig, CapController
from .machinery import Overlap
from .strategy import collected, stage_scale

STAGES = ("init", "stage1", "stage2")


@dataclass
class ACCOConfig(CapAdaptConfig):
    """Knobs of ``acco`` (accumulation per stage, see
    :class:`~quietsync.strategies.overlap.machinery.OverlapConfig`; ``--adapt`` of the cap, see
    :class:`~quietsync.strategies.overlap.adapt_cap.CapAdaptConfig`)."""

    straggler_factor: float = 2.0
    """A worker whose micro-batch takes more than this many times the fastest worker's, and longer than the
    commit job it would overlap, leaves its estimate stage empty (Ñᵢ = 0: it waits for the commit instead of
    making every worker wait for its micro-batch at θ̃); its stage-1 micro-batches still enter every commit.
    Adaptive mode only; 0 = off (every worker computes at least ``min_accumulation`` in both stages). Off under a
    loop that runs collectives of its own between steps (``QuietTrainer``; ``Strategy.loop_collectives``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        f = self.straggler_factor
        if not (isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and (f == 0 or f >= 1)):
            raise ValueError(f"straggler_factor must be 0 (off) or a number >= 1, got {f!r}")


@register("acco", ACCOConfig, facts=facts.ACCO)
class ACCO(Strategy):
    """ACCO on the flat sharded substrate; see the module docstring."""

    prepares_gradient = True  # it unscales and clips the gradient it commits (docs/contract.md)

    reshard_refusal = None  # the round in flight is drained first (overlap/machinery.py)

    finish_policy = (
        "drains the round in flight: a commit job already running (stage 2) is waited for and committed; the "
        "last stage's gradients at the estimate (and an unfinished stage's) are dropped, since they only enter "
        "a commit together with gradients at theta that are never computed"
    )

    lockstep = False  # see Strategy.lockstep

    config: ACCOConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.AdamW, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        self.overlap = self.hold("overlap", Overlap.for_strategy(self, estimate=True, snapshot=True))
        self.shard, self.optimizer = self.overlap.sharded.shard, self.overlap.sharded.optimizer
        self.stage = "init"
        """``init`` (computing g̃⁽⁰⁾ at θ⁽⁰⁾), ``stage1`` (computing g at θ) or ``stage2`` (g̃ at θ̃)."""
        self.tilde_sum = torch.zeros_like(self.shard.grad)  # shard of Σᵢg̃ᵢ⁽ᵗ⁾, kept from stage 1 to stage 2
        self._tilde_count = 0.0  # ΣᵢÑᵢ⁽ᵗ⁾
        self.adapter: CapController | None = None
        if self.config.adapt:  # the stage cap re-picked during the run (adapt_cap.py)
            self.adapter = self.hold("adapt", CapController(self.transport, self.overlap, self.config, model,
                                                            self.param_groups, cost.acco))

    # ------------------------------------------------------------------ main thread
    def _step(self) -> bool:
        return self.overlap.timed_step(self._advance, self.adapter)

    def _advance(self) -> bool:
        o = self.overlap
        if self.stage == "init":  # g̃⁽⁰⁾ at θ⁽⁰⁾, nothing to overlap with yet
            if o.start(self._estimate_job, self.steps, stage_scale(self), self.max_grad_norm):
                self.stage = "stage1"
            return False
        if not o.stage_ready():
            return False
        scale = stage_scale(self)  # of the stage ending now (the scale changes only when a commit is collected)
        if self.stage == "stage1":
            o.wait("acco/estimate")
            straggler = self._straggles()
            # P ← θ̃⁽ᵗ⁺¹⁾ (a straggler keeps θ⁽ᵗ⁾: it computes nothing at θ̃), B ← gᵢ⁽ᵗ⁾
            count = o.hand_over(install=None if straggler else "estimate")
            # --adapt: this worker's link and micro-batch ride on the commit job's count all-reduce (adapt_cap.py)
            probe = None if self.adapter is None else self.adapter.measure()
            o.submit(self._commit_job, count, self.steps, scale, self.max_grad_norm, probe)
            self.stage = "stage2"
            if not straggler:
                return False
            # An empty stage 2 (Ñᵢ = 0): the commit job is short next to this worker's micro-batch, so it waits
            # for it and starts the next round's stage 1 at θ⁽ᵗ⁺¹⁾ at once; the count all-reduce leaves it out
            # of ΣÑ (paper 003, Algorithm 1 with a time-varying Ñᵢ⁽ᵗ⁾ that is 0 here). Its loss scale is stage
            # 1's: the scale changes only when a commit is collected.
        result = o.wait("acco/commit")
        count = o.hand_over(install="committed")  # P ← θ⁽ᵗ⁺¹⁾, B ← g̃ᵢ⁽ᵗ⁺¹⁾
        # a stage boundary (G empty): a new cap holds from the stage beginning now
        extra = {} if self.adapter is None else self.adapter.metrics(self.steps + 1, result)
        committed = collected(self, self.overlap, result, extra)
        o.submit(self._estimate_job, count, self.steps, scale, self.max_grad_norm)
        self.stage = "stage1"
        return committed

    def _straggles(self) -> bool:
        """Whether this worker leaves the coming stage 2 empty: its median micro-batch (as the last job
        all-reduced everybody's) exceeds ``straggler_factor`` × the fastest worker's and the last commit job as
        this worker saw it. Then a micro-batch of its at θ̃ would hold every worker's stage 2 open past the
        commit (stage 2 would last that micro-batch instead of the commit job); the fastest worker never
        qualifies, so ΣÑ ≥ ``min_accumulation`` ≥ 1."""
        o, factor = self.overlap, self.config.straggler_factor
        # under a loop with collectives of its own (Strategy.loop_collectives) the wait for the commit would sit
        # inside step() while a peer that has not yet submitted it may wait in that collective for this worker
        if not factor or self.loop_collectives or self.config.deterministic_accumulation is not None or o.ending:
            return False
        speeds, commit_s = o.peer_micro_batch_s, o.job_s.get("commit")
        if not speeds or min(speeds) <= 0.0 or commit_s is None:  # not measured yet
            return False
        mine = speeds[self.transport.group_rank(o.group)]
        return mine > factor * min(speeds) and mine > commit_s

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
                    max_norm: float | None = None, probe: tuple[float, float] | None = None) -> dict[str, Any]:
        """Stage 2: θ⁽ᵗ⁺¹⁾ = Opt(θ⁽ᵗ⁾, (Σg + Σg̃)/(ΣN + ΣÑ)), committed, all-gathered into B. That gradient is
        clipped by its global norm; under fp16 an overflow (agreed) skips the step on every worker. ``probe``
        (``--adapt``): this worker's measured link and micro-batch, agreed with the counts (result ``probe``)."""
        counts, total = self.overlap.reduce(local_count, "acco_grad", probe)
        if scale is not None:
            self.shard.grad.div_(scale)
        self.shard.grad.add_(self.tilde_sum).div_(total + self._tilde_count)
        check = self.overlap.prepare(max_norm, scale is not None)
        skipped = check is not None and scale is not None and not check.finite
        if not skipped:
            self.overlap.commit_shard(self._lr_scale(step))
        self.overlap.gather(self.shard.master, "acco_params")
        return {"kind": "commit", "counts": counts, "check": check, "scale": scale, "skipped": skipped,
                "probe": None if probe is None else self.overlap.last_probe}

    @property
    def steps_in_flight(self) -> int:
        return 1 if self.stage == "stage2" else 0

    def _finish(self, sync: bool) -> None:
        o = self.overlap
        if o.behind_peers():  # the loop stopped this worker one stage short of a peer: end that stage now
            with o.ending_stage():
                self._step()
        if self.stage == "stage2":  # θ⁽ᵗ⁺¹⁾ is being committed: wait, install, count it
            result = o.wait("acco/commit")
            o.install()
            collected(self, self.overlap, result)  # (an fp16 overflow was skipped by the job on every worker: no step)
        elif self.stage == "stage1":  # the estimate on g̃: nothing it computes is ever committed
            o.wait("acco/estimate")
        o.drop_stage()
        self.stage = "init"  # nothing in flight: a run resumed from here restarts the pipeline

    def _level(self) -> None:
        """:meth:`_finish`, except that a stage 1 is not dropped: every worker ends it as a straggler does (P keeps
        θ⁽ᵗ⁾, stage 2 empty everywhere), so its gradients at θ⁽ᵗ⁾ enter the commit, Opt(θ⁽ᵗ⁾, (Σg + Σg̃)/(ΣN + ΣÑ)),
        where dropping them would leave the round without a commit -- a loop that levels every few steps (the
        Trainer's evaluations) would then never commit. An initial stage keeps its micro-batches (nothing is in
        flight). Training goes on from ``init`` at θ⁽ᵗ⁺¹⁾."""
        o = self.overlap
        if o.behind_peers():  # a peer ended one stage more: end this one now (every worker then in the same stage)
            with o.ending_stage():
                self._step()
        if self.stage == "init":
            return
        if self.stage == "stage1":  # every worker here: hand stage 1 over and commit it, nothing computed at θ̃
            scale = stage_scale(self)
            o.wait("acco/estimate")
            o.submit(self._commit_job, o.hand_over(install=None), self.steps, scale, self.max_grad_norm, None)
        result = o.wait("acco/commit")
        o.install()
        collected(self, self.overlap, result)
        o.drop_stage()  # a stage 2's gradients at θ̃, as finish() drops them (none where stage 1 ended here)
        self.stage = "init"

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

    # ------------------------------------------------------------------ checkpoints that reshard
    def _open_round(self) -> dict[str, int]:
        return {"stage_micro_batches": self.overlap.stage_count}

    def _logical_state(self) -> dict[str, torch.Tensor]:
        out = self.overlap.logical_state()  # drains the estimate job, which writes Σg̃
        if self.adapter is not None:
            out.update(self.adapter.logical_state())
        return {**out, "acco.tilde_sum": self.overlap.sharded.logical_piece(self.tilde_sum),
                "acco.tilde_count": torch.tensor(self._tilde_count, dtype=torch.float64),
                "acco.stage": torch.tensor(STAGES.index(self.stage), dtype=torch.int64)}

    def _logical_targets(self, saved: SavedTensors) -> dict[str, torch.Tensor]:
        return {**self.overlap.logical_targets(saved),
                **(self.adapter.logical_targets(saved) if self.adapter is not None else {}),
                "acco.tilde_sum": self.overlap.sharded.logical_piece_target(self.tilde_sum.dtype),
                "acco.tilde_count": torch.zeros((), dtype=torch.float64),
                "acco.stage": torch.zeros((), dtype=torch.int64)}

    def _load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        self.overlap.load_logical(filled)
        if self.adapter is not None:
            self.adapter.load_logical(filled)
        self.overlap.sharded.load_logical_piece(self.tilde_sum, filled["acco.tilde_sum"])
        self._tilde_count = float(filled["acco.tilde_count"])
        self.stage = STAGES[int(filled["acco.stage"])]
