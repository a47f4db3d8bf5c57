"""Timelines (``--trace``): when each worker computed, communicated and waited.

The transport records every collective as a span on the ``comm`` lane and strategies record the main
thread's ``compute`` and ``idle`` spans (:mod:`quietsync.events`). With ``--trace`` each worker writes its
spans as ``trace-rank{R}.json`` in the Chrome trace-event format (open it in https://ui.perfetto.dev or
``chrome://tracing``; one process per worker, one thread per lane), and rank 0 draws ``timeline.png``: a
few steps from the middle of the run, one row per worker and lane, so one can see whether computation
kept going while the network was busy.

Times are wall-clock microseconds (``time.time()``), so local workers line up exactly and nodes line up
as well as their clocks do.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .plots import pyplot, save_figure

LANE_ORDER = ("compute", "comm", "idle")
"""Lanes, top to bottom."""

LANE_COLORS = {"compute": "tab:blue", "comm": "tab:orange", "idle": "tab:red"}


def _jsonable(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)


def trace_events(spans, rank: int, clock_offset: float) -> list[dict[str, Any]]:
    """Chrome ``"X"`` events of ``spans`` (``perf_counter`` times + ``clock_offset`` = epoch seconds)."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"worker {rank}"}},
    ]
    lanes = list(LANE_ORDER) + sorted({s.lane for s in spans} - set(LANE_ORDER))
    for tid, lane in enumerate(lanes):
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
    for s in spans:
        events.append({
            "name": s.name, "cat": s.lane, "ph": "X", "pid": rank, "tid": lanes.index(s.lane),
            "ts": (s.t0 + clock_offset) * 1e6, "dur": max(0.0, s.t1 - s.t0) * 1e6, "args": dict(s.meta),
        })
    return events


def write_trace(out: str | os.PathLike, rank: int, spans, clock_offset: float) -> Path:
    """Write ``OUT/trace-rank{rank}.json``."""
    path = Path(out) / f"trace-rank{rank}.json"
    payload = {"traceEvents": trace_events(spans, rank, clock_offset), "displayTimeUnit": "ms"}
    path.write_text(json.dumps(payload, default=_jsonable), encoding="utf-8")
    return path


def read_traces(out: str | os.PathLike) -> dict[int, list[dict[str, Any]]]:
    """``{rank: [X events]}`` from the ``trace-rank*.json`` files under ``out``."""
    traces = {}
    for p in Path(out).glob("trace-rank*.json"):
        m = re.fullmatch(r"trace-rank(\d+)", p.stem)
        if m:
            events = json.loads(p.read_text(encoding="utf-8"))["traceEvents"]
            traces[int(m.group(1))] = [e for e in events if e.get("ph") == "X"]
    return dict(sorted(traces.items()))


def plot_timeline(out: str | os.PathLike, steps: int, title: str = "", window_steps: int = 4) -> Path | None:
    """Draw ``OUT/timeline.png``: about ``window_steps`` steps from the middle of the run (None if no spans)."""
    traces = read_traces(out)
    all_events = [e for evs in traces.values() for e in evs]
    if not all_events:
        return None
    plt = pyplot()

    start = min(e["ts"] for e in all_events)
    end = max(e["ts"] + e["dur"] for e in all_events)
    width = (end - start) / max(1, steps) * window_steps
    lo = start + (end - start) / 2 - width / 2
    hi = lo + width
    rows = [(rank, lane) for rank in traces for lane in LANE_ORDER]
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.2), constrained_layout=True)
    for y, (rank, lane) in enumerate(rows):
        bars = [((max(e["ts"], lo) - lo) / 1e3, (min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)) / 1e3)
                for e in traces[rank] if e.get("cat") == lane and e["ts"] < hi and e["ts"] + e["dur"] > lo]
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=LANE_COLORS.get(lane, "gray"))
    ax.set_yticks(range(len(rows)), [f"worker {r} {lane}" for r, lane in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, (hi - lo) / 1e3)
    ax.set_xlabel("milliseconds (a window in the middle of the run)")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    return save_figure(fig, out, "timeline.png")
