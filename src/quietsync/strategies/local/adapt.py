"""``--adapt`` for DiLoCo: re-pick the sync period H and/or the pseudo-gradient bits during the run from the
measured link and inner step time (``adapt_knobs``: H, bits, or H,bits).

**What is measured** (every ``adapt_every`` outer syncs, at the step right after a sync launched): the link, as
bytes/s of the outer syncs completed since the last decision -- bytes this worker sent on the sync group over the
seconds those transfers took, from the transport's meter (on an emulated link the emulation's time, on a real one
the wire's); and the inner step, as the median main-thread compute seconds of this worker's last
``adapt_window`` inner steps.
The workers agree on both (the fastest link any worker saw -- a worker that reached the sync first also waited
for the others, which the slowest-arriving one did not -- and the slowest worker's step, which a synchronous
outer sync waits for), on the transport's control group, so every worker takes the same decision.

**The decision** (:func:`pick_sync_every`) uses the cost model: for each candidate H, the strategy's own cost
schedule (:func:`~quietsync.strategies.local.cost.diloco`, the bytes of each fragment's exchange, overlap with τ)
evaluated on the measured link (α = 0: the measured rate already holds the per-message costs) and the measured
step gives the exposed communication per step and the compute per step. The pick is the **smallest** candidate
whose exposed communication is at most ``adapt_overhead`` of its compute (the largest candidate when none is):
DiLoCo's loss per token grows with H (Charles et al. 2025, "Scaling Laws for DiLoCo", §5: the loss grows with H,
less for larger models -- a figure, no formula, so the planner's priors give H no central cost either), so the
best H is the smallest one the link carries at a bounded cost in speed. When the link drops, H grows until the
sync fits the budget again; when it recovers, H comes back down. The controller re-picks only when the measured
ratio of sync to step time moved by more than ``adapt_threshold`` since its last pick (the first decision always
picks), so a shared machine's noise in the step time does not flip H back and forth.

**The objective** (``adapt_objective``). ``overhead`` (the default) is the rule above: a fixed budget on the
sync's share, no model of the loss. ``time_to_target`` is the planner's objective (:mod:`quietsync.plan`): the
predicted time to the target loss, **tokens to the target × seconds per token**, where the seconds per token are
``(1 + exposed/compute)`` times the compute's (the same cost model on the measured link and step; a step holds the
same tokens at every H and dtype) and the tokens to the target of each candidate are given (``adapt_tokens``: the
plan's tokens-to-target column for the DiLoCo rows at those knobs -- a pilot's measurement or the papers' prior),
the tokens of a pair (H, dtype) the product of its H's and its dtype's (an assumption: the two effects
independent). The pick is the pair of least predicted time. So on the link the plan was made for, the controller
picks what the plan picked where the run's measured step agrees with the plan's prediction (the plan corrects each
row's speed by what its pilot measured, the controller by what the run measures), and on a link that drops it
picks what the plan would have picked for that link: a larger H or fewer bits only where the time it saves on the
wire outweighs the tokens it costs.

**The bits** (``adapt_knobs`` with ``bits``; candidates ``adapt_pseudo_grad_dtype``, most bits first): the same cost
model prices each (H, dtype) pair by the bytes of its sync (fp32 4 B, bf16 2 B, int8 1 B per value, packed
low-bit codes with their block scales); the pick is the smallest H, and at it the dtype with the most bits, whose
exposed communication is at most ``adapt_overhead`` of the compute -- fewer bits before a longer round, since
Streaming DiLoCo reports 4-bit outer gradients at no loss (Douillard et al. 2025, §3.3), while a larger H costs
loss (above). Nothing fits: the largest H with the fewest bits. A change of bits is taken right after a sync
launched, like H's; with τ > 0 it first waits for the fragment in flight (its exchange ends in the old dtype), and
the next launch uses the new one. What it does to the error-feedback residual: :mod:`.adapt_bits` (one residual
per fragment, carried across every change; a dtype without error feedback sends it and leaves it empty).
θ_global, the outer momentum, the inner optimizer and a fragment's schedule are untouched by a change of bits.

**What a change does to the state** (H changes only right after a sync launched, at a step ``s`` that is a
multiple of both the old and the new H: the candidates form a chain where each divides the next, and the
change is taken at a sync step ``s``, a multiple of the old H; a larger new H whose multiple ``s`` is not ends
its first round at the next multiple of the new H, a shorter first round, so the schedule stays "sync after every
step that is a multiple of H" and the budgets' meeting points stay on syncs):

* θ_global and the outer optimizer's momentum (Nesterov buffer): kept as they are; the momentum keeps averaging
  pseudo-gradients of rounds of different lengths (larger H, larger Δ), as DiLoCo's outer SGD does with a
  partial last round.
* the inner optimizer (AdamW moments, step counts) and the learning-rate schedule: untouched (they count inner
  steps, which H does not change).
* error-feedback residuals of a low-bit or replicated pseudo-gradient: kept (they are in pseudo-gradient units
  and are added to the next sync's Δ, whatever its round length).
* a fragment in flight (τ > 0): the change is taken right after its launch; it is merged τ steps later as
  scheduled, and every candidate H is at least τ, so the next launch comes after that merge.

Only ``fragments = 1`` (the staggered schedule of several fragments would need a change point per fragment), and
τ is not adapted (a change of τ would move the merge of the fragment in flight: refused with the other knobs).

Checkpoints hold the current H, dtype, the step of the last change and the decision cadence (syncs counted towards
the next decision, the ratio of the last pick: :class:`~quietsync.strategies.parts.link_probe.Cadence`) of
:class:`SyncPeriod`, so a run resumed after a change goes on with the adapted knobs, exactly as if it had not
stopped, and decides at the same syncs against the same reference (the probe's measurements start afresh).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ...cost.workload import Workload
from ...link import LinkModel
from ...topology import Topology
from ...transport import Transport
from ...validate import check_choice
from ...wire.packed import LOWBIT_PSEUDO_GRAD_DTYPES
from ..parts.link_probe import Cadence, LinkProbe, check_cadence_knobs, exposed_ratio
from ..parts.part import Part
from . import cost
from .adapt_bits import BITS, bits_candidates, parse_knobs
from .fragments import FragmentSchedule


@dataclass
class AdaptConfig:
    """The ``--adapt`` knobs of a strategy whose sync period can change during the run (DiLoCo's H)."""

    adapt: bool = False
    """Re-pick H (sync_every) during the run from the measured link and inner step time: the smallest candidate H
    whose outer sync adds at most adapt_overhead of the compute (docs/local.md, 'Adapting H to the link')."""
    adapt_every: int = 1
    """With adapt: outer syncs between two decisions."""
    adapt_overhead: float = 0.1
    """With adapt: the largest share of the compute the exposed outer communication may add (0.1 = 10%)."""
    adapt_threshold: float = 0.5
    """With adapt: re-pick only when the measured sync-to-step ratio (step seconds x link bytes/s, inverted) moved
    by more than this factor since the last pick (0.5: below 1/1.5 or above 1.5 of it), so the noise of a shared
    machine does not flip H back and forth; 0: re-pick at every decision."""
    adapt_window: int = 32
    """With adapt: the inner step time is the median of this worker's last N inner steps' compute."""
    adapt_sync_every: str = ""
    """With adapt: the candidate H values, comma-separated, each dividing the next and including sync_every
    (e.g. 8,16,32,64,128); default: sync_every times 1, 2, 4, 8, 16 (H grows from the chosen one when the link
    cannot carry it, and comes back down to it)."""
    adapt_knobs: str = "H"
    """With adapt: the knobs re-picked, comma-separated: H (sync_every), bits (pseudo_grad_dtype), or H,bits."""
    adapt_pseudo_grad_dtype: str = ""
    """With adapt bits: the candidate pseudo-gradient dtypes, most bits first, including pseudo_grad_dtype (e.g.
    fp32,bf16,fp4,int2); default: pseudo_grad_dtype, then fp4 and int2 where they have fewer bits."""
    adapt_objective: str = "overhead"
    """With adapt: what a pick minimizes. overhead: the smallest H (then the most bits) whose sync adds at most
    adapt_overhead of the compute; time_to_target: the predicted time to the target loss, tokens to the target
    (adapt_tokens) x seconds per token on the measured link and step -- the planner's objective."""
    adapt_tokens: str = ""
    """With adapt_objective time_to_target: each candidate's tokens to the target loss (any common scale), as
    KNOB:TOKENS comma-separated, KNOB an H or a dtype (e.g. 16:1.0,32:1.12,64:1.3,fp4:1.0) -- the plan's tokens
    to the target of the DiLoCo rows at those knobs; every candidate of an adapted knob listed. A candidate (H,
    dtype) costs the product of its H's and its dtype's."""

    def adapted_knobs(self) -> tuple[str, ...]:
        """The knobs ``adapt`` re-picks (checked; none without ``adapt``)."""
        return parse_knobs(self.adapt_knobs) if self.adapt else ()

    def check_adapt_knobs(self) -> None:
        """Check the knobs that need no other config (with or without ``adapt``)."""
        check_cadence_knobs(self)
        parse_knobs(self.adapt_knobs)
        check_choice("adapt_objective", self.adapt_objective, OBJECTIVES)
        parse_tokens(self.adapt_tokens)

    def token_factors(self, candidates: tuple[int, ...],
                      dtypes: tuple[str, ...]) -> dict[tuple[int, str], float] | None:
        """Tokens to the target of each candidate (H, dtype) under ``adapt_objective`` time_to_target (None under
        overhead), checked: every candidate of an adapted knob needs its entry in ``adapt_tokens``."""
        if self.adapt_objective != "time_to_target":
            return None
        given = parse_tokens(self.adapt_tokens)
        needed = ([str(h) for h in candidates] if len(candidates) > 1 else []) + (list(dtypes) if len(dtypes) > 1
                                                                                 else [])
        missing = [k for k in needed if k not in given]
        if not given or missing:
            raise ValueError(f"adapt_tokens must give the tokens to the target of every candidate "
                             f"({','.join(needed)}) with adapt_objective time_to_target, e.g. "
                             f"{','.join(f'{k}:1.0' for k in needed)}; missing {','.join(missing) or 'all'}")
        return {(h, d): (given[str(h)] if len(candidates) > 1 else 1.0) * (given[d] if len(dtypes) > 1 else 1.0)
                for h in candidates for d in dtypes}

    def adapt_candidates(self, sync_every: int, fragments: int, overlap_delay: int) -> tuple[int, ...]:
        """The candidate H values, checked (raises ValueError naming the knob and the allowed form)."""
        self.check_adapt_knobs()
        if self.adapt and fragments != 1:
            raise ValueError(f"adapt changes its knobs only with fragments 1 (a staggered schedule of {fragments} "
                             "fragments has no step where every fragment just synced), got fragments "
                             f"{fragments}")
        if self.adapt and "H" not in self.adapted_knobs():
            return (sync_every,)  # H stays as configured
        if self.adapt_sync_every.strip():
            try:
                values = tuple(int(v) for v in self.adapt_sync_every.split(","))
            except ValueError:
                raise ValueError(f"adapt_sync_every must be whole numbers >= 1, comma-separated, each dividing the "
                                 f"next (e.g. 8,16,32), got {self.adapt_sync_every!r}") from None
        else:  # H, 2H, ... 16H: never below the H chosen for the run (a smaller H is not free in loss either)
            values = tuple(sync_every * 2 ** k for k in range(5))
        if any(v < 1 for v in values) or any(b % a for a, b in zip(values, values[1:])) or list(values) != sorted(
                set(values)):
            raise ValueError(f"adapt_sync_every must be whole numbers >= 1, increasing, each dividing the next "
                             f"(e.g. 8,16,32), got {self.adapt_sync_every!r}")
        if sync_every not in values:
            raise ValueError(f"adapt_sync_every must include sync_every ({sync_every}), got "
                             f"{','.join(map(str, values))}")
        too_short = [v for v in values if v < overlap_delay]
        if too_short:
            raise ValueError(f"adapt_sync_every values must be >= overlap_delay ({overlap_delay}: a fragment in "
                             f"flight is merged before the next launch), got {','.join(map(str, too_short))}")
        return values


OBJECTIVES = ("overhead", "time_to_target")
"""What ``adapt_objective`` may name."""


def parse_tokens(text: str) -> dict[str, float]:
    """``adapt_tokens`` as {knob: tokens} (knob an H as written, or a dtype), checked (raises ValueError naming the
    form)."""
    out: dict[str, float] = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        key, _, value = item.partition(":")
        key = key.strip()
        try:
            tokens = float(value)
        except ValueError:
            tokens = math.nan
        is_h = key.isdigit() and int(key) >= 1
        if not (is_h or key in BITS) or not math.isfinite(tokens) or tokens <= 0 or key in out:
            raise ValueError(f"adapt_tokens must be KNOB:TOKENS, comma-separated, KNOB an H (>= 1) or a dtype among "
                             f"{', '.join(BITS)}, each once, TOKENS > 0 (e.g. 16:1.0,32:1.1), got {text!r}")
        out[str(int(key)) if is_h else key] = tokens
    return out


@dataclass(frozen=True)
class Decision:
    """One decision of the controller (logged in the step's metrics as ``adapt``)."""

    old: int
    new: int
    old_dtype: str
    new_dtype: str
    bandwidth: float
    """Measured link, bytes/s (agreed over the workers)."""
    step_s: float
    """Measured inner step, compute seconds (the slowest worker's)."""
    share: float
    """Predicted exposed communication / compute at the new H."""
    why: str
    knob: str = "sync_every"
    """What was re-picked: sync_every, pseudo_grad_dtype, or sync_every/pseudo_grad_dtype (both)."""

    def record(self, step: int) -> dict[str, Any]:
        """The log entry: ``knob`` sync_every, pseudo_grad_dtype, or both (``old``/``new`` then "H/dtype")."""
        old, new = {"sync_every": (self.old, self.new), "pseudo_grad_dtype": (self.old_dtype, self.new_dtype)}.get(
            self.knob, (f"{self.old}/{self.old_dtype}", f"{self.new}/{self.new_dtype}"))
        return {"step": step, "knob": self.knob, "old": old, "new": new,
                "bandwidth_mbit": round(self.bandwidth * 8 / 1e6, 3), "step_s": round(self.step_s, 6),
                "share": round(self.share, 4), "why": self.why}


def predicted_share(workload: Workload, topo: Topology, cfg: Any, sync_every: int, step_s: float,
                    link: LinkModel, group: str, dtype: str | None = None) -> float:
    """Exposed communication / compute per inner step that the cost model predicts for ``cfg`` at H =
    ``sync_every`` (and pseudo-gradient ``dtype``, default cfg's), with inner steps of ``step_s`` compute seconds
    and the sync group's link ``link``."""
    dtype = dtype or cfg.pseudo_grad_dtype
    # at this H and dtype as a fixed run (the schedule of an adapt config would pick its own H: cost.AdaptedH)
    fixed = dataclasses.replace(cfg, sync_every=sync_every, adapt=False, pseudo_grad_dtype=dtype,
                                pseudo_grad_error_feedback=bool(cfg.pseudo_grad_error_feedback
                                                                and dtype in LOWBIT_PSEUDO_GRAD_DTYPES))
    accumulation = max(1, int(getattr(cfg, "accumulation", 1)))
    return exposed_ratio(cost.diloco(workload, topo, fixed), workload.params, accumulation, step_s, topo, group, link)


def pick_sync_every(workload: Workload, topo: Topology, cfg: Any, candidates: tuple[int, ...], current: int,
                    step_s: float, bandwidth: float, overhead: float, group: str,
                    dtypes: tuple[str, ...] | None = None, current_dtype: str | None = None,
                    tokens: dict[tuple[int, str], float] | None = None) -> Decision:
    """The pick among the candidate (H, dtype) pairs (``dtypes``, most bits first; default: cfg's only).

    Without ``tokens`` (``adapt_objective`` overhead): the smallest H, and at it the dtype with the most bits, whose
    predicted exposed communication is at most ``overhead`` of the compute (the largest H with the fewest bits when
    none is). With ``tokens`` (time_to_target: each pair's tokens to the target): the pair of least predicted time
    to the target, ``tokens × (1 + exposed/compute)`` -- a step's tokens and compute are the same at every H and
    dtype, so its time per token is ``(1 + share)`` times the compute's; ties go to the earlier pair. See the module
    docstring."""
    link = LinkModel(bandwidth, 0.0)
    dtypes = dtypes or (cfg.pseudo_grad_dtype,)
    current_dtype = current_dtype or cfg.pseudo_grad_dtype
    pairs = [(h, d) for h in candidates for d in dtypes]
    shares = {(h, d): predicted_share(workload, topo, cfg, h, step_s, link, group, d) for h, d in pairs}
    rate = f"{bandwidth * 8 / 1e6:.3g} Mbit/s, inner step {step_s * 1e3:.3g} ms"
    knob = "sync_every" if len(dtypes) == 1 else ("pseudo_grad_dtype" if len(candidates) == 1
                                                  else "sync_every/pseudo_grad_dtype")
    if tokens is not None:
        time = {p: tokens[p] * (1 + shares[p]) for p in pairs}
        best = min(time.values())
        # the first pair within rounding of the least: the order of the candidates breaks exact ties
        new = next(p for p in pairs if time[p] <= best * (1 + 1e-9))
        kept = time.get((current, current_dtype))  # the current pair is a candidate (the schedule holds no other)
        why = (f"{rate}: least predicted time to target (tokens x{tokens[new]:.3g}, sync adds {shares[new]:.1%}"
               + (f"; x{time[new] / kept:.3g} the time of keeping {current}/{current_dtype})" if kept else ")"))
        return Decision(current, new[0], current_dtype, new[1], bandwidth, step_s, shares[new], why, knob)
    fits = [p for p in pairs if shares[p] <= overhead]
    new = fits[0] if fits else pairs[-1]
    what = "H" if len(dtypes) == 1 else ("dtype" if len(candidates) == 1 else "H, then the most bits,")
    if fits:
        why = f"{rate}: smallest {what} whose sync adds <= {overhead:.0%} (predicted {shares[new]:.1%})"
    else:
        why = f"{rate}: nothing keeps the sync under {overhead:.0%}; the cheapest ({shares[new]:.1%})"
        if len(dtypes) == 1:
            why = f"{rate}: no H keeps the sync under {overhead:.0%}; the largest ({shares[new]:.1%})"
    return Decision(current, new[0], current_dtype, new[1], bandwidth, step_s, shares[new], why, knob)


class AdaptiveSchedule(FragmentSchedule):
    """The sync schedule of one fragment whose H may change: a sync after every step that is a multiple of the
    current H (module docstring), and the change step counted as a launch."""

    def __init__(self, sync_every: int) -> None:
        super().__init__(sync_every, 1)
        self.changed_at = 0
        """The step of the last change of H (0: none); a sync launched right there."""

    def last_launch(self, f: int, step: int) -> int:
        """The latest multiple of H at or before ``step``, or the change step when that is later (0: none)."""
        return max(step // self.H * self.H, self.changed_at if self.changed_at <= step else 0)


class SyncPeriod(Part):
    """The controller DiLoCo holds under ``adapt``: measures, decides, and keeps the current H (checkpointed).

    Args:
        transport: the transport (its meter, and its control group for the agreement).
        group: the group the outer syncs run on.
        config: DiLoCo's config (its ``sync_every`` is changed in place when H changes).
        model, param_groups: what the cost model's workload is read from.
    """

    def __init__(self, transport: Transport, group: str, config: Any, model: torch.nn.Module,
                 param_groups: list[dict[str, Any]]) -> None:
        self.transport, self.group, self.config = transport, group, config
        self.candidates = config.adapt_candidates(config.sync_every, config.fragments, config.overlap_delay)
        self.dtypes = bits_candidates(config) if "bits" in config.adapted_knobs() else (config.pseudo_grad_dtype,)
        """The candidate pseudo-gradient dtypes, most bits first (the configured one only without bits)."""
        self.exchanges: list[Any] = []
        """The fragments' exchanges whose dtype a change of bits sets (:meth:`bind`)."""
        self._quiesce: Any = None
        self.workload = Workload.from_model(model, tokens_per_micro_batch=1, param_groups=param_groups)
        self.tokens = config.token_factors(self.candidates, self.dtypes)
        """Tokens to the target of each (H, dtype) under adapt_objective time_to_target (None: overhead)."""
        self.schedule = AdaptiveSchedule(config.sync_every)
        """The outer sync's schedule (the strategy's outer machinery runs on it)."""
        self.decisions: list[dict[str, Any]] = []
        """Every decision taken (changes and keeps), as :meth:`Decision.record` (rank-local, for reports)."""
        self._probe = LinkProbe(transport, group, config.adapt_window)
        self.cadence = Cadence(config.adapt_every, config.adapt_threshold)
        """When it decides: every adapt_every syncs, on a ratio that moved (checkpointed)."""

    def bind(self, exchanges: list[Any], quiesce: Any) -> None:
        """The outer sync's exchanges (a :class:`~.adapt_bits.SwitchedExchange` each under bits) and how to wait
        for the fragment in flight (before a change of bits)."""
        self.exchanges, self._quiesce = exchanges, quiesce

    @property
    def sync_every(self) -> int:
        return int(self.config.sync_every)

    @property
    def dtype(self) -> str:
        return str(self.config.pseudo_grad_dtype)

    @property
    def changed_at(self) -> int:
        """The step of the last change of H (0: none)."""
        return self.schedule.changed_at

    def _take(self, sync_every: int, changed_at: int) -> None:
        self.config.sync_every = self.schedule.H = int(sync_every)
        self.schedule.changed_at = int(changed_at)

    def after_inner_step(self, step: int, synced: bool, compute_s: float) -> Decision | None:
        """Count inner step ``step`` (``compute_s`` of main-thread compute); right after a sync launched, every
        ``adapt_every`` syncs, decide (a collective on the control group: every worker calls it at the same
        steps). Returns the decision when H changed."""
        self._probe.step_done(compute_s)
        if not synced:
            return None
        if not self.cadence.due():
            return None
        bandwidth, step_s = self._probe.measure()  # agreed over the workers (parts/link_probe.py)
        if bandwidth <= 0 or step_s <= 0:  # no completed sync to measure yet (τ > 0: the first is in flight)
            return None
        ratio = 1.0 / (bandwidth * step_s)  # what the pick depends on: the sync's seconds per inner step's
        if not self.cadence.moved(ratio):
            return None  # the link and the step moved too little since the last pick to re-pick
        decision = pick_sync_every(self.workload, self.transport.topology, self.config, self.candidates,
                                   self.sync_every, step_s, bandwidth, self.config.adapt_overhead, self.group,
                                   self.dtypes, self.dtype, self.tokens)
        self.cadence.ratio = ratio
        self.decisions.append({**decision.record(step), "t": time.perf_counter()})
        if decision.new == decision.old and decision.new_dtype == decision.old_dtype:
            return None
        if decision.new_dtype != decision.old_dtype:
            self.set_dtype(decision.new_dtype, step)
        if decision.new != decision.old:
            self.set_sync_every(decision.new, step)
        return decision

    def set_dtype(self, new: str, step: int) -> None:
        """Send the next syncs' pseudo-gradients in ``new``, right after the sync launched after ``step`` (the
        fragment in flight is waited for first; :mod:`.adapt_bits`: what happens to the residual)."""
        if new not in self.dtypes:
            raise ValueError(f"pseudo_grad_dtype must be one of the candidates {self.dtypes}, got {new!r}")
        if step % self.sync_every:
            raise ValueError(f"the bits change only right after a sync (a multiple of H = {self.sync_every}), got "
                             f"step {step}")
        self._take_dtype(new)

    def _take_dtype(self, new: str) -> None:
        if self._quiesce is not None:
            self._quiesce()  # the exchange in flight ends in the dtype it started with
        self.config.pseudo_grad_dtype = new
        for e in self.exchanges:
            e.current = new

    def set_sync_every(self, new: int, step: int) -> None:
        """Take H = ``new`` right after the sync launched after ``step`` (module docstring: what happens to the
        state)."""
        if new not in self.candidates:
            raise ValueError(f"sync_every must be one of the candidates {self.candidates}, got {new}")
        if step % self.sync_every:
            raise ValueError(f"H changes only right after a sync (a multiple of H = {self.sync_every}), got step "
                             f"{step}")
        self._take(new, step)

    # ------------------------------------------------------------------ part protocol
    def state_dict(self) -> dict[str, Any]:
        return {"sync_every": self.sync_every, "changed_at": self.changed_at, "pseudo_grad_dtype": self.dtype,
                **self.cadence.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._take(state["sync_every"], state["changed_at"])
        self.cadence.load(state)
        if len(self.dtypes) > 1 and state.get("pseudo_grad_dtype") in self.dtypes:
            self._take_dtype(state["pseudo_grad_dtype"])

    def logical_state(self) -> dict[str, torch.Tensor]:
        out = {"adapt.sync_every": torch.tensor(self.sync_every, dtype=torch.int64),
               "adapt.changed_at": torch.tensor(self.changed_at, dtype=torch.int64)}
        if len(self.dtypes) > 1:  # the current dtype, as its index among the candidates
            out["adapt.dtype"] = torch.tensor(self.dtypes.index(self.dtype), dtype=torch.int64)
        return {**out, **self.cadence.logical_state()}

    def logical_targets(self, saved: dict[str, Any]) -> dict[str, torch.Tensor]:
        keys = ("adapt.sync_every", "adapt.changed_at", "adapt.dtype")
        return {**{k: torch.zeros((), dtype=torch.int64) for k in keys if k in saved},
                **Cadence.logical_targets(saved)}

    def load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        if "adapt.sync_every" in filled:  # a checkpoint of a run without --adapt has none: H stays as configured
            self._take(int(filled["adapt.sync_every"]), int(filled["adapt.changed_at"]))
            self.cadence.load_logical(filled)
        if "adapt.dtype" in filled and len(self.dtypes) > 1:
            self._take_dtype(self.dtypes[int(filled["adapt.dtype"])])


__all__ = ["AdaptConfig", "AdaptiveSchedule", "Decision", "SyncPeriod", "pick_sync_every", "predicted_share"]
