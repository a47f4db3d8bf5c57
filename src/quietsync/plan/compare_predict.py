"""``quietsync compare --predict``: the plan of the runs about to be compared, and its predictions beside them.

The plan is made for exactly the compared settings (``only``), on the same model, micro-batch, workers and links;
with ``--target-loss X --pilot-tokens N`` it runs pilots of those settings (the compared job's training flags —
learning rate, schedule, data, seed — are the pilots'), so each run gets a predicted time and tokens to the target
and a predicted held-out curve (loss over tokens, and over time at the predicted tokens/s) that ``compare.png``
draws dashed beside the measured one. Without pilots the speed is predicted (step time, tokens/s, bytes, busy) and
the time to target is not (a measured plan needs a pilot for the baseline's loss curve).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .candidates import parse_candidate
from .config import PlanConfig

TRAJECTORY_FIELDS = ("lr", "weight_decay", "warmup_steps", "min_lr_ratio", "max_steps", "dataset", "eval_fraction",
                     "seed", "tokenizer", "eval_windows", "eval_every", "precision", "max_grad_norm", "cache_dir")
"""Job fields the pilots take from the compared job (what shapes the loss curve and its evaluations)."""
CURVE_POINTS = 40


def train_args(cfg: Any) -> list[str]:
    """The compared job's trajectory flags that differ from ``quietsync train``'s defaults."""
    from ..cli.flags import flag_name
    from ..train.config import TrainConfig

    default = TrainConfig()
    out: list[str] = []
    for name in TRAJECTORY_FIELDS:
        value = getattr(cfg, name)
        if value == getattr(default, name) or value is None:
            continue
        if isinstance(value, bool):
            out.append(flag_name(name) if value else "--no-" + name.replace("_", "-"))
        else:
            # repr: the float exactly as the job had it
            out += [flag_name(name), repr(value) if isinstance(value, float) else str(value)]
    return out


def plan_config(job: tuple[Any, Any, int | None], specs: list[str], target_loss: float | None = None,
                pilot_tokens: int | None = None, out: Path | None = None) -> PlanConfig:
    """The :class:`~quietsync.plan.config.PlanConfig` predicting the runs of ``quietsync compare --predict``."""
    import shlex

    cfg, _, nodes = job
    pilots: dict[str, Any] = {}
    if target_loss is not None and pilot_tokens is not None:
        pilots = {"target_loss": target_loss, "pilot_tokens": pilot_tokens, "train_args": shlex.join(train_args(cfg)),
                  "pilot_out": str(out / "pilots") if out is not None else None}
    return PlanConfig(model=cfg.model, nproc=cfg.nproc, nodes=nodes, link=list(cfg.link),
                      micro_batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size,
                      strategies=list(specs), only=True, threads=cfg.threads, timeout_s=cfg.timeout_s,
                      slow_worker=[cfg.slow_worker] if cfg.slow_worker else [], **pilots)


def predictions(result: Any, specs: list[str], workers: int, horizon_tokens: float) -> dict[str, dict[str, Any]]:
    """Spec (as given to compare) → the plan's prediction for it: speed, bytes, busy, and with a target its time and
    tokens to it and its predicted curve up to ``horizon_tokens`` (or its tokens to target, if more)."""
    from .loss_model import loss_at

    by_spec = {s.row.spec: s for s in result.scored}
    out = {}
    for spec in specs:
        s = by_spec.get(parse_candidate(spec).spec)
        if s is None:
            continue
        p = s.row
        pred: dict[str, Any] = {
            "label": p.label, "spec": p.spec, "step_s": p.step_s, "tokens_per_s": p.tokens_per_s,
            "compute_busy": p.compute_busy, "micro_batches_per_step": p.micro_batches,
            "bytes_sent_per_step": sum(p.bytes_per_step.values()) * workers}
        if result.objective.target is not None and result.objective.baseline.source == "pilot":
            est = s.estimate
            pred["source"] = est.source
            pred["tokens_to_target"] = vars(est.tokens)
            pred["time_to_target_s"] = vars(s.time.seconds) if s.time is not None else None
            end = max(horizon_tokens, est.tokens.value if math.isfinite(est.tokens.value) else 0.0)
            # from the first evaluation the curve rests on (a fitted power law is not drawn backwards)
            base = result.objective.baseline
            first = base.measured[0][0] if base.measured else 0.0
            ts = [t for t in (end * (i + 1) / CURVE_POINTS for i in range(CURVE_POINTS)) if t >= first]
            speed = result.objective.tokens_per_s(p)  # the speed the time to target uses (pilots' measured)
            pred["tokens_per_s"], pred["step_s"] = speed, p.tokens_per_step / speed
            top = base.measured[0][1] if base.measured else math.inf  # nothing above the first loss measured
            curve = [{"tokens": t, "time_s": t / speed, "loss": loss_at(est, base, t).value} for t in ts]
            pred["curve"] = [c for c in curve if c["loss"] <= top]
        out[spec] = pred
    return out


def predicted_markdown(rows: list[dict[str, Any]]) -> str:
    """Predictions beside measurements: step time, tokens/s, micro-batches and bytes per step, compute-busy, and
    (with a target and pilots) time and tokens to the target."""
    target = any(r.get("predicted", {}).get("time_to_target_s") is not None or
                 "tokens_to_target" in r.get("predicted", {}) for r in rows)
    head = ("| run | step s pred / meas | tokens/s pred / meas | micro-batches/step pred / meas "
            "| MB sent/step pred / meas | compute-busy pred / meas |")
    cols = 6
    if target:
        head += " time to target s pred (interval) / meas | tokens to target pred / meas |"
        cols += 2
    lines = ["", "Predicted (quietsync plan) beside measured:", "", head, "|" + "---|" * cols]
    for r in rows:
        p = r.get("predicted")
        if p is None:
            continue
        step = r["wall_s"] / max(1, r["steps"])
        line = (f"| {r['label']} | {p['step_s']:.3g} / {step:.3g} "
                f"| {p['tokens_per_s']:,.0f} / {r['tokens_per_s']:,.0f} "
                f"| {p['micro_batches_per_step']:.3g} / {r['micro_batches_per_step']:.3g} "
                f"| {p['bytes_sent_per_step'] / 1e6:.3g} / {r['bytes_sent_per_step'] / 1e6:.3g} "
                f"| {p['compute_busy']:.0%} / {r['compute_fraction']:.0%} |")
        if target:
            meas_t = r.get("time_to_target_s")
            meas_k = r.get("tokens_to_target")
            t = p.get("time_to_target_s")
            k = p.get("tokens_to_target")
            pt = (f"{t['value']:.3g} ({t['low']:.3g}–{t['high']:.3g})" if t and math.isfinite(t["value"])
                  else "not reached")
            pk = f"{k['value']:,.0f}" if k and math.isfinite(k["value"]) else "—"
            line += (f" {pt} / {f'{meas_t:.3g}' if meas_t is not None else 'not reached'} "
                     f"| {pk} / {f'{meas_k:,}' if meas_k is not None else '—'} |")
        lines.append(line)
    return "\n".join(lines) + "\n"


__all__ = ["plan_config", "predicted_markdown", "predictions", "train_args"]
