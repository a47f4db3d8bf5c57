"""How far a loss curve fitted to a pilot's first tokens carries: the planner's baseline-curve rule checked on every
curve the equal-loss runs measured to the target.

For each distinct held-out loss curve of ``results/equal_loss.json`` (the synchronous and low-communication settings
at every link and seed; ACCO/DPU/WP are left out — their stages hold link-dependent token counts, so their 50-step
warm-up spans up to the whole run) the first ``P`` tokens (0.4 M and 0.8 M: the plans' pilots are 0.4 M) are made into
a pilot and handed to :func:`quietsync.plan.pilot_plan.baseline_curve`, the function the planner fits its baseline
with; its predicted tokens to held-out losses 4.2, 4.0, 3.8 and 3.6 are set against the tokens the run measured
there (where that lies past 1.2 ``P``: an extrapolation). The rules side by side: the power law fitted to every
evaluation, fitted to the evaluations after the job's learning-rate warm-up (the planner's rule,
:data:`~quietsync.plan.pilot_plan.MIN_FIT_EVALS`), and that with other caps on the fitted floor than the planner's
:data:`~quietsync.plan.pilot_plan.FLOOR_CAP`.

    python benchmarks/bench_curve_extrapolation.py        # reads results/equal_loss.json, seconds

Writes ``results/curve_extrapolation.{json,md}``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_markdown  # noqa: E402

PREFIXES = (400_000, 800_000)
TARGETS = (4.2, 4.0, 3.8, 3.6)
PAST = 1.2
"""A target counts where the run measured it past this many times the pilot's tokens."""
ADAPTIVE = ("acco", "dpu", "wp")
OTHER_CAPS = (0.5, 0.65, 0.75)
"""Floor caps (fractions of the lowest loss a pilot saw) compared beside the planner's ``FLOOR_CAP``."""


def curves(equal_loss: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Distinct measured curves (identical trajectories — DDP, ZeRO-1 and FSDP, or one setting on two links whose
    steps do not depend on the link — counted once), keyed ``spec seed S``."""
    out: dict[str, list[dict[str, Any]]] = {}
    seen: set[tuple[Any, ...]] = set()
    for link in equal_loss["results"].values():
        for rec in link.values():
            if rec["strategy"] in ADAPTIVE:
                continue
            for run in rec.get("runs_detail", []):
                pts = [p for p in run.get("curve", []) if p["tokens"] > 0]
                if len(pts) < 8:
                    continue
                sig = tuple(round(p["loss"], 5) for p in pts[:8])
                if sig in seen:
                    continue
                seen.add(sig)
                out[f"{rec['spec']} seed {run['seed']}"] = pts
    return out


def measured_tokens(pts: list[dict[str, Any]], target: float) -> float | None:
    """Tokens at which the curve first reaches ``target`` (linear between evaluations)."""
    prev = None
    for p in pts:
        if p["loss"] <= target:
            if prev is None:
                return float(p["tokens"])
            share = (prev["loss"] - target) / (prev["loss"] - p["loss"])
            return prev["tokens"] + (p["tokens"] - prev["tokens"]) * share
        prev = p
    return None


def study(equal_loss: dict[str, Any]) -> dict[str, Any]:
    from quietsync.plan import pilot_plan
    from quietsync.plan.pilot_plan import baseline_curve
    from quietsync.plan.pilots import PilotCurve

    warmup = int(equal_loss["job"]["warmup_steps"])
    cap = pilot_plan.FLOOR_CAP
    rules = {"every evaluation": (0, cap), f"after the {warmup}-step warm-up": (warmup, cap),
             **{f"after the warm-up, floor ≤ {c:g}× (not the planner's {cap:g}×)": (warmup, c) for c in OTHER_CAPS}}
    pairs: list[dict[str, Any]] = []
    found = curves(equal_loss)
    for name, pts in found.items():
        for prefix in PREFIXES:
            head = [p for p in pts if p["tokens"] <= prefix]
            pilot = PilotCurve(name, [float(p["tokens"]) for p in head], [float(p["loss"]) for p in head],
                               [int(p["step"]) for p in head])
            fits = {rule: baseline_curve(pilot, w, c) for rule, (w, c) in rules.items()}
            for target in TARGETS:
                truth = measured_tokens(pts, target)
                if truth is None or truth <= PAST * prefix:
                    continue
                pairs.append({"curve": name, "pilot_tokens": prefix, "target": target, "measured": truth,
                              **{rule: fits[rule].law.tokens_to(target) / truth for rule in rules}})
    summary = {}
    for rule in rules:
        for prefix in (None, *PREFIXES):
            sel = [p[rule] for p in pairs if prefix is None or p["pilot_tokens"] == prefix]
            finite = [r for r in sel if math.isfinite(r)]
            errs = [abs(math.log(r)) if 0 < r < math.inf else math.inf for r in sel]
            summary[f"{rule} | {'all' if prefix is None else f'{prefix / 1e6:g} M'}"] = {
                "rule": rule, "pilot_tokens": prefix, "pairs": len(sel), "median_ratio": statistics.median(sel),
                "p10": float(np.percentile(finite, 10)), "p90": float(np.percentile(finite, 90)),
                "median_abs_error": math.exp(statistics.median(errs)) - 1,
                "off_by_2x": sum(1 for r in sel if not 0.5 <= r <= 2.0)}
    return {"curves": len(found), "warmup_steps": warmup, "rules": list(rules), "summary": summary, "pairs": pairs}


def main() -> int:
    equal_loss = json.loads((RESULTS / "equal_loss.json").read_text())
    res = study(equal_loss)
    (RESULTS / "curve_extrapolation.json").write_text(json.dumps(res, indent=1) + "\n")
    rows = [[s["rule"], "0.4 + 0.8 M" if s["pilot_tokens"] is None else f"{s['pilot_tokens'] / 1e6:g} M",
             s["pairs"], s["median_ratio"], f"{s['p10']:.2f}–{s['p90']:.2f}", f"{s['median_abs_error']:.0%}",
             s["off_by_2x"]] for s in res["summary"].values()]
    notes = (f"{res['curves']} distinct held-out loss curves of `results/equal_loss.json` (every setting but ACCO/DPU/"
             f"WP, every link and seed); each curve's first 0.4 or 0.8 M tokens fitted by "
             f"`quietsync.plan.pilot_plan.baseline_curve`, its tokens to held-out losses "
             f"{', '.join(map(str, TARGETS))} predicted where the run measured them past {PAST}× the pilot. Ratio: "
             f"predicted over measured tokens.\n\nReproduce: `python benchmarks/bench_curve_extrapolation.py`.")
    path = write_markdown("curve_extrapolation", "Loss-curve extrapolation: fitted to every evaluation or after the "
                          "warm-up", ["fitted to", "pilot", "pairs", "median predicted / measured", "10th–90th pct",
                                      "median |error|", "off by 2×"], rows, notes)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
