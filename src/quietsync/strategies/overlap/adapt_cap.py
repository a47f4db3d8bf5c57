"""``--adapt`` for ACCO (and DPU, WP: the same machinery): re-pick the cap on micro-batches per stage
(``max_accumulation``) during the run from the measured link and micro-batch.

**What is measured** (every round, at the hand-over that submits ACCO's commit job, DPU's and WP's update job): the
link, as bytes/s of the transfers completed on the strategy's group since the last round, and the micro-batch, as
the median wall time of this worker's last ``adapt_window`` micro-batches --
:class:`~quietsync.strategies.parts.link_probe.LinkProbe`'s measurements, the pieces DiLoCo's and DeMo's controllers
use. ACCO's workers are not in lockstep (each ends its stages at its own pace), so the two numbers are not agreed by
a collective of the main thread (which would stall the overlap, and could meet a peer's ``finish()`` agreement
instead): they ride on that job's all-reduce of the micro-batch counts (two more floats per worker,
:meth:`Overlap.reduce <quietsync.strategies.overlap.machinery.Overlap.reduce>`), which every worker runs once per
round in the same order. Agreed: the fastest link any worker saw, as the probe agrees it, and the **fastest**
worker's micro-batch -- the cap must let that worker's stage last as long as the job; a slower worker's stage ends
when the job does, before it reaches the cap.

**The decision** (:func:`pick_cap`), every ``adapt_every`` rounds, when that job is collected: for each cap c from
``min_accumulation`` to ``adapt_max_accumulation``, the strategy's own cost schedule
(:mod:`~quietsync.strategies.overlap.cost`: per stage an all-reduce of the counts, a reduce-scatter of the
gradients, the optimizer step(s) on the shard and an all-gather of the parameters, hidden behind at most c
micro-batches; ACCO has two stages per step, DPU and WP one) evaluated on the measured link (α = 0: the measured
rate already holds the per-message costs) and micro-batch gives the exposed communication per committed step. The
pick is the **smallest** c whose exposed communication is at most ``adapt_overhead`` of the compute (the largest,
the user's bound, when none is). Smallest, because micro-batches past the job's end buy no speed -- the stage
already lasts as long as the job -- and only add tokens to a step whose loss gain per token falls once the batch
passes the critical batch (README, 'ACCO the paper's way': adaptive ACCO took 1.5-2.7x ZeRO-1's tokens to the same
loss); a cap below it leaves the workers idle while the job runs. So a link that drops raises the cap until the
stage hides the job again (up to the bound), one that recovers lowers it. As the other controllers, it re-picks only
when the measured ratio of link to micro-batch time moved by more than ``adapt_threshold`` since its last pick (the
first decision always picks).

**What a change does to the state.** A change takes effect **at a stage boundary only**: in ACCO it is taken
right after the commit job of round t was collected and its hand-over made (P ← θ⁽ᵗ⁺¹⁾, B ← the stage-2
gradients g̃⁽ᵗ⁺¹⁾, G ← 0), before the next stage computes a micro-batch (:meth:`Overlap.set_cap
<quietsync.strategies.overlap.machinery.Overlap.set_cap>` refuses a stage already open). So:

* the stage that just ended keeps the count it was handed over with; its gradients g̃⁽ᵗ⁺¹⁾ at the estimate θ̃⁽ᵗ⁺¹⁾
  and their count Ñ enter the estimate job and Σg̃ exactly as without a change;
* the estimate job submitted at this hand-over (the communication in flight) is untouched;
* the committed θ, the master shard, the optimizer's moments, the estimate's scratch state, the snapshot, Σg̃ and
  ΣÑ are untouched: ACCO's update divides every gradient by the all-reduced micro-batch counts, whatever they were,
  so a stage of another size is the paper's rule with other Nᵢ, Ñᵢ (Algorithm 1 lets them vary per stage);
* the stages from the next one on hold at most the new cap (at least ``min_accumulation``; the straggler rule and
  ``finish()`` as before).

DPU and WP: the change is taken at the hand-over that collects an update job and submits the next (P ← θ⁽ᵗ⁺¹⁾, or
WP's prediction, B ← the gradients of the stage just ended, G ← 0): that stage keeps its count, the update job
submitted there (the delayed gradients in flight) is untouched, and so are θ, the master shard, the moments and WP's
scratch state -- each update divides by the all-reduced counts. The drained update job of a logical checkpoint keeps
its agreed pair (``overlap.job_probe``), so the resumed run decides at the same rounds on the same numbers.

Checkpoints (the plain one and the logical one) hold the cap in force, the step of the last change, the rounds
counted towards the next decision and the measured ratio of the last pick, the hysteresis' reference
(:class:`CapController`), so a run resumed after a change goes on with the adapted cap and decides at the same rounds
against the same reference, exactly as if it had not stopped (the probe's measurements start afresh). A run that
adapts to the cap it has is the static run at that cap. ``--adapt`` needs ``max_accumulation`` (the cap it
starts from) and adaptive stages (no ``deterministic_accumulation``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...cost.schedule import Schedule
from ...cost.workload import Workload
from ...link import LinkModel
from ...topology import Topology
from ...validate import check_int
from ..parts.knob_controller import KnobController
from ..parts.link_probe import Cadence, KnobDecision, LinkProbe, check_cadence_knobs, exposed_ratio
from .machinery import Overlap, OverlapConfig

ADAPT_KNOBS = ("cap",)
"""The knobs ``adapt_knobs`` may name for ``acco``, ``dpu`` and ``wp``: ``cap``, the ``max_accumulation`` in force."""

DEFAULT_BOUND = 8
"""Without ``adapt_max_accumulation``: the largest cap adapt may pick, as a multiple of ``max_accumulation``."""


@dataclass
class CapAdaptConfig(OverlapConfig):
    """The accumulation knobs plus ``--adapt`` of the stage cap."""

    adapt: bool = False
    """Re-pick max_accumulation during the run from the measured link and micro-batch: the smallest cap whose stage
    hides the communication within adapt_overhead (docs/acco.md, 'Adapting the cap to the link'); needs
    max_accumulation (the cap it starts from) and adaptive stages."""
    adapt_every: int = 1
    """With adapt: rounds (committed steps) between two decisions (1: every round -- a decision costs no
    collective, and a round lasts two jobs, so on a slow link rounds are few)."""
    adapt_overhead: float = 0.1
    """With adapt: the largest share of the compute the exposed communication may add (0.1 = 10%)."""
    adapt_threshold: float = 0.5
    """With adapt: re-pick only when the measured link-to-micro-batch ratio moved by more than this factor since the
    last pick (0.5: below 1/1.5 or above 1.5 of it); 0: re-pick at every decision."""
    adapt_window: int = 32
    """With adapt: the micro-batch time is the median of this worker's last N micro-batches."""
    adapt_knobs: str = "cap"
    """With adapt: the knobs re-picked; one, cap (max_accumulation)."""
    adapt_max_accumulation: int | None = None
    """With adapt: the largest cap it may pick (the bound on tokens per step); default 8 x max_accumulation. The
    candidates are every cap from min_accumulation to it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_cadence_knobs(self)
        check_int("adapt_max_accumulation", self.adapt_max_accumulation, 1, allow_none=True)
        knobs = [k.strip() for k in self.adapt_knobs.split(",") if k.strip()]
        if knobs != list(ADAPT_KNOBS):
            raise ValueError(f"adapt_knobs must be {', '.join(ADAPT_KNOBS)} (acco, dpu and wp re-pick their cap on "
                             f"micro-batches per stage, max_accumulation, only), got {self.adapt_knobs!r}")
        if self.adapt:
            self.cap_candidates()

    def cap_candidates(self) -> tuple[int, ...]:
        """The caps adapt may pick, smallest first, checked (raises ValueError naming the knob and the allowed
        values)."""
        if self.max_accumulation is None:
            raise ValueError("max_accumulation must be given when adapt is on (--adapt: the cap on micro-batches "
                             "per stage it starts from and re-picks)")
        if self.deterministic_accumulation is not None:
            raise ValueError(f"deterministic_accumulation must not be given when adapt is on (it fixes every stage's "
                             f"count; --adapt re-picks the cap of adaptive stages), got "
                             f"{self.deterministic_accumulation}")
        bound = self.adapt_max_accumulation
        if bound is None:
            bound = DEFAULT_BOUND * self.max_accumulation
        elif bound < self.max_accumulation:
            raise ValueError(f"adapt_max_accumulation must be >= max_accumulation ({self.max_accumulation}), "
                             f"got {bound}")
        return tuple(range(self.min_accumulation, bound + 1))


class CapDecision(KnobDecision):
    """One decision of ACCO's, DPU's and WP's controller (``step_s``: the fastest worker's micro-batch, seconds)."""

    knob = "cap"


ScheduleFn = Callable[[Workload, Topology, Any], Schedule]
"""A strategy's cost schedule (:func:`~quietsync.strategies.overlap.cost.acco`, ``dpu``, ``wp``)."""


def predicted_share(schedule: ScheduleFn, workload: Workload, topo: Topology, cfg: Any, cap: int,
                    micro_batch_s: float, link: LinkModel, group: str) -> float:
    """Exposed communication / compute per committed step that ``schedule`` predicts for ``cfg`` capped at ``cap``,
    with micro-batches of ``micro_batch_s`` seconds and the group's link ``link``."""
    fixed = dataclasses.replace(cfg, max_accumulation=cap, adapt=False)  # at this cap as a fixed run
    return exposed_ratio(schedule(workload, topo, fixed), workload.params, 1, micro_batch_s, topo, group, link)


def pick_cap(schedule: ScheduleFn, workload: Workload, topo: Topology, cfg: Any, candidates: tuple[int, ...],
             current: int, micro_batch_s: float, bandwidth: float, overhead: float, group: str) -> CapDecision:
    """The smallest cap (``candidates``: smallest first) whose predicted exposed communication is at most
    ``overhead`` of the compute, the largest when none is; see the module docstring."""
    link = LinkModel(bandwidth, 0.0)
    shares: dict[int, float] = {}
    new = candidates[-1]
    for c in candidates:  # smallest first: the first that fits is the pick (the larger ones only cost tokens)
        shares[c] = predicted_share(schedule, workload, topo, cfg, c, micro_batch_s, link, group)
        if shares[c] <= overhead:
            new = c
            break
    else:
        shares[new] = shares[candidates[-1]]
    rate = f"{bandwidth * 8 / 1e6:.3g} Mbit/s, micro-batch {micro_batch_s * 1e3:.3g} ms"
    if shares[new] <= overhead:
        why = f"{rate}: smallest cap whose stage hides the job within {overhead:.0%} (predicted {shares[new]:.1%})"
    else:
        why = (f"{rate}: no cap up to {candidates[-1]} hides the job within {overhead:.0%}; the largest "
               f"({shares[new]:.1%})")
    return CapDecision(current, new, bandwidth, micro_batch_s, shares[new], why)


class CapController(KnobController):
    """The controller ACCO, DPU and WP hold under ``adapt``: measures, decides, and keeps the cap in force
    (checkpointed).

    Args:
        transport: the transport (its meter and topology).
        overlap: the overlap machinery whose stage cap a change sets (:meth:`Overlap.set_cap`).
        config: the strategy's config (its ``max_accumulation`` is the starting cap; it is not changed).
        model, param_groups: what the cost model's workload is read from.
        schedule: the strategy's cost schedule (:mod:`~quietsync.strategies.overlap.cost`).
    """

    KNOB = "max_accumulation"

    def __init__(self, transport: Any, overlap: Overlap, config: CapAdaptConfig, model: torch.nn.Module,
                 param_groups: list[dict[str, Any]], schedule: ScheduleFn) -> None:
        self.transport, self.overlap, self.config, self.schedule = transport, overlap, config, schedule
        self.group = overlap.group
        self.candidates = config.cap_candidates()
        self.workload = Workload.from_model(model, tokens_per_micro_batch=1, param_groups=param_groups)
        self.changed_at = 0
        """The step of the last change of the cap (0: none)."""
        self.decisions: list[dict[str, Any]] = []
        """Every decision taken (changes and keeps), as :meth:`CapDecision.record` (rank-local, for reports)."""
        self._probe = LinkProbe(transport, self.group, config.adapt_window)
        self.cadence = Cadence(config.adapt_every, config.adapt_threshold)
        """When it decides: every adapt_every rounds whose probe was collected, on a ratio that moved (checkpointed:
        a resumed run decides at the same rounds against the same reference)."""

    @property
    def rounds(self) -> int:
        """Rounds counted towards the next decision."""
        return self.cadence.count

    @property
    def value(self) -> int:
        """The cap on micro-batches per stage in force."""
        return int(self.overlap.cap)

    cap = value

    def micro_batch(self, seconds: float) -> None:
        """Count one micro-batch of ``seconds`` wall time on the main thread."""
        self._probe.step_done(seconds)

    def measure(self) -> tuple[float, float]:
        """This worker's ``(bandwidth, micro-batch seconds)`` since the last call, for the job that agrees them."""
        return self._probe.local()

    def after_round(self, step: int, agreed: tuple[float, float] | None) -> CapDecision | None:
        """At the hand-over right after round ``step``'s job was collected (a stage boundary), with the pair
        that job agreed (None: it carried none, e.g. the drained job of a logical checkpoint): every
        ``adapt_every`` rounds, decide. Every worker calls it at the same rounds with the same pair, so all take
        the same decision, no collective needed. Returns the decision when the cap changed."""
        if agreed is None:
            return None
        if not self.cadence.due():
            return None
        bandwidth, micro_batch_s = agreed
        if bandwidth <= 0 or micro_batch_s <= 0:  # nothing crossed a link to measure (no emulation, one worker)
            return None
        ratio = 1.0 / (bandwidth * micro_batch_s)  # what the pick depends on: the link's seconds per micro-batch's
        if not self.cadence.moved(ratio):
            return None  # the link and the micro-batch moved too little since the last pick to re-pick
        decision = pick_cap(self.schedule, self.workload, self.transport.topology, self.config, self.candidates,
                            self.cap, micro_batch_s, bandwidth, self.config.adapt_overhead, self.group)
        self.cadence.ratio = ratio
        self.decisions.append({**decision.record(step), "t": time.perf_counter()})
        if decision.new == decision.old:
            return None
        self.set_cap(decision.new, step)
        return decision

    def metrics(self, step: int, collected: dict[str, Any]) -> dict[str, Any]:
        """:meth:`after_round` on the pair the job ``collected`` carried: the step's extra metrics, ``{"adapt":
        the change}`` when the cap changed, else empty."""
        decision = self.after_round(step, collected.get("probe"))
        return {} if decision is None else {"adapt": decision.record(step)}

    def set_cap(self, new: int, step: int) -> None:
        """Cap the stages at ``new`` micro-batches from the stage beginning now on (after step ``step``; module
        docstring: what happens to the state)."""
        if new not in self.candidates:
            raise ValueError(f"max_accumulation must be one of the candidates {self.candidates[0]}.."
                             f"{self.candidates[-1]}, got {new}")
        self._take(new, step)

    def apply(self, value: int) -> None:
        self.overlap.set_cap(value)


__all__ = ["CapAdaptConfig", "CapController", "CapDecision", "pick_cap", "predicted_share"]
