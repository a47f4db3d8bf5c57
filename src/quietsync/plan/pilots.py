"""Pilot runs: short ``quietsync train`` runs of the most promising candidates on the user's model and data, whose
held-out loss curves replace the priors (``quietsync plan --target-loss X --pilot-tokens N``).

1. **The baseline first.** The synchronous baseline (ZeRO-1; DDP and FSDP follow its trajectory) runs up to ``N``
   tokens, stopping at the target if it gets there. Its held-out curve is the loss model's baseline
   (:class:`~quietsync.plan.loss_model.BaselineCurve`): measured where it ran, the fitted ``a + b·t^(−c)``
   (:mod:`~quietsync.plan.curve_fit`) past that.
2. **Candidates by promise.** The others are ranked by their prior time to target (the papers' priors on the pilot
   baseline's curve, over the cost model's tokens/s); a candidate whose optimistic time is beyond the best one's
   pessimistic time is clearly losing and not piloted; at most ``pilot_candidates`` of the grid's run, and every
   setting ``--strategies`` adds to the grid that is not clearly losing (the user asked about it), then up to
   :data:`~quietsync.plan.pilot_plan.CONFIRM` more for the settings to try first that still rest on their priors.
3. **Successive halving** (Optuna's :class:`optuna.pruners.SuccessiveHalvingPruner`, asynchronous SH): each pilot
   reports, at every evaluation, the time to target predicted from its curve so far; at the rungs ``N/η`` and ``N``
   (tokens) a pilot continues only while it is among the best ``1/η`` of the pilots that reached that rung before
   it, else it is stopped (its workers terminated) — so the most promising run longest.
4. **Shared prefixes.** Settings that train the same way until their first synchronization (Local SGD and DiLoCo
   with local inner steps: before the first sync each worker trains alone) share those evaluations: a candidate
   whose first rung ends before its first sync is judged on the prefix another one already ran, and is pruned
   without running when that prefix loses. (A resumed run may not change strategy flags, so a prefix cannot be
   forked into several settings; past the prefix each candidate runs from the start.)

Pilots run the job ``quietsync train`` runs, with the same links (:mod:`~quietsync.plan.pilot_jobs`: local
workers forked from this process's launcher, as ``quietsync train`` forks them from its own). An
*emulated* link only delays messages, never changes what they hold, so a candidate whose steps do not depend on
timing runs its pilot without the emulated delay (the same loss curve, at compute speed); ACCO/DPU/WP with adaptive
stages (how many micro-batches a stage holds depends on the link) run through it. A real (measured) link is always
used as it is. What each pilot cost (wall seconds, launch included) is reported beside what running the
candidates to the target is predicted to cost.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..strategies.registry import declaration, module_flags, strategy_config
from .candidates import Candidate
from .pilot_jobs import start_pilot

ETA = 2
"""Successive halving's reduction factor: half of the pilots go on at each rung."""
RUNGS = 2
"""Rungs of the pilot budget: ``N/η`` and ``N`` tokens (a pilot judged earlier has seen only the start of
training, where settings that fall behind later still look alike)."""
EVALS_PER_PILOT = 16
"""Evaluations a full pilot makes (its ``--eval-every`` follows from its predicted steps)."""
OVERLAP_EVAL_STEPS = 8
"""Fewest steps between two evaluations of an ACCO/DPU/WP pilot."""
RECORD = "pilot.json"
"""A finished pilot's curve and cost, in its folder (what ``reuse`` replays)."""
UNRECORDED = frozenset({"out", "overwrite", "progress", "plot", "resume"})
"""Configuration fields that do not change what a pilot measures."""


@dataclass
class PilotCurve:
    """What one pilot measured."""

    spec: str
    tokens: list[float] = field(default_factory=list)
    """Tokens of all workers at each evaluation."""
    losses: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    time_s: list[float] = field(default_factory=list)
    eval_s: list[float] = field(default_factory=list)
    """Seconds each evaluation took (rank 0)."""
    wall_s: float = 0.0
    """What the pilot cost: wall seconds, launch and evaluations included (0 when judged on a shared prefix)."""
    stopped: str = "budget"
    """``budget``, ``target`` (reached the target loss), ``pruned``, ``shared prefix`` or ``failed: ...``."""
    through_link: bool = True
    shared_from: str | None = None
    train_s: list[float] = field(default_factory=list)
    """Seconds of training at each evaluation: over the workers, the longest training clock (a worker's time since
    the start minus its own evaluations). The longest, because a worker that reached an evaluation before a slower
    one waits there for the update in flight, and that wait — the slower worker still computing — is training, not
    evaluation: subtracted with rank 0's evaluations, a pilot whose rank 0 is the fast worker reports its steps up
    to ~2× too fast (Streaming DiLoCo with a 3× slower worker). Empty for a record written before it was kept."""

    @property
    def reached(self) -> float | None:
        """Tokens at which it reached the target (``stopped == "target"``)."""
        return self.tokens[-1] if self.stopped == "target" and self.tokens else None

    def prefix(self, tokens: float) -> PilotCurve:
        """Its evaluations up to ``tokens``."""
        n = sum(1 for t in self.tokens if t <= tokens)
        return PilotCurve(self.spec, self.tokens[:n], self.losses[:n], self.steps[:n], self.time_s[:n],
                          self.eval_s[:n], 0.0, "shared prefix", self.through_link, self.spec, self.train_s[:n])

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


Runner = Callable[[Candidate, int, Callable[[PilotCurve], bool]], PilotCurve]
"""Runs candidate's pilot for up to a token budget, calling ``on_eval(curve so far)`` at every evaluation; stops the
run as soon as ``on_eval`` returns True (pruned)."""


def rungs(budget: int, eta: int = ETA, count: int = RUNGS) -> list[int]:
    """The token budgets of the rungs: ``budget/η^(count−1)``, ..., ``budget``."""
    return [max(1, budget // eta ** (count - 1 - i)) for i in range(count)]


def successive_halving(order: Iterable[Candidate], runner: Runner, budget: int,
                       value_of: Callable[[Candidate, PilotCurve], float | None], *, eta: int = ETA,
                       count: int = RUNGS, prefixes: dict[str, tuple[str, float]] | None = None,
                       out: dict[str, PilotCurve] | None = None) -> dict[str, PilotCurve]:
    """Run ``order``'s pilots one after another under Optuna's successive-halving pruner (see the module docstring).

    ``order`` is read lazily (the next candidate may depend on the pilots so far, in ``out``).
    ``value_of(candidate, curve)``: the value to minimize (predicted time to target) from a curve so far, or None
    while it cannot be judged yet. ``prefixes``: ``spec → (spec of the candidate whose run shares its prefix,
    tokens of that prefix)``. Returns (and fills ``out`` with) every pilot's curve by spec."""
    try:
        import optuna
    except ImportError:  # pragma: no cover - the plan extra is installed with the dev tools
        raise ValueError("pilot_tokens needs Optuna for successive halving: pip install 'quietsync[plan]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=rungs(budget, eta, count)[0], reduction_factor=eta,
                                                    min_early_stopping_rate=0)
    # nothing is sampled (the candidates are given): the study only holds the values the pruner compares
    study = optuna.create_study(direction="minimize", pruner=pruner, sampler=optuna.samplers.RandomSampler(seed=0))
    out = {} if out is None else out
    for cand in order:
        trial = study.ask()
        last: list[float] = []

        reported: list[int] = []

        # defaults bind this iteration's objects at definition, not the loop variables
        def on_eval(curve: PilotCurve, cand: Candidate = cand, trial: Any = trial, last: list[float] = last,
                    reported: list[int] = reported) -> bool:
            if not curve.tokens or (reported and int(curve.tokens[-1]) <= reported[-1]):
                return False  # judged already (a shared prefix replayed before the run)
            value = value_of(cand, curve)
            if value is None:
                return False
            reported.append(int(curve.tokens[-1]))
            value = value if math.isfinite(value) else 1e300
            trial.report(value, step=int(curve.tokens[-1]))  # steps in tokens, as the rungs are
            last.append(value)
            return curve.tokens[-1] < budget and trial.should_prune()  # at the budget there is nothing left to save

        shared = (prefixes or {}).get(cand.spec)
        curve = None
        if shared is not None and shared[0] in out:
            source, upto = shared
            first = rungs(budget, eta, count)[0]  # replayed up to the first evaluation at or past the first rung
            past = [t for t in out[source].tokens if first <= t <= upto]
            prefix = out[source].prefix(past[0] if past else min(upto, first))
            pruned = False
            for i in range(1, len(prefix.tokens) + 1):
                if on_eval(PilotCurve(cand.spec, prefix.tokens[:i], prefix.losses[:i], prefix.steps[:i],
                                      prefix.time_s[:i], prefix.eval_s[:i], train_s=prefix.train_s[:i])):
                    pruned = True
                    break
            if pruned:
                curve = PilotCurve(cand.spec, prefix.tokens[:i], prefix.losses[:i], prefix.steps[:i],
                                   prefix.time_s[:i], prefix.eval_s[:i], 0.0, "pruned", prefix.through_link, source,
                                   prefix.train_s[:i])
        if curve is None:
            curve = runner(cand, budget, on_eval)  # no shared prefix, or it did not lose: the pilot runs from the start
        out[cand.spec] = curve
        if curve.stopped == "pruned":
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        elif last:
            study.tell(trial, last[-1])
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return out


# ---------------------------------------------------------------------------------------------- the process runner
@dataclass
class ProcessRunner:
    """Runs a pilot as ``quietsync train`` runs its job (:func:`~quietsync.plan.pilot_jobs.start_pilot`),
    watching its metrics files and stopping it when the pilot is pruned."""

    job_args: list[str]
    """The job's flags (model, workers, micro-batch, data, schedule...), without link and strategy."""
    link_args: list[str]
    """``--link ...`` flags (given to the pilots that must run through the link)."""
    out: Path
    target_loss: float | None
    tokens_per_step: Callable[[Candidate], float]
    """Predicted tokens per committed step (to choose the pilot's evaluation cadence)."""
    through_link: Callable[[Candidate], bool]
    timeout_s: float = 3600.0
    poll_s: float = 0.2
    log: Callable[[str], None] = print
    reuse: bool = False
    """Replay a pilot that ran to its end in the same folder with the same job and strategy configuration (its
    ``summary.json``'s, the curve and cost in its ``pilot.json``) instead of running it again."""

    def folder(self, cand: Candidate) -> Path:
        """The pilot's ``--out``."""
        return self.out / cand.spec.replace(":", "-").replace(",", "-").replace("=", "")

    def model_dir(self, cand: Candidate) -> Path:
        """Where the pilot's trainer exported its model at its end."""
        from ..train.export import MODEL_DIR

        return self.folder(cand) / MODEL_DIR

    def _recorded(self, argv: list[str], folder: Path) -> dict[str, Any] | None:
        """The recorded curve of a finished pilot run with ``argv``'s configuration, or None."""
        record, summary = folder / RECORD, folder / "summary.json"
        if not (self.reuse and record.exists() and summary.exists()):
            return None
        import contextlib
        import dataclasses
        import io

        from ..train.args import parse_train_args

        try:
            with contextlib.redirect_stderr(io.StringIO()):
                cfg, strategy_cfg, _ = parse_train_args(argv)
        except SystemExit:
            return None
        done = json.loads(summary.read_text())
        for part, now in (("config", cfg), ("strategy_config", strategy_cfg)):
            # through JSON, as the summary holds it (tuples become lists)
            want = json.loads(json.dumps(dataclasses.asdict(now)))
            # a field the recording trainer did not have yet ran as its default does now
            defaults = json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(now)
                                              if f.default is not dataclasses.MISSING}, default=str))
            got = {**{k: v for k, v in defaults.items() if k in want}, **done.get(part, {})}
            if any(got.get(k) != v for k, v in want.items() if k not in UNRECORDED):
                return None
        curve = json.loads(record.read_text())
        return curve if curve.get("stopped") in ("budget", "target") else None

    def argv(self, cand: Candidate, budget: int, folder: Path) -> list[str]:
        from ..cli.spec import parse_strategy_spec

        name, _, flags = parse_strategy_spec(cand.spec)
        steps = max(1.0, budget / max(1.0, self.tokens_per_step(cand)))
        every = eval_every(cand, steps)
        # a strategy of the user's own: its file is imported by the pilot too
        argv = [*self.job_args, *module_flags(name), "--strategy", name, *flags, "--max-tokens", str(budget),
                "--eval-every", str(every), "--out", str(folder), "--overwrite", "--no-progress", "--no-plot",
                "--save-every", "0"]
        if self.through_link(cand):
            argv += self.link_args
        if self.target_loss is not None:
            argv += ["--target-loss", repr(self.target_loss)]
        return argv

    def __call__(self, cand: Candidate, budget: int, on_eval: Callable[[PilotCurve], bool]) -> PilotCurve:
        folder = self.folder(cand)
        folder.mkdir(parents=True, exist_ok=True)
        link = self.through_link(cand)
        recorded = self._recorded(self.argv(cand, budget, folder), folder)
        if recorded is not None:
            return self._replay(cand, recorded, on_eval)
        curve = self._run(cand, budget, on_eval, folder, link)
        if curve.stopped in ("budget", "target"):  # only a pilot run to its end may be replayed
            (folder / RECORD).write_text(json.dumps(curve.to_dict()) + "\n")
        return curve

    def _replay(self, cand: Candidate, rec: dict[str, Any], on_eval: Callable[[PilotCurve], bool]) -> PilotCurve:
        """A recorded pilot fed to ``on_eval`` evaluation by evaluation; pruned, it cost its share of the record's
        time up to there."""
        self.log(f"   pilot {cand.spec}: replayed from {self.folder(cand) / RECORD} (ran {rec['wall_s']:.1f} s)")
        curve = PilotCurve(cand.spec, through_link=bool(rec["through_link"]), wall_s=float(rec["wall_s"]),
                           stopped=str(rec["stopped"]))
        kept = len(rec.get("train_s") or ()) == len(rec["tokens"])  # a record from before train_s was kept: none
        for i in range(len(rec["tokens"])):
            for key in ("tokens", "losses", "steps", "time_s", "eval_s", *(("train_s",) if kept else ())):
                getattr(curve, key).append(rec[key][i])
            if on_eval(curve):
                curve.stopped = "pruned"
                end = rec["time_s"][-1] or 1.0
                curve.wall_s = float(rec["wall_s"]) * min(1.0, curve.time_s[-1] / end)
                break
        return curve

    def _run(self, cand: Candidate, budget: int, on_eval: Callable[[PilotCurve], bool], folder: Path, link: bool
             ) -> PilotCurve:
        argv = self.argv(cand, budget, folder)
        for stale in [*folder.glob("metrics-rank*.jsonl"), folder / "summary.json", folder / RECORD]:
            stale.unlink(missing_ok=True)  # an earlier run's: read before the new one overwrites them, they mix
        self.log(f"   pilot {cand.spec}: up to {budget:,} tokens{' through the link' if link else ''}")
        curve = PilotCurve(cand.spec, through_link=link)
        t0 = time.perf_counter()
        job = start_pilot(argv, folder / "pilot.log")
        readers: dict[int, _Tail] = {}
        evals: dict[int, dict[int, dict[str, Any]]] = {}
        eval_sum: dict[int, float] = {}  # each worker's evaluation seconds so far (the first, at step 0, included)
        last = -1
        pruned = False
        try:
            while True:
                done = job.poll() is not None
                for path in folder.glob("metrics-rank*.jsonl"):
                    rank = int(path.stem.removeprefix("metrics-rank"))
                    for rec in readers.setdefault(rank, _Tail(path)).read():
                        if rec.get("event") == "eval":
                            evals.setdefault(rec["step"], {})[rank] = rec
                ranks = len(readers)
                # an evaluation counts once every worker has written it
                for step in sorted(s for s, by in evals.items() if len(by) == ranks and ranks and s > last):
                    by = evals[step]
                    last = step
                    for r, rec in by.items():
                        eval_sum[r] = eval_sum.get(r, 0.0) + float(rec["eval_s"])
                    if step == 0:  # before training: its seconds count (above), its point does not
                        continue
                    r0 = by.get(0) or next(iter(by.values()))
                    curve.steps.append(step)
                    curve.tokens.append(float(sum(r["tokens_total"] for r in by.values())))
                    curve.losses.append(float(r0["loss"]))
                    curve.time_s.append(float(r0["time_s"]))
                    curve.eval_s.append(float(r0["eval_s"]))
                    curve.train_s.append(max(float(rec["time_s"]) - eval_sum[r] for r, rec in by.items()))
                    if on_eval(curve):
                        pruned = True
                        break
                if pruned or done:
                    break
                if time.perf_counter() - t0 > self.timeout_s:
                    curve.stopped = f"failed: no end after {self.timeout_s:.0f} s"
                    break
                time.sleep(self.poll_s)
        finally:
            if job.poll() is None:  # pruned, timed out or interrupted: no worker is left running
                job.stop()
        curve.wall_s = time.perf_counter() - t0
        if pruned:
            curve.stopped = "pruned"
        elif job.poll() not in (0, None) and not curve.stopped.startswith("failed"):
            tail = (folder / "pilot.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
            curve.stopped = f"failed: exit {job.poll()}: {tail[0]}"
        elif not curve.stopped.startswith("failed"):
            summary = folder / "summary.json"
            stopped = json.loads(summary.read_text()).get("stopped_by") if summary.exists() else None
            curve.stopped = "target" if stopped == "target_loss" else "budget"
        return curve


def eval_every(cand: Candidate, steps: float) -> int:
    """A pilot's evaluation cadence: :data:`EVALS_PER_PILOT` over its predicted steps; at least
    :data:`OVERLAP_EVAL_STEPS` apart for ACCO/DPU/WP (an evaluation waits for the update in flight, which would keep
    their stages from growing as they do in the planned run); for Local SGD and DiLoCo right after syncs (a multiple
    of the period, or a divisor of it: the evaluated model changes at syncs) — as each strategy declares (its
    ``PlanFacts.stages`` and ``sync_period``); with adaptive inner steps a multiple of the round (the trainer
    refuses any other)."""
    from ..train.adaptive_rounds import round_length

    every = max(1, int(steps // EVALS_PER_PILOT))
    facts = declaration(cand.strategy).plan
    if facts.stages:
        return max(every, OVERLAP_EVAL_STEPS)
    cfg = strategy_config(cand.strategy, cand.knob_dict)
    rounds = round_length(cfg)
    if rounds is not None:  # adaptive inner steps: the workers meet (and may evaluate) only at a round's end
        return max(rounds, every - every % rounds)
    period = facts.sync_period(cfg) if facts.sync_period else 1
    if period > 1:
        if every >= period:
            return every - every % period
        while period % every:
            every -= 1
    return every


class _Tail:
    """New complete JSON lines of a growing file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pos = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path) as f:
                f.seek(self.pos)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind("\n")  # a line still being written has no newline yet: left for the next read
        if end < 0:
            return []
        self.pos += len(chunk[: end + 1].encode())  # seek takes bytes, and a character may be several
        return [json.loads(line) for line in chunk[: end + 1].splitlines() if line.strip()]


__all__ = ["ETA", "RUNGS", "PilotCurve", "ProcessRunner", "Runner", "eval_every", "rungs",
           "successive_halving"]
