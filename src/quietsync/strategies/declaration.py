"""What a strategy declares beside its code, so that the rest of the house asks instead of naming it.

``@register(name, Config, facts=Declaration(...))`` (:mod:`~quietsync.strategies.registry`) keeps a strategy's
:class:`Declaration` on its class; the planner, the fault tolerance, the trainer's flag checks and the GPU check
read it through :func:`~quietsync.strategies.registry.declaration` and compare no names:

* the cost schedule (also ``@register(..., schedule=f)``, as before);
* :class:`PlanFacts` — for ``quietsync plan``: exact or approximate at equal tokens, its loss prior (a
  :class:`Prior`) with its sources, the knob grid it is tuned over, its adaptive stages, when it applies, the
  sentence the advice prints;
* :class:`ReplicaPolicy` or a one-line refusal — for ``--fault-tolerance torchft``: what becomes of a missing
  replica's share, what a returning one takes (the heal reuses the strategy's own :meth:`Strategy.rejoin
  <quietsync.strategies.base.Strategy.rejoin>`);
* what models it needs (a check of the job's model, built on the meta device, against its config);
* the settings whose workers keep parameters of their own (which the replica check leaves alone);
* the GPU check's flags and mixed precisions.

The built-in strategies declare theirs in each family's ``facts.py``, beside its ``cost.py``; a strategy of your
own declares its own in its file (``examples/custom_strategy.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..topology import Topology


# ---------------------------------------------------------------------------------------------- loss per token
@dataclass(frozen=True)
class Prior:
    """A setting's loss per token against the synchronous baseline's, as the papers give it."""

    penalty: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """``δ`` (low, value, high): held-out loss at equal tokens is ``(1 + δ)`` times the baseline's."""
    multiplier: tuple[float, float, float] = (1.0, 1.0, 1.0)
    """``k`` (low, value, high): tokens to any loss are ``k`` times what they would be otherwise."""
    exact: bool = False
    """The baseline's own trajectory (DDP, ZeRO-1, FSDP: equal up to float rounding, tested)."""
    notes: tuple[str, ...] = ()
    """What the prior rests on: claims with their source key (``[key]``) and the assumptions made."""
    sources: tuple[str, ...] = field(default=())
    """The keys of the sources the notes cite (:attr:`PlanFacts.sources` of some strategy, or the planner's)."""

    def combine(self, other: Prior) -> Prior:
        """Both effects at once (penalties add, multipliers multiply)."""
        p = tuple(a + b for a, b in zip(self.penalty, other.penalty))
        m = tuple(a * b for a, b in zip(self.multiplier, other.multiplier))
        return Prior(p, m, self.exact and other.exact, self.notes + other.notes,  # type: ignore[arg-type]
                     tuple(dict.fromkeys(self.sources + other.sources)))  # deduplicated, in citation order


EXACT = Prior(exact=True, notes=("the synchronous baseline's own trajectory",))
"""The prior of a setting that follows the synchronous baseline's trajectory."""


def penalty(low: float, value: float, high: float, note: str, *sources: str) -> Prior:
    """A loss penalty ``δ`` (low, value, high) at equal tokens, with what it rests on and its source keys."""
    return Prior(penalty=(low, value, high), notes=(note,), sources=sources)


def multiplier(low: float, value: float, high: float, note: str, *sources: str) -> Prior:
    """A token multiplier ``k`` (low, value, high), with what it rests on and its source keys."""
    return Prior(multiplier=(low, value, high), notes=(note,), sources=sources)


class Scale(Protocol):
    """What a prior may depend on besides the setting (the planner's ``PriorContext`` has these)."""

    params: int
    """Model parameters N."""
    workers: int
    nodes: int


# ---------------------------------------------------------------------------------------------- the planner
@dataclass(frozen=True)
class PlanFacts:
    """What ``quietsync plan`` must know of a strategy besides its cost schedule."""

    prior: Callable[[Any, Scale], Prior] | None = None
    """``prior(config, scale)``: its loss per token against the synchronous baseline at the setting ``config``,
    before the batch rule (the planner adds the critical-batch cost of a larger step itself); None: no published
    comparison (+5%, up to +50%, until a pilot measures it)."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Source key → citation, for every key the prior's notes cite."""
    exact: bool = False
    """Exact at equal tokens: at its defaults it follows the synchronous baseline's trajectory (a pilot of it is
    the baseline's)."""
    baseline: int | None = None
    """Its preference as the synchronous baseline the others are measured against (0 first; None: never the
    baseline). The baseline's pilot is the plan's baseline curve."""
    grid: tuple[Mapping[str, Any], ...] = ({},)
    """The knob settings it is tuned over in the canonical grid (``{}``: its defaults)."""
    wide: tuple[Mapping[str, Any], ...] = ()
    """Settings added for large clusters on slow links (``what_if`` plans)."""
    uneven: tuple[Mapping[str, Any], ...] = ()
    """Settings added when the workers compute at different speeds (a slow worker given, or measured beyond the
    calibration's noise): those that let a slow worker do less instead of everyone waiting for it."""
    varying: tuple[Mapping[str, Any], ...] = ()
    """Settings added when the link varies during the run (``--link`` given as a schedule): those that re-pick
    their knobs as the link changes."""
    stages: int = 0
    """Stages per step whose micro-batch count adapts to the network (ACCO 2, DPU/WP 1; 0: none): its pilots run
    through the emulated link and evaluate seldom (an evaluation waits for the update in flight)."""
    sync_period: Callable[[Any], int] | None = None
    """``sync_period(config)``: steps between its synchronizations, where the evaluated model changes (local
    methods): a pilot evaluates on a multiple or a divisor of it."""
    first_sync: Callable[[Any], int | None] | None = None
    """``first_sync(config)``: steps a worker trains alone before its first synchronization (None: it meets every
    step)."""
    applies: Callable[[Topology, tuple[int, ...]], str | None] | None = None
    """``applies(topology, stage_counts)``: why it does not apply to ``topology`` (None when it does);
    ``stage_counts``: the stage counts the model can be cut into (empty: not checked). One worker is judged by
    the planner (nothing to hide or shrink) unless the strategy is exact."""
    advice: str | None = None
    """The sentence the advice prints after its busy share, a ``str.format`` template of ``config`` (the setting's
    config), ``setting`` (its label without the name), ``per_stage`` (micro-batches per stage per worker, when it
    has stages), ``tokens_per_step``, ``sent`` and ``baseline_sent`` (bytes per step across nodes)."""
    codec: Callable[[Any], str | None] | None = None
    """``codec(config)``: the key of the codec whose time the calibration must measure for this setting
    (:func:`~quietsync.cost.compute.codec_key`), or None."""
    calibrate: tuple[Mapping[str, Any], ...] = ()
    """Settings whose codec the calibration times in every plan (so that a setting not calibrated has a near
    one)."""


# ---------------------------------------------------------------------------------------------- fault tolerance
MISSING_DATA = ("the data windows dealt to it since the last commit go back to the stream and are dealt first to the "
                "replicas present (:mod:`quietsync.train.window_dealer`): no window is skipped or trained twice")
"""What becomes of a missing replica's data under torchft, whatever the strategy (the window dealer's rule): the
end of every built-in policy's ``missing``."""


@dataclass(frozen=True)
class ReplicaPolicy:
    """What a strategy does under ``--fault-tolerance torchft`` when a replica leaves and when it returns."""

    missing: str
    """What becomes of a missing replica's share: its micro-batches, its residual, its momentum."""
    joining: str
    """What a returning replica takes from the live peer it heals from, and what it starts empty
    (:meth:`~quietsync.strategies.base.Strategy.rejoin` does the second part)."""
    workers: str = "any"
    """Workers per replica group it runs with, in words: ``any``, or ``one`` (its state is per worker)."""
    one_worker: Callable[[Any], bool] | bool = False
    """Whether (with this config) it runs only with one worker per replica group."""
    one_worker_hint: tuple[str, str] = ("", "")
    """``(qualifier, hint)`` of the refusal of more: ``--strategy NAME{qualifier} keeps its state per worker ...
    {hint}``."""
    skip_refusal: str | None = "its step is not known to exchange across replicas before any state changes"
    """Why ``--on-nonfinite skip`` cannot run with it under torchft (a round dropped at the commit vote would
    leave the other replicas' share behind); None where its step's first exchange across replicas comes before
    any state changes."""

    def runs_one_worker(self, config: Any) -> bool:
        """Whether it runs only with one worker per replica group with ``config``."""
        return self.one_worker(config) if callable(self.one_worker) else bool(self.one_worker)


# ---------------------------------------------------------------------------------------------- the declaration
@dataclass(frozen=True)
class Declaration:
    """Everything the rest of the house must know about a strategy (see the module docstring)."""

    schedule: Callable[..., Any] | None = None
    """``schedule(workload, topology, config) -> Schedule`` (None: the planner cannot predict it)."""
    plan: PlanFacts = field(default_factory=PlanFacts)
    """Its facts for the planner."""
    faults: ReplicaPolicy | str | None = None
    """Its policy under ``--fault-tolerance torchft``, or the one-line reason it is refused (None: refused, not
    being one of the strategies whose replicas meet only at commits)."""
    models: Callable[[torch.nn.Module, Any, int], str | None] | None = None
    """``models(model, config, world)``: why the job's model (on the meta device) cannot carry ``config`` on
    ``world`` workers (one line naming the flag), or None; given, the model is always checked."""
    apart: Callable[[Any], str | None] | None = None
    """``apart(config)``: why its workers hold parameters of their own with ``config`` (one line naming the flag), so
    that the replica check (:mod:`quietsync.train.replicas`) has nothing to compare; None (or no function): every
    worker commits the same parameters after every step."""
    gpu_flags: tuple[str, ...] | None = ()
    """The ``quietsync train`` flags of its GPU check on one device (None: not checked there)."""
    gpu_precisions: tuple[str, ...] = ("bf16",)
    """Mixed precisions the GPU check runs besides fp32."""
    order: int = 100
    """Where it stands among the strategies in listings (the grid, the plan's table, the GPU check): the
    synchronous baselines first, then those that hide the network, those that shrink it, and the rest."""


__all__ = ["EXACT", "MISSING_DATA", "Declaration", "PlanFacts", "Prior", "ReplicaPolicy", "Scale", "multiplier",
           "penalty"]
