"""The plan's figure, ``plan.png`` (matplotlib, from the ``train`` extra): two panels.

* **Step-time breakdown**: each strategy's best setting as a bar of seconds per 1k tokens (time per token is the
  fair unit: strategies take different numbers of micro-batches per step), split into compute and exposed
  communication, with its compute-busy fraction (log scale: a slow link spreads them over decades).
* **Time to target against link bandwidth**: each strategy's best setting (knobs fixed) — its predicted time to
  the target loss (or, with a time budget, its loss after it) — as the bandwidth of the slow link sweeps from
  1 Mbit/s to 100 Gbit/s, the crossover points (where the best setting changes) marked, and the planned link as a
  vertical line.
"""

from __future__ import annotations

from pathlib import Path

from ..cli.figures import DPI, pyplot
from ..link import LinkModel
from .table import Row

Sweep = tuple[str, list[float], dict[str, list[float]], list[tuple[float, str, str]]]
"""``(link kind, bandwidths in bytes/s, {spec: objective}, crossovers)``, as
:meth:`~quietsync.plan.result.PlanResult.sweep` returns it."""


def plot_plan(rows: list[Row], sweep: Sweep | None, planned: LinkModel | None, title: str, path: str | Path,
              objective: str = "predicted seconds to the target", log_objective: bool = True) -> Path:
    """Draw ``path`` (see the module docstring) from each strategy's best row (fastest first), the bandwidth sweep
    (None with one worker: no second panel) and the planned link of the swept kind; return it."""
    plt = pyplot()
    fig, (ax_bar, ax_bw) = plt.subplots(1, 2, figsize=(16, 0.45 * max(6, len(rows)) + 2), constrained_layout=True)
    # barh draws from the bottom up: reversed, the fastest is on top
    labels = [r.label for r in rows][::-1]
    names = {r.spec: r.label for r in rows}
    per_k = [1e3 / r.tokens_per_s for r in rows][::-1]
    busy = [r.compute_busy for r in rows][::-1]
    compute = [p * b for p, b in zip(per_k, busy)]
    exposed = [p - c for p, c in zip(per_k, compute)]
    floor = min(compute) / 10  # log scale: the compute bar starts here
    ax_bar.barh(labels, [c - floor for c in compute], left=floor, label="compute")
    ax_bar.barh(labels, exposed, left=compute, label="exposed communication")
    for i, (p, b) in enumerate(zip(per_k, busy)):
        ax_bar.text(p, i, f" {p:.3g} s, {b:.0%} busy", va="center", fontsize=8)
    ax_bar.set_xscale("log")
    ax_bar.set_xlim(floor, max(per_k) * 8)  # room right of the longest bar for its label
    ax_bar.set(xlabel="seconds per 1k tokens (each strategy's best setting; log scale)",
               title="predicted step-time breakdown")
    ax_bar.legend(loc="upper right")
    if sweep is not None:
        kind, bws, curves, crossovers = sweep
        mbit = [b * 8 / 1e6 for b in bws]
        for spec, ys in curves.items():
            ax_bw.plot(mbit, ys, label=names.get(spec, spec))
        for b, _, to in crossovers:
            y = min(c[min(range(len(bws)), key=lambda i: abs(bws[i] - b))] for c in curves.values())
            ax_bw.plot([b * 8 / 1e6], [y], "ko", ms=5)
            ax_bw.annotate(f"{b * 8 / 1e6:.3g} Mbit/s → {names.get(to, to)}", (b * 8 / 1e6, y),
                           textcoords="offset points", xytext=(4, 6), fontsize=7)
        if planned is not None:
            ax_bw.axvline(planned.bandwidth * 8 / 1e6, color="grey", ls="--", lw=1, label=f"planned {kind} link")
        ax_bw.set(xscale="log", yscale="log" if log_objective else "linear", xlabel=f"{kind} bandwidth (Mbit/s)",
                  ylabel=objective, title=f"{objective} vs link bandwidth (crossovers marked)")
        ax_bw.grid(alpha=0.3, which="both")
        ax_bw.legend(fontsize=7)
    else:
        ax_bw.set_axis_off()
    fig.suptitle(title)
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
