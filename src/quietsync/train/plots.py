"""Loss curves from the metrics files: ``loss.png`` (train and eval loss vs step and vs tokens).

Reads every ``metrics-rank*.jsonl`` under the output folder. The train curve is the mean over the
workers' per-step losses; the token axis sums the workers' cumulative token counts at each step (on a
multi-node run whose other nodes' files are elsewhere it scales the present ones up to the world size).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path

from ..cli.figures import pyplot, save_figure
from .metrics import knob_change, read_jsonl


def loss_curves(out: str | os.PathLike, world_size: int | None = None) -> dict[str, list[float]]:
    """``{"step", "loss", "tokens", "eval_step", "eval_loss", "eval_tokens"}`` from the metrics files."""
    numbered = []
    for p in Path(out).glob("metrics-rank*.jsonl"):
        m = re.fullmatch(r"metrics-rank(\d+)", p.stem)
        if m:
            numbered.append((int(m.group(1)), p))
    files = [p for _, p in sorted(numbered)]  # by rank number: rank 0's evaluation comes first
    losses: dict[int, list[float]] = defaultdict(list)
    tokens: dict[int, list[int]] = defaultdict(list)
    evals: dict[int, float] = {}
    for path in files:
        for r in read_jsonl(path):
            if r.get("event") == "eval":
                evals.setdefault(r["step"], r["loss"])  # the lowest rank's evaluation wins
            elif r.get("loss") is not None:  # null: no finite loss (a step finish() committed, a diverged one)
                losses[r["step"]].append(r["loss"])
                tokens[r["step"]].append(r["tokens_total"])
    scale = (world_size / len(files)) if world_size and files else 1.0
    steps = sorted(losses)
    step_tokens = {s: sum(tokens[s]) * scale for s in steps}
    eval_steps = sorted(evals)

    def tokens_at(step: int) -> float:
        if step in step_tokens:
            return step_tokens[step]
        # an evaluation at a step with no train record (step 0, a step finish() committed)
        before = [s for s in steps if s <= step]
        return step_tokens[before[-1]] if before else 0.0

    return {
        "step": [float(s) for s in steps],
        "loss": [sum(losses[s]) / len(losses[s]) for s in steps],
        "tokens": [step_tokens[s] for s in steps],
        "eval_step": [float(s) for s in eval_steps],
        "eval_loss": [evals[s] for s in eval_steps],
        "eval_tokens": [tokens_at(s) for s in eval_steps],
    }


def knob_changes(out: str | os.PathLike) -> list[dict]:
    """The knob changes ``--adapt`` made (the ``adapt`` entries of the lowest rank's step records, each with its
    ``step``, ``knob``, ``old``, ``new`` and ``why``), in order."""
    files = sorted(Path(out).glob("metrics-rank*.jsonl"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not files:
        return []
    return [c for c in map(knob_change, read_jsonl(files[0])) if c is not None]


def plot_loss(out: str | os.PathLike, world_size: int | None = None, title: str = "") -> Path:
    """Draw ``OUT/loss.png`` and return its path (with a dotted line at each knob change of ``--adapt``)."""
    plt = pyplot()
    c = loss_curves(out, world_size)
    changes = knob_changes(out)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for ax, x, ex, label in (
        (axes[0], c["step"], c["eval_step"], "step"),
        (axes[1], c["tokens"], c["eval_tokens"], "tokens (all workers)"),
    ):
        ax.plot(x, c["loss"], lw=1, alpha=0.8, label="train (mean over workers)")
        if c["eval_loss"]:
            ax.plot(ex, c["eval_loss"], "o-", lw=1.5, ms=4, label="eval (held out)")
        for i, ch in enumerate(changes):  # where --adapt changed a knob, on the step (and its tokens) axis
            at = ch["step"] if ax is axes[0] else _tokens_at(c, ch["step"])
            ax.axvline(at, color="grey", ls=":", lw=1, label="--adapt changes" if i == 0 else None)
            ax.annotate(f"{ch['knob']} {ch['old']}→{ch['new']}", (at, 1), xycoords=("data", "axes fraction"),
                        rotation=90, va="top", ha="right", fontsize=7, color="grey")
        ax.set_xlabel(label)
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    return save_figure(fig, out, "loss.png")


def _tokens_at(c: dict[str, list[float]], step: int) -> float:
    """Tokens of the last recorded step at or before ``step``."""
    before = [t for s, t in zip(c["step"], c["tokens"]) if s <= step]
    return before[-1] if before else 0.0
