"""The pilots of a measured plan, end to end: which settings run a pilot, in what order, how each is judged, and
the plan re-scored with what they measured (the mechanics — runs, successive halving — are
:mod:`~quietsync.plan.pilots`).

:func:`run_pilots` takes a plan scored on the priors and returns it re-scored: the baseline's pilot gives the loss
model its baseline curve (measured up to where it ran, the fitted power law past that), each piloted setting's
curve its own estimate — by its tokens over the baseline's to the same loss, or, where its steps hold more tokens
than the baseline's, by the critical-batch rule fitted to its pilot (:mod:`~quietsync.plan.loss_model`) — and the
pilots' evaluation time the overhead of the planned run's evaluations. The report says what every pilot cost and
what running the candidates to the target is predicted to cost instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import tempfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from ..cost.costmodel import Links
from ..link import LinkModel
from ..strategies.registry import baselines, declaration
from .candidates import Candidate, candidate, parse_candidate
from .config import PlanError
from .critical_batch import CriticalBatch, measured
from .curve_fit import PowerLaw, fit_power_law
from .loss_model import RATIO_TAIL, BaselineCurve, LossEstimate, from_pilot_batch, from_pilot_tokens, from_prior
from .noise_scale import NoiseScale, measure_pilot
from .objective import Objective
from .pilots import PilotCurve, ProcessRunner, rungs, successive_halving
from .priors import PriorContext, prior_for
from .recommend import TRY_FIRST, Scored, best_per_strategy, fmt_duration
from .result import PlanResult
from .schedules import strategy_config
from .table import Row


def adaptive(strategy: str) -> bool:
    """Whether ``strategy``'s steps depend on timing (it declares adaptive stages): its pilots run through an
    emulated link."""
    return declaration(strategy).plan.stages > 0
CONFIRM_TOP = 2
"""How many of the best settings must rest on a pilot (or on the baseline's exact trajectory) — and besides them
every setting the advice lists under "Try first" (:data:`~quietsync.plan.recommend.TRY_FIRST`, each strategy's best)
and every setting the table ranks above the last of those: a recommendation, and the rows it is chosen among, rest
on a measurement, not on a paper's number (plain DiLoCo H = 16 ranked fourth at 50 Mbit/s on its prior, 175 s, and
took 421 s; its pilot predicts 262 s). On the 50 Mbit/s link of the equal-loss runs the
random replicator at 1/32 was listed third on its prior (+2%: 144 s predicted) while it did not reach the target in
600 s (its held-out loss 6.3 against DCT's 4.5 after 0.5 M tokens)."""
CONFIRM = CONFIRM_TOP + TRY_FIRST
"""At most this many extra pilots after the first round, one per re-scoring, for the settings :func:`to_confirm`
names (one confirmed setting may reveal that the next rests on an optimistic prior). A setting still on its prior
when they are spent is named in the pilot report."""
FLOOR_CAP = 0.6
"""The baseline fit's floor ``a`` is at most this fraction of the lowest loss its pilot saw. Fitted freely to the
start of a language model's curve, the floor comes out near the last loss seen and the extrapolation is far too
pessimistic. Measured on the equal-loss job's baseline (``benchmarks/results/equal_loss_pilot.json``: ZeRO-1,
constant lr 2e-3 and 1e-3, targets 4.4–3.6 reached at 0.4–2.2 M tokens, pilots of 0.3–1 M tokens), the predicted
tokens over the measured ones were 0.38–0.88 with no floor, 0.60–0.98 capped at 0.5×, 0.71–1.05 at 0.6×,
0.71–2.7 at 0.75×, and up to 50× free (1 M-token pilot, target 3.6: 5.6 M predicted, 1.97 M measured) — fitted to
every evaluation; fitted after the warm-up (:data:`MIN_FIT_EVALS`), caps of 0.5× and 0.65× did no better on the
equal-loss curves (6 of 140 extrapolations off by 2× each, as at 0.6×) and 0.75× far worse (25 of 140:
``benchmarks/results/curve_extrapolation.md``)."""
FLOOR_BRACKET = (0.0, 0.75)
"""Floors whose fits the interval of the baseline's tokens to target spans (0: the optimistic end)."""
EXTRAPOLATION_WIDENING = 0.25
"""The interval's high end grows by this fraction per doubling of the extrapolation (tokens to target over the
pilot's tokens): capped fits from short pilots fell short by up to 0.71× at 2.3× past the pilot on that curve."""
MIN_BATCH_EVALS = 4
"""Fewest evaluations in the tail of a pilot (its last :data:`~quietsync.plan.loss_model.RATIO_TAIL` of tokens) whose
steps hold more tokens than the baseline's for it to show its own batch effect: each evaluation gives one
``B_crit``, and held-out evaluations scatter by about 1% — one or two cannot tell a batch effect from noise."""
WARMUP_SHARE = 1 / 8
"""...and the warm-up's lost steps (``(W−1)/2``: warm-up steps count half, :mod:`~quietsync.plan.critical_batch`)
at most this share of the pilot's steps: the critical-batch fit to a pilot's curve leaves the warm-up out, so in a
pilot of few large steps it would read the warm-up as a batch effect (the 10 Mbit/s ACCO pilot of
``benchmarks/results/time_to_target.md`` made 4 steps, all warming up). Below either, the setting's prior is used,
with the critical batch measured by the baseline's noise scale."""
FALLBACK_C = 0.3
"""Exponent of the baseline's curve past a pilot too short to fit (the data exponent β ≈ 0.28 of Hoffmann et al.)."""
SPEED_TOLERANCE = 0.05
"""A delay-free pilot whose step time differs from the cost model's by more than this fraction corrects every
prediction of its setting by the difference — **both ways**. The cost model's compute profile is measured once, at
the plan's start, over a few steps; on a shared machine that moved by 1.5× between two plans of the same job minutes
apart (forward + backward 92 ms, then 138 ms: docs/plan.md, "Speed from the pilots"), while the pilots, ~35 s of
training each, moved by ~10%. Corrected only upward, a profile measured slow made every setting 1.5× slower than its
own pilot had run."""
MIN_FIT_EVALS = 4
"""The baseline's power law is fitted to its pilot's evaluations **after the learning-rate warm-up** where at least
this many are (the fewest a fit takes). While the learning rate ramps up the loss follows the ramp, not the
constant-rate power law the fit extrapolates, and the early points — the largest losses, the fastest fall — pull
the exponent up and the tokens to a low target down. Over the 19 distinct curves of the equal-loss runs
(``benchmarks/results/curve_extrapolation.md``: each curve's first 0.4 or 0.8 M tokens fitted, tokens to held-out
losses 4.2–3.6 predicted, 140 pairs), predicted over measured tokens went from a median 0.82 (10th–90th percentile
0.57–1.18, 14 off by 2×) fitted to every evaluation to 0.88 (0.64–1.47, 6 off by 2×) fitted after the warm-up;
from the plans' 0.4 M-token pilots, 0.73 (8 off) to 0.78 (4 off)."""


def after_warmup(curve: PilotCurve, warmup_steps: int) -> list[tuple[float, float]]:
    """The ``(tokens, loss)`` evaluations of ``curve`` a loss curve is fitted to: those after the learning-rate
    warm-up's last step, where at least :data:`MIN_FIT_EVALS` are (else every evaluation after the first token)."""
    pts = [(t, y) for t, y in zip(curve.tokens, curve.losses) if t > 0]
    # without a step per evaluation the warm-up's cannot be told apart: every evaluation
    if warmup_steps <= 0 or len(curve.steps) != len(curve.tokens):
        return pts
    after = [(t, y) for t, y, s in zip(curve.tokens, curve.losses, curve.steps) if t > 0 and s > warmup_steps]
    return after if len(after) >= MIN_FIT_EVALS else pts


def baseline_curve(curve: PilotCurve, warmup_steps: int = 0, floor_cap: float = FLOOR_CAP) -> BaselineCurve:
    """The baseline's loss curve from its pilot: measured points, and the power law fitted past the last one to the
    evaluations after the learning-rate warm-up (``warmup_steps``: see :data:`MIN_FIT_EVALS`), its floor at most
    ``floor_cap`` times the lowest loss seen (:data:`FLOOR_CAP`)."""
    pts = [(t, y) for t, y in zip(curve.tokens, curve.losses) if t > 0]
    if len(pts) < 4:
        if not pts or curve.reached is None:
            raise PlanError(f"the baseline's pilot made {len(pts)} evaluations; a loss curve needs at least 4: raise "
                            "--pilot-tokens, or let the pilots evaluate more often (--train-args '--eval-every N')")
        # it reached the target before a curve could be fitted: measured up to there, a plain power law past it
        t, y = pts[-1]
        law = PowerLaw(0.0, y * t ** FALLBACK_C, FALLBACK_C)  # floor 0, through the last evaluation
        return BaselineCurve(law, "pilot", f"the baseline's pilot: {len(pts)} evaluations up to {t:,.0f} tokens "
                             f"(too few to fit: past them L ∝ t^−{FALLBACK_C})", None, tuple(pts))
    fitted = after_warmup(curve, warmup_steps)
    ts, ys = [t for t, _ in fitted], [y for _, y in fitted]
    fit = fit_power_law(ts, ys, floor_cap=floor_cap)
    # no bootstrap: only these fits' laws bound the interval
    brackets = tuple(fit_power_law(ts, ys, floor_cap=cap, bootstrap=0).law for cap in FLOOR_BRACKET)
    brackets += (_Widened(fit.law, ts[-1], EXTRAPOLATION_WIDENING),)
    law = fit.law
    in_warmup = sum(1 for t, s in zip(curve.tokens, curve.steps) if t > 0 and s <= warmup_steps)
    fitted_on = (f"fitted to the {len(fitted)} after the {warmup_steps}-step warm-up" if len(fitted) < len(pts)
                 else f"fitted to all: fewer than {MIN_FIT_EVALS} after the {warmup_steps}-step warm-up"
                 if in_warmup else "fitted to all")
    desc = (f"the baseline's pilot: {len(pts)} evaluations up to {pts[-1][0]:,.0f} tokens ({fitted_on}), then L(t) = "
            f"{law.a:.3g} + {law.b:.3g}·t^−{law.c:.3g} (fit rms {fit.rms:.3g}; floor at most {floor_cap:g}× the "
            f"lowest loss seen, the interval spanning floors from 0 to {FLOOR_BRACKET[-1]:g}×)")
    return BaselineCurve(law, "pilot", desc, fit, tuple(pts), brackets)


@dataclasses.dataclass(frozen=True)
class _Widened:
    """A law whose tokens past the pilot's last grow by ``rate`` per doubling of the extrapolation (an interval end)."""

    law: PowerLaw
    last: float
    rate: float

    def tokens_to(self, target: float) -> float:
        t = self.law.tokens_to(target)
        if not math.isfinite(t) or t <= self.last:
            return t
        return t * (1 + self.rate * math.log2(t / self.last))


def fresh(curve: PilotCurve) -> tuple[list[float], list[float]]:
    """The pilot's ``(tokens, losses)`` without the evaluations that repeat the one before exactly: between two
    syncs Local SGD and DiLoCo evaluate the same committed model, whose loss belongs to the tokens of its sync, not
    to the later ones."""
    ts: list[float] = []
    ys: list[float] = []
    for t, y in zip(curve.tokens, curve.losses):
        if ys and y == ys[-1]:
            continue
        ts.append(t)
        ys.append(y)
    return ts, ys


def pilot_estimate(cand: Candidate, curve: PilotCurve, row: Row, base_row: Row, baseline: BaselineCurve,
                   target: float, ctx: PriorContext | None = None) -> LossEstimate | None:
    """A setting's estimate from its pilot curve (None when it made no evaluation past its first step). A pilot
    whose steps hold more tokens than the baseline's but that is too short to show its own batch effect
    (:data:`MIN_BATCH_EVALS`, :data:`WARMUP_SHARE`) gives its prior at its measured batch instead, with ``ctx``'s
    critical batch (the baseline's noise scale where measured)."""
    if not any(t > 0 for t in curve.tokens):
        return None
    notes = [f"{len(curve.tokens)} evaluations up to {curve.tokens[-1]:,.0f} tokens ({curve.stopped})"]
    if curve.reached is not None:
        return from_pilot_tokens(curve.tokens, curve.losses, baseline, target, notes, reached=curve.reached)
    tokens, losses = fresh(curve)
    steps = curve.steps[-1] if curve.steps else 0
    # the batch its steps held in the pilot (adaptive stages size theirs by the link), not the predicted one
    batch = curve.tokens[-1] / steps if steps else row.tokens_per_step
    if batch > 1.05 * base_row.tokens_per_step:
        tail = sum(1 for t in tokens if t > 0 and t >= tokens[-1] * (1 - RATIO_TAIL))
        warmup = ctx.warmup_steps if ctx is not None else 0
        lost = max(0.0, (warmup - 1) / 2)
        if ctx is None or (tail >= MIN_BATCH_EVALS and lost <= WARMUP_SHARE * steps):
            return from_pilot_batch(tokens, losses, batch, base_row.tokens_per_step, baseline, target, notes)
        why = (f"its pilot made {steps} steps of {batch:,.0f} tokens and {tail} evaluations in its last "
               f"{RATIO_TAIL:.0%}: too few to show its own batch effect (needs {MIN_BATCH_EVALS} evaluations and "
               f"the warm-up's {lost:g} lost steps at most {WARMUP_SHARE:.3g} of its steps), so its prior at that "
               f"batch ({ctx.critical.source} critical batch)")
        prior = prior_for(cand.strategy, strategy_config(cand.strategy, cand.knob_dict),
                          dataclasses.replace(ctx, target_loss=target, baseline_tokens=baseline.tokens_at(target)),
                          batch)
        est = from_prior(prior, baseline, target)
        est.notes = notes + [why] + est.notes
        return est
    return from_pilot_tokens(tokens, losses, baseline, target, notes)


def noise_critical_batch(model_dir: Path, job: object, curve: PilotCurve) -> tuple[CriticalBatch | None, str,
                                                                                     NoiseScale | None]:
    """The critical batch measured on the model the baseline's pilot exported (its noise scale at the pilot's last
    held-out loss), or None with the reason (then Kaplan et al.'s is used)."""
    if not curve.tokens or not curve.losses:
        return None, "the baseline's pilot made no evaluation", None
    try:
        ns = measure_pilot(model_dir, job)
    except ValueError as e:
        return None, str(e), None
    if not math.isfinite(ns.b_simple) or ns.b_simple <= 0:
        return None, (f"the measured |G|² ({ns.grad_sq:.3g}) is not above zero: the gradient noise dominates "
                      "what these micro-batches resolve"), ns
    cb = measured(ns.b_simple, ns.low, ns.high, curve.losses[-1], curve.tokens[-1])
    return cb, (f"noise scale measured on the baseline's model ({ns.repeats} × {int(ns.b_big // ns.b_small)} "
                f"micro-batches of {ns.b_small:,.0f} tokens, {ns.seconds:.1f} s): {cb.description}"), ns


def pilot_speed(curve: PilotCurve) -> tuple[float, float] | None:
    """Seconds per step and tokens per step over the second half of a pilot's training (its evaluations' time
    taken out), or None when it made too few evaluations.

    The training time is the pilot's longest worker clock (:attr:`~quietsync.plan.pilots.PilotCurve.train_s`), not
    rank 0's: with one worker slower, a faster rank 0 waits for it inside each evaluation (for the update in
    flight), and that wait, taken out as evaluation time, made its steps look ~2× faster than the run went. So the
    speed is the slowest worker's pace where a synchronous method runs at it, ACCO's where it accumulates by its own
    rule, and adaptive inner steps' — every worker's tokens over the round's wall time — where each worker takes its
    own share (the tokens per step are all workers' in every case)."""
    n = len(curve.steps)
    if n < 3 or curve.wall_s == 0.0:
        return None
    i = n // 2
    steps = curve.steps[-1] - curve.steps[i]
    if len(curve.train_s) == n:
        train_s = curve.train_s[-1] - curve.train_s[i]
    else:  # a record from before the workers' clocks were kept: rank 0's
        train_s = curve.time_s[-1] - curve.time_s[i] - sum(curve.eval_s[i + 1:])
    if steps <= 0 or train_s <= 0:
        return None
    return train_s / steps, (curve.tokens[-1] - curve.tokens[i]) / steps


def _first_sync_steps(c: Candidate) -> int | None:
    """Steps a setting trains alone before its first synchronization (None: it meets every step), as its strategy
    declares (``PlanFacts.first_sync``)."""
    first = declaration(c.strategy).plan.first_sync
    return first(strategy_config(c.strategy, c.knob_dict)) if first is not None else None


def run_pilots(result: PlanResult, predict: Callable[..., PlanResult], runner: ProcessRunner | None = None
               ) -> PlanResult:
    """Run the pilots of ``result.config`` and return the plan re-scored with them by ``predict`` (the planner's,
    :func:`~quietsync.plan.planner.predict`; see the module docstring)."""
    cfg = result.config
    assert cfg.pilot_tokens is not None
    budget = cfg.pilot_tokens
    rows = {r.spec: r for r in result.rows}
    preferred = baselines()  # the setting whose pilot is the baseline curve: the first present (they follow one
    base_spec = next((s for s in preferred if s in rows), None)  # trajectory)
    if base_spec is None:  # the baseline's pilot is the loss model's reference even when it is not a row
        base_spec = preferred[0]
        rows[base_spec] = result.predict(base_spec, {})
    base_row = rows[base_spec]
    from ..train.args import parse_train_args
    from ..train.config import TrainConfig

    # the planned run's own flags: its warm-up, evaluation cadence and step budget enter the plan
    job, _, _ = parse_train_args([*cfg.pilot_args, "--model", cfg.model])
    job_cfg: TrainConfig = job
    folder = Path(cfg.pilot_out or (Path(cfg.out) / "pilots" if cfg.out else tempfile.mkdtemp(prefix="qs-pilots-")))
    job_args = ["--model", cfg.model, "--nproc", str(cfg.nproc), "--micro-batch-size", str(cfg.micro_batch_size),
                "--seq-len", str(cfg.seq_len), "--vocab-size", str(cfg.vocab_size), "--timeout-s", str(cfg.timeout_s),
                *(["--nodes", str(cfg.nodes)] if cfg.nodes else []), *(["--threads", str(cfg.threads)]
                                                                      if cfg.threads else []),
                *[a for w in cfg.slow_worker for a in ("--slow-worker", w)], *cfg.pilot_args]
    link_args = [a for link in cfg.link for a in ("--link", link)]
    emulated = bool(cfg.link)

    def through_link(c: Candidate) -> bool:
        # a real link is always used; adaptive stages depend on its timing unless their size is fixed
        return not emulated or (adaptive(c.strategy) and "deterministic_accumulation" not in c.knob_dict)

    runner = runner or ProcessRunner(job_args, link_args, folder, cfg.target_loss,
                                     lambda c: rows[c.spec].tokens_per_step if c.spec in rows else 1.0, through_link,
                                     reuse=cfg.reuse_pilots)
    state: dict[str, object] = {}
    target = cfg.target_loss

    def context() -> PriorContext:
        critical = state.get("critical")
        return dataclasses.replace(result.objective.priors, target_loss=target or result.objective.priors.target_loss,
                                   warmup_steps=job_cfg.warmup, critical=critical if isinstance(
                                       critical, CriticalBatch) else result.objective.priors.critical)

    def objective_with(baseline: BaselineCurve, pilots: dict[str, LossEstimate]) -> Objective:
        return dataclasses.replace(result.objective, baseline=baseline, pilots=pilots,
                                   target=target, notes=[], priors=context())

    def estimate(cand: Candidate, curve: PilotCurve, row: Row, base: BaselineCurve, tgt: float
                 ) -> LossEstimate | None:
        return pilot_estimate(cand, curve, row, base_row, base, tgt, context())

    def value_of(cand: Candidate, curve: PilotCurve) -> float | None:
        if cand.spec == base_spec:
            pts = [t for t in curve.tokens if t > 0]
            if len(pts) < 4:  # a curve is fitted to 4 evaluations at least
                return None
            try:
                base = baseline_curve(curve, job_cfg.warmup)
            except ValueError:
                return None
            obj = objective_with(base, {})
            return obj.score(base_row).objective if target is not None or cfg.budget_s else None
        base = state.get("baseline")
        if not isinstance(base, BaselineCurve):
            return None
        row = rows[cand.spec]
        # budget mode: the baseline's loss after the budget stands in for the target
        tgt = target if target is not None else base.point(base_row.tokens_per_s * (cfg.budget_s or 0))
        est = estimate(cand, curve, row, base, tgt)
        if est is None:
            return None
        return objective_with(base, {cand.spec: est}).score(row).objective

    picked: list[str] = []
    skipped: list[str] = []
    # beside the grid, the settings the user added (--strategies) were asked about: each is piloted beyond the
    # grid's pilot_candidates; with --only they are the whole list, which the cap ranks
    named = set() if cfg.only else {candidate(name, knobs).spec for name, knobs in cfg.extra}

    def order() -> Iterator[Candidate]:
        yield parse_candidate(base_spec)
        # resumed once the baseline's pilot has run (the order is read lazily): its curve ranks the rest
        base = state["baseline"] = baseline_curve(done[base_spec], job_cfg.warmup)
        # only a runner whose pilots export their model can have the noise scale measured on it
        model_dir = getattr(runner, "model_dir", None)
        if callable(model_dir):
            full_job: TrainConfig = parse_train_args(job_args)[0]  # the pilots' job: its data and micro-batch
            critical, why, ns = noise_critical_batch(model_dir(parse_candidate(base_spec)), full_job,
                                                     done[base_spec])
            state.update(critical=critical, critical_note=why, noise=ns)
        prior = objective_with(base, {})
        # an exact strategy at its defaults follows the baseline's trajectory: nothing to pilot
        scored = sorted((prior.score(r) for r in result.rows if (not declaration(r.strategy).plan.exact
                         or r.knobs) and r.spec != base_spec), key=lambda s: s.objective)
        best_high = min((_high(s) for s in scored), default=math.inf)
        chosen = 0  # the planner's own picks: a setting the user named is piloted beyond pilot_candidates
        for s in scored:
            if s.row.spec not in named and chosen >= cfg.pilot_candidates:
                skipped.append(f"`{s.row.spec}`: not among the {cfg.pilot_candidates} most promising "
                               f"(pilot_candidates)")
                continue
            if _low(s) > best_high:
                skipped.append(f"`{s.row.spec}`: clearly losing on its prior (at best {_fmt(s, _low(s))}, the best "
                               f"setting at worst {fmt_duration(best_high) if target is not None else best_high})")
                continue
            picked.append(s.row.spec)
            chosen += s.row.spec not in named
            yield parse_candidate(s.row.spec)

    prefixes: dict[str, tuple[str, float]] = {}
    done: dict[str, PilotCurve] = {}
    free = _delay_free(result)

    def speeds() -> tuple[dict[str, float], float, Callable[[Row], Row]]:
        """The speed the pilots so far saw: a pilot without the emulated delay measures how far the cost model is off
        on a delay-free link — work it leaves out, or a compute profile measured slow or fast (its step time over
        or under the prediction, :data:`SPEED_TOLERANCE`; the baseline's, per micro-batch, goes to every setting
        without a pilot); one through the link measures its whole step."""
        overhead: dict[str, float] = {}
        measured: dict[str, tuple[float, float]] = {}
        batch: dict[str, float] = {}
        per_mb = 0.0
        for spec, curve in done.items():
            speed = pilot_speed(curve)
            if speed is None or spec not in rows:
                continue
            row = rows[spec]
            if curve.through_link and emulated:
                measured[spec], overhead[spec] = speed, 0.0
            elif emulated:
                # the pilot ran without the emulated delay: against the delay-free prediction
                predicted = result.predict(row.strategy, row.knobs, free).step_s
                off = speed[0] - predicted
                overhead[spec] = off if abs(off) > SPEED_TOLERANCE * predicted else 0.0
                if spec == base_spec:
                    per_mb = overhead[spec] / max(row.micro_batches, 1e-9)
                if abs(speed[1] - row.tokens_per_step) > SPEED_TOLERANCE * row.tokens_per_step:
                    # a batch that follows the workers' speeds (adaptive inner steps: each worker's share of a
                    # round), which the link's delay does not change: the pilot's, not the calibration's
                    batch[spec] = speed[1]

        def adjust(row: Row) -> Row:
            if row.spec in batch:
                tokens = batch[row.spec]
                return dataclasses.replace(row, tokens_per_step=tokens, tokens_per_s=tokens / row.step_s,
                                           micro_batches=tokens / result.workload.tokens_per_micro_batch,
                                           notes=[*row.notes, "tokens per step measured by its pilot"])
            if row.spec not in measured:
                return row
            step_s, tokens = measured[row.spec]
            return dataclasses.replace(row, step_s=step_s, tokens_per_step=tokens, tokens_per_s=tokens / step_s,
                                       micro_batches=tokens / result.workload.tokens_per_micro_batch,
                                       notes=[*row.notes, "step time and batch measured by its pilot through the link"])
        return overhead, per_mb, adjust

    def exact(row: Row) -> bool:
        return declaration(row.strategy).plan.exact and not row.knobs

    def confirm() -> Iterator[Candidate]:
        """After the first round: while one of the best settings, or one the advice lists under "Try first", rests on
        its prior, pilot it too (:func:`to_confirm`)."""
        for n in range(CONFIRM + 1):  # one pass more than pilots: to name a setting still on its prior
            base = state["baseline"]
            assert isinstance(base, BaselineCurve)
            tgt = target if target is not None else base.point(base_row.tokens_per_s * (cfg.budget_s or 0))
            ests = {spec: e for spec, curve in done.items() if spec != base_spec and spec in rows
                    and (e := estimate(parse_candidate(spec), curve, rows[spec], base, tgt))}
            overhead, per_mb, adjust = speeds()  # ranked as the final plan ranks: with the speeds measured so far
            now = dataclasses.replace(objective_with(base, ests), step_overhead_s=overhead,
                                      overhead_per_micro_batch_s=per_mb)
            best = sorted((now.score(adjust(r)) for r in result.rows), key=lambda s: (s.objective, -s.row.tokens_per_s))
            top = to_confirm(best, {*done, *picked}, exact)
            if top is None:
                return
            if n == CONFIRM:
                skipped.append(f"`{top.row.spec}`: among the best settings on its prior — the {CONFIRM} confirming "
                               "pilots were spent on settings ranked above it as the ranking changed")
                return
            picked.append(top.row.spec)
            yield parse_candidate(top.row.spec)

    def lazy() -> Iterator[Candidate]:
        for c in itertools.chain(order(), confirm()):
            first = _first_sync_steps(c)
            if first is not None:
                for spec in done:
                    other = parse_candidate(spec)
                    o_first = _first_sync_steps(other)
                    # the same trajectory before the first sync only at the same micro-batches per step
                    if o_first is not None and other.knob_dict.get("accumulation", 1) == c.knob_dict.get(
                            "accumulation", 1):
                        # shared up to the earlier of the two first syncs
                        prefixes[c.spec] = (spec, min(first, o_first) * rows[c.spec].tokens_per_step)
                        break
            yield c

    successive_halving(lazy(), runner, budget, value_of, prefixes=prefixes, out=done)
    baseline = state.get("baseline")
    if not isinstance(baseline, BaselineCurve):
        baseline = baseline_curve(done[base_spec], job_cfg.warmup)
    pilots: dict[str, LossEstimate] = {}
    for spec, curve in done.items():
        if spec == base_spec:
            continue
        tgt = target if target is not None else baseline.point(base_row.tokens_per_s * (cfg.budget_s or 0))
        est = estimate(parse_candidate(spec), curve, rows[spec], baseline, tgt)
        if est is not None:
            pilots[spec] = est
    evals = [e for c in done.values() for e in c.eval_s]
    overhead, per_mb, adjust = speeds()
    objective = dataclasses.replace(
        objective_with(baseline, pilots), eval_every=job_cfg.eval_every, step_overhead_s=overhead,
        overhead_per_micro_batch_s=per_mb,
        eval_s=statistics.median(evals) if evals else 0.0, max_steps=job_cfg.max_steps if job_cfg.max_steps else None,
        notes=[f"target: held-out loss {target:g}" if target is not None else f"budget: {cfg.budget_s:g} s",
               f"baseline curve: {baseline.description}",
               f"the planned run: --max-steps {job_cfg.max_steps}, an evaluation every {job_cfg.eval_every} steps "
               f"(each {statistics.median(evals) if evals else 0:.3g} s, measured by the pilots) counted in the time",
               "critical batch of the settings whose steps hold more tokens than the baseline's: "
               + (str(state["critical_note"]) if isinstance(state.get("critical"), CriticalBatch) else
                  f"{objective_with(baseline, {}).priors.critical.description}"
                  + (f" (not measured: {state['critical_note']})" if state.get("critical_note") else ""))])
    new = predict(cfg, result.workload, result.cluster, result.compute, probe=result.probe,
                  assumptions=result.assumptions, objective=objective, adjust=adjust)
    new.pilots = done
    noise = state.get("noise")
    new.noise_scale = noise if isinstance(noise, NoiseScale) else None
    new.pilot_report = _report(new, done, base_spec, skipped, budget, new.noise_scale)
    return new


def to_confirm(best: list[Scored], piloted: Collection[str], exact: Callable[[Row], bool]) -> Scored | None:
    """The next setting to confirm by a pilot: the first of the :data:`CONFIRM_TOP` best settings (``best`` is the
    plan re-scored, best first), then of those the advice lists under "Try first" (each strategy's best that reaches
    the target, :data:`~quietsync.plan.recommend.TRY_FIRST` of them), then of the settings ranked above the last of
    those, that reaches the target on its prior — not piloted and not ``exact`` (the baseline's own trajectory);
    None when each of them rests on a measurement."""
    try_first = [s for s in best_per_strategy(best) if s.reaches][:TRY_FIRST]
    specs = [s.row.spec for s in best]
    last = max((specs.index(s.row.spec) for s in try_first), default=-1)
    for s in [*best[:CONFIRM_TOP], *try_first, *best[:last]]:
        if s.row.spec not in piloted and not exact(s.row) and s.reaches:
            return s
    return None


def _delay_free(result: PlanResult) -> Links:
    """The plan's links with the emulated ones made free (the real transport's floor kept): what a pilot run without
    the emulated delay sees."""
    links = result.cluster.links
    return Links(model={k: LinkModel(1e15, 0.0) for k in links.model}, floor=links.floor,
                 floor_by_kind=links.floor_by_kind)


def _low(s: Scored) -> float:
    if s.loss is not None:
        return s.loss.low
    return s.time.seconds.low if s.time is not None else math.inf


def _high(s: Scored) -> float:
    if s.loss is not None:
        return s.loss.high
    return s.time.seconds.high if s.time is not None else math.inf


def _fmt(s: Scored, v: float) -> str:
    return f"loss {v:.3f}" if s.loss is not None else fmt_duration(v)


def _report(result: PlanResult, done: dict[str, PilotCurve], base_spec: str, skipped: list[str], budget: int,
            noise: NoiseScale | None = None) -> list[str]:
    lines = []
    for spec, c in done.items():
        how = ("through the link" if c.through_link else "without the emulated delay (same trajectory)")
        ran = f"{c.tokens[-1]:,.0f} tokens" if c.tokens else "no evaluation"
        shared = f", judged on `{c.shared_from}`'s shared prefix" if c.shared_from else ""
        lines.append(f"`{spec}`{' (baseline)' if spec == base_spec else ''}: {ran}, {c.stopped}{shared}, "
                     f"{c.wall_s:.1f} s {how}")
    # a setting skipped in the first round may have been piloted since, to confirm it
    lines += [f"not piloted: {s}" for s in skipped if s.split("`")[1] not in done]
    cost = sum(c.wall_s for c in done.values())
    if noise is not None:
        lines.append(f"noise scale on the baseline's model: B_simple = {noise.b_simple:,.0f} tokens "
                     f"({noise.low:,.0f}–{noise.high:,.0f}), {noise.seconds:.1f} s")
        cost += noise.seconds
    times = [s.time.seconds.value for s in result.scored if s.time is not None and s.reaches]
    total = sum(times)
    rec = result.advice.recommendations[0] if result.advice.recommendations else None
    with_noise = " (the noise scale included)" if noise is not None else ""
    line = (f"pilots cost {cost:.1f} s in all{with_noise} (budget {budget:,} tokens each, successive halving at "
            f"{', '.join(f'{r:,}' for r in rungs(budget))} tokens)")
    if total > 0:
        line += (f"; running the {len(times)} settings that reach the target to it is predicted to take "
                 f"{fmt_duration(total)}: the pilots cost {cost / total:.2f} of that")
    if rec is not None and rec.seconds is not None and math.isfinite(rec.seconds.value) and rec.seconds.value > 0:
        line += f", {cost / rec.seconds.value:.2f}× the recommended setting's predicted time to target"
    lines.append(line)
    return lines


__all__ = ["adaptive", "baseline_curve", "fresh", "pilot_estimate", "pilot_speed", "run_pilots",
           "to_confirm"]
