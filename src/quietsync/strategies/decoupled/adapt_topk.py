"""``--adapt`` for DeMo: re-pick the top-k per DCT chunk (``topk``) during the run from the measured link and step.

**What is measured** (every ``adapt_every`` replicating steps, right after the step's exchange): the link, as bytes/s
of the exchanges completed since the last decision, and the step, as the median main-thread compute seconds of the
last ``adapt_window`` steps -- both agreed over the workers on the transport's control group
(:class:`~quietsync.strategies.parts.link_probe.LinkProbe`, the pieces DiLoCo's controller uses), so every worker
takes the same decision at the same step.

**The decision** (:func:`pick_topk`): for each candidate k (``adapt_topk``, largest first), DeMo's own cost schedule
(:func:`~quietsync.strategies.decoupled.cost.demo`: the all-gather of the k values and positions of every block,
one per replicating step) evaluated on the measured link (α = 0: the measured rate already holds the per-message
costs) and step gives the exposed communication per step (DeMo's exchange blocks: all of it) and the compute. The
pick is the **largest** k whose exchange adds at most ``adapt_overhead`` of the compute (the smallest candidate when
none does). Largest, because fewer coefficients cost loss per token: DeMo reaches AdamW's loss sending up to 85×
less than the full gradient (Peng et al. 2024, abstract), and DeToNATION's TopK sweep (paper 001, "TopK", Fig. 8)
finds one k clearly best for its setup and a much smaller one degrading the loss badly -- a figure, no formula, so
the planner's prior charges an assumed +1% per halving of the density below 1/85. So the best k is the largest the
link carries at a bounded cost in speed: when the link drops, k shrinks until the exchange fits the budget again;
when it recovers, k comes back up (by default never above the k the run was given). As DiLoCo's controller, it
re-picks only when the measured ratio of exchange to step time moved by more than ``adapt_threshold`` since its last
pick (the first decision always picks), so a shared machine's noise does not flip k back and forth.

**What a change of k does to the state** (taken right after step ``s``'s exchange completed; DeMo's exchange blocks,
so nothing is in flight):

* the decoupled momentum δ (DCT coefficients of every block): untouched. δ already holds everything not yet sent
  (error feedback: the extracted top-k is removed from it, minus what a low-bit or bf16 transfer lost, which stays),
  so a change of k only changes how much of δ the next extraction takes: a smaller k leaves more in δ, a larger
  one takes more of it at the next step; nothing owed is dropped or sent twice.
* the base optimizer (DeMo-SGD; decoupled AdamW's moments), the decoupled step counter, the replicator's counters
  and the lr schedule: untouched (none depends on k).
* the replicator's buffers sized by k (the picked values and positions) are rebuilt at the next extraction.

Checkpoints (the plain one and the logical one) hold the current k, the step of the last change and the decision
cadence (exchanges counted towards the next decision, the ratio of the last pick:
:class:`~quietsync.strategies.parts.link_probe.Cadence`), so a run resumed after a change goes on with the adapted
k, exactly as if it had not stopped, and decides at the same exchanges against the same reference (the probe's
measurements start afresh). ``--adapt`` re-picks ``topk`` of the ``dct`` replicator only, and needs ``topk`` given
(a k derived from ``compression`` differs per block shape).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from ...cost.workload import Workload
from ...link import LinkModel
from ...topology import Topology
from ..parts.knob_controller import KnobController
from ..parts.link_probe import Cadence, KnobDecision, LinkProbe, check_cadence_knobs, exposed_ratio
from . import cost
from .round import DecoupledConfig

ADAPT_KNOBS = ("topk",)
"""The knobs ``adapt_knobs`` may name for ``demo``."""


@dataclass
class DeMoConfig(DecoupledConfig):
    """Knobs of ``demo``: the decoupled ones plus ``--adapt`` of the top-k."""

    adapt: bool = False
    """Re-pick topk during the run from the measured link and step time: the largest candidate k whose exchange adds
    at most adapt_overhead of the compute (docs/demo.md, 'Adapting top-k to the link'); needs replicator dct and
    topk."""
    adapt_every: int = 16
    """With adapt: replicating steps between two decisions."""
    adapt_overhead: float = 0.1
    """With adapt: the largest share of the compute the exchange may add (0.1 = 10%)."""
    adapt_threshold: float = 0.5
    """With adapt: re-pick only when the measured exchange-to-step ratio moved by more than this factor since the
    last pick (0.5: below 1/1.5 or above 1.5 of it); 0: re-pick at every decision."""
    adapt_window: int = 32
    """With adapt: the step time is the median of this worker's last N steps' compute."""
    adapt_knobs: str = "topk"
    """With adapt: the knobs re-picked; demo has one, topk."""
    adapt_topk: str = ""
    """With adapt: the candidate k values, comma-separated, largest first, including topk (e.g. 32,16,8,4);
    default: topk, topk/2, topk/4, topk/8, topk/16 (at least 1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_cadence_knobs(self)
        knobs = [k.strip() for k in self.adapt_knobs.split(",") if k.strip()]
        if knobs != list(ADAPT_KNOBS):
            raise ValueError(f"adapt_knobs must be {', '.join(ADAPT_KNOBS)} (demo re-picks its top-k per chunk "
                             f"only), got {self.adapt_knobs!r}")
        if self.adapt:
            self.topk_candidates()

    def topk_candidates(self) -> tuple[int, ...]:
        """The candidate k values, largest first, checked (raises ValueError naming the knob and the allowed
        form)."""
        if self.replicator != "dct":
            raise ValueError(f"replicator must be dct when adapt is on (--adapt: it re-picks the dct replicator's "
                             f"topk), got {self.replicator!r}")
        if self.topk is None:
            raise ValueError("topk must be given when adapt is on (--adapt: the k it starts from and comes back to; a "
                             "k derived from compression differs per block shape)")
        if self.adapt_topk.strip():
            try:
                values = tuple(int(v) for v in self.adapt_topk.split(","))
            except ValueError:
                raise ValueError(f"adapt_topk must be whole numbers from 1 to chunk**2 ({self.chunk ** 2}), "
                                 f"comma-separated, largest first (e.g. 32,16,8), got {self.adapt_topk!r}") from None
        else:  # k, k/2, ... k/16: never above the k chosen for the run (a larger k is not free in bytes)
            values = tuple(dict.fromkeys(max(1, self.topk >> i) for i in range(5)))
        if (any(not 1 <= v <= self.chunk ** 2 for v in values)
                or list(values) != sorted(set(values), reverse=True)):
            raise ValueError(f"adapt_topk must be whole numbers from 1 to chunk**2 ({self.chunk ** 2}), each once, "
                             f"largest first (e.g. 32,16,8), got {self.adapt_topk!r}")
        if self.topk not in values:
            raise ValueError(f"adapt_topk must include topk ({self.topk}), got {','.join(map(str, values))}")
        return values


class TopkDecision(KnobDecision):
    """One decision of DeMo's controller (``step_s``: the slowest worker's step, compute seconds)."""

    knob = "topk"


def predicted_share(workload: Workload, topo: Topology, cfg: Any, topk: int, step_s: float, link: LinkModel,
                    group: str) -> float:
    """Exposed communication / compute per step that DeMo's cost schedule predicts for ``cfg`` at ``topk``, with
    steps of ``step_s`` compute seconds and the group's link ``link``."""
    fixed = dataclasses.replace(cfg, topk=topk, adapt=False)  # at this k as a fixed run
    accumulation = max(1, int(getattr(cfg, "accumulation", 1)))
    return exposed_ratio(cost.demo(workload, topo, fixed), workload.params, accumulation, step_s, topo, group, link)


def pick_topk(workload: Workload, topo: Topology, cfg: Any, candidates: tuple[int, ...], current: int, step_s: float,
              bandwidth: float, overhead: float, group: str) -> TopkDecision:
    """The largest candidate k (``candidates``: largest first) whose predicted exposed communication is at most
    ``overhead`` of the compute, the smallest when none is; see the module docstring."""
    link = LinkModel(bandwidth, 0.0)
    shares = {k: predicted_share(workload, topo, cfg, k, step_s, link, group) for k in candidates}
    fits = [k for k in candidates if shares[k] <= overhead]
    new = fits[0] if fits else candidates[-1]
    rate = f"{bandwidth * 8 / 1e6:.3g} Mbit/s, step {step_s * 1e3:.3g} ms"
    if fits:
        why = f"{rate}: largest k whose exchange adds <= {overhead:.0%} (predicted {shares[new]:.1%})"
    else:
        why = f"{rate}: no k keeps the exchange under {overhead:.0%}; the smallest ({shares[new]:.1%})"
    return TopkDecision(current, new, bandwidth, step_s, shares[new], why)


class TopkController(KnobController):
    """The controller DeMo holds under ``adapt``: measures, decides, and keeps the current k (checkpointed).

    Args:
        transport: the transport (its meter, and its control group for the agreement).
        group: the group the exchange runs on.
        config: DeMo's config (its ``topk`` is the starting k; it is not changed).
        replicator: the dct replicator whose k a change sets (:meth:`DCTReplicator.set_topk`).
        model, param_groups: what the cost model's workload is read from.
    """

    def __init__(self, transport: Any, group: str, config: DeMoConfig, replicator: Any, model: torch.nn.Module,
                 param_groups: list[dict[str, Any]]) -> None:
        self.transport, self.group, self.config, self.replicator = transport, group, config, replicator
        self.candidates = config.topk_candidates()
        self.workload = Workload.from_model(model, tokens_per_micro_batch=1, param_groups=param_groups)
        self.changed_at = 0
        """The step of the last change of k (0: none)."""
        self.decisions: list[dict[str, Any]] = []
        """Every decision taken (changes and keeps), as :meth:`TopkDecision.record` (rank-local, for reports)."""
        self._probe = LinkProbe(transport, group, config.adapt_window)
        self.cadence = Cadence(config.adapt_every, config.adapt_threshold)
        """When it decides: every adapt_every exchanges, on a ratio that moved (checkpointed)."""

    KNOB = "topk"

    @property
    def value(self) -> int:
        """The k the next extraction sends per block."""
        return int(self.replicator.topk)

    topk = value

    def after_step(self, step: int, replicated: bool, compute_s: float) -> TopkDecision | None:
        """Count step ``step`` (``compute_s`` of main-thread compute); right after an exchange, every
        ``adapt_every`` of them, decide (a collective on the control group: every worker calls it at the same
        steps). Returns the decision when k changed."""
        self._probe.step_done(compute_s)
        if not replicated:
            return None
        if not self.cadence.due():
            return None
        bandwidth, step_s = self._probe.measure()
        if bandwidth <= 0 or step_s <= 0:  # nothing crossed a link to measure (no emulation, one worker)
            return None
        ratio = 1.0 / (bandwidth * step_s)  # what the pick depends on: the exchange's seconds per step's
        if not self.cadence.moved(ratio):
            return None  # the link and the step moved too little since the last pick to re-pick
        decision = pick_topk(self.workload, self.transport.topology, self.config, self.candidates, self.topk, step_s,
                             bandwidth, self.config.adapt_overhead, self.group)
        self.cadence.ratio = ratio
        self.decisions.append({**decision.record(step), "t": time.perf_counter()})
        if decision.new == decision.old:
            return None
        self.set_topk(decision.new, step)
        return decision

    def set_topk(self, new: int, step: int) -> None:
        """Send ``new`` coefficients per block from the step after ``step`` on (module docstring: what happens to
        the state)."""
        if new not in self.candidates:
            raise ValueError(f"topk must be one of the candidates {self.candidates}, got {new}")
        self._take(new, step)

    def apply(self, value: int) -> None:
        self.replicator.set_topk(value)


__all__ = ["DeMoConfig", "TopkController", "TopkDecision", "pick_topk", "predicted_share"]
