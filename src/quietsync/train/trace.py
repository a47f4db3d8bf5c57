"""Timelines (``--trace``): when each worker computed, communicated and waited, in one merged trace.

The transport records every collective as a span on the ``comm`` lane and strategies record the main
thread's ``compute`` and ``idle`` spans (:mod:`quietsync.events`). With ``--trace``, at the end of the run
every worker turns its spans into Chrome trace events (:func:`trace_events`), the events are gathered on
rank 0 with one ``all_gather`` over ``world`` (so nodes need no shared disk), and rank 0 writes them all as
``OUT/trace.json`` (:func:`write_merged_trace`; no per-worker files) and draws ``timeline.png``: a few steps
from the middle of the run, one row per worker and lane.

In the trace (open it in https://ui.perfetto.dev or ``chrome://tracing``):

* one **process** per worker (``pid`` = rank, named ``worker R``, in rank order), with the threads
  ``compute`` and ``idle`` holding complete (``"X"``) slices of the main thread;
* each **collective** is an async slice (``"b"``/``"e"``, ``cat`` ``comm``, an ``id`` unique in the file)
  from issue to completion, named after the operation (``ddp_bucket``, ``all_gather/params``, ...), so
  collectives that overlap (several DDP buckets in flight) get rows of their own instead of being drawn as
  if nested. Under link emulation it holds two children: ``queued`` (issued → its transfer starts being
  served on the emulated link, i.e. waiting behind earlier transfers on the FIFO link) and ``on wire``
  (that start → completion). Its ``args`` hold the group, kind, bytes sent, modeled seconds, and
  ``queued_ms`` / ``wire_ms`` (and ``device_ms`` on CUDA, from CUDA events on the issuing stream).

Times are wall-clock microseconds: each worker adds ``clock_offset = time.time() - time.perf_counter()``
(taken once per run) to its ``perf_counter`` span times. Local workers share both clocks, so they line up
to a few microseconds; workers on different nodes line up as well as the nodes' clocks do (NTP).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..cli.figures import pyplot, save_figure

LANE_ORDER = ("compute", "comm", "idle")
"""Lanes, top to bottom."""

LANE_COLORS = {"compute": "tab:blue", "comm": "tab:orange", "idle": "tab:red"}

TRACE_FILE = "trace.json"
"""The merged trace under ``--out``."""

QUEUED, ON_WIRE = "queued", "on wire"
"""Names of the two children of a collective's async slice."""

_IDS_PER_RANK = 1 << 32
"""Async ids of rank R are ``R * _IDS_PER_RANK + i``: unique in the merged file."""


def _jsonable(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else str(value)


def trace_events(spans, rank: int, clock_offset: float) -> list[dict[str, Any]]:
    """Chrome trace events of one worker's ``spans`` (``perf_counter`` times + ``clock_offset`` = epoch s).

    ``compute``/``idle`` (and any other lane but ``comm``) spans become ``"X"`` slices on a thread per lane;
    ``comm`` spans become async ``"b"``/``"e"`` slices with ``queued`` and ``on wire`` children (see the module
    docstring), in an order where every child opens after and closes before its parent.
    """
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"worker {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
    ]
    lanes = list(LANE_ORDER) + sorted({s.lane for s in spans} - set(LANE_ORDER))
    for tid, lane in enumerate(lanes):
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    comm_tid = lanes.index("comm")
    for i, s in enumerate(spans):
        ts, end = (s.t0 + clock_offset) * 1e6, (max(s.t0, s.t1) + clock_offset) * 1e6
        if s.lane != "comm":
            events.append({"name": s.name, "cat": s.lane, "ph": "X", "pid": rank, "tid": lanes.index(s.lane),
                           "ts": ts, "dur": end - ts, "args": dict(s.meta)})
            continue
        common = {"cat": "comm", "pid": rank, "tid": comm_tid, "id": rank * _IDS_PER_RANK + i}
        args = dict(s.meta)
        if s.t_wire is not None:
            args.update(queued_ms=s.queued * 1e3, wire_ms=(s.duration - s.queued) * 1e3)
        if s.device_s is not None:
            args["device_ms"] = s.device_s * 1e3
        events.append({"name": s.name, "ph": "b", "ts": ts, **common, "args": args})
        if s.t_wire is not None:
            wire = ts + s.queued * 1e6
            if wire > ts:  # no queued child when it went on the wire at once
                events.append({"name": QUEUED, "ph": "b", "ts": ts, **common})
                events.append({"name": QUEUED, "ph": "e", "ts": wire, **common})
            events.append({"name": ON_WIRE, "ph": "b", "ts": wire, **common})
            events.append({"name": ON_WIRE, "ph": "e", "ts": end, **common})
        events.append({"name": s.name, "ph": "e", "ts": end, **common})
    return events


def merge_traces(per_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One trace-file object of every worker's :func:`trace_events`."""
    return {"traceEvents": [e for events in per_rank for e in events], "displayTimeUnit": "ms"}


def collect_spans(recorder: Any) -> list[Any]:
    """The recorder's spans, with the device times of CUDA-timed ones filled in (this synchronises with
    their events, so call it after the work is done)."""
    recorder.resolve_device_times()
    return recorder.spans()


def write_merged_trace(out: str | os.PathLike, transport: Any, spans, clock_offset: float) -> Path | None:
    """Gather every worker's events on rank 0 and write ``OUT/trace.json`` there (returns its path; None on
    the other ranks). Every worker of ``world`` must call it (one ``all_gather`` of the encoded events)."""
    mine = json.dumps(trace_events(spans, transport.topology.rank, clock_offset), default=_jsonable).encode()
    # bytearray: torch.frombuffer warns on a read-only buffer
    encoded = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(transport.device)
    parts = transport.all_gather_uneven(encoded, group="world", name="trace")  # each worker's events differ in length
    if transport.topology.rank != 0:
        return None
    per_rank = [json.loads(bytes(p.cpu().numpy().tobytes()).decode()) for p in parts]
    path = Path(out) / TRACE_FILE
    path.write_text(json.dumps(merge_traces(per_rank)), encoding="utf-8")
    return path


def read_traces(out: str | os.PathLike) -> dict[int, list[dict[str, Any]]]:
    """``{rank: [{"cat", "name", "ts", "dur"}]}`` of ``OUT/trace.json``: the ``"X"`` slices and, for each
    collective, its outermost async slice (issue to completion); ``{}`` if there is no trace."""
    path = Path(out) / TRACE_FILE
    if not path.is_file():
        return {}
    traces: dict[int, list[dict[str, Any]]] = {}
    opened: dict[tuple[int, Any], dict[str, Any]] = {}
    for e in json.loads(path.read_text(encoding="utf-8"))["traceEvents"]:
        ph = e.get("ph")
        if ph == "X":
            traces.setdefault(e["pid"], []).append(e)
        # children share their collective's id: its first "b" opens it, the "e" of its own name closes it
        elif ph == "b" and (e["pid"], e["id"]) not in opened:
            opened[(e["pid"], e["id"])] = e
        elif ph == "e" and e.get("name") == opened.get((e["pid"], e["id"]), {}).get("name"):
            b = opened.pop((e["pid"], e["id"]))
            traces.setdefault(e["pid"], []).append(
                {"cat": b["cat"], "name": b["name"], "ts": b["ts"], "dur": e["ts"] - b["ts"]})
    return dict(sorted(traces.items()))


def _window(traces: dict[int, list[dict[str, Any]]], steps: int, window_steps: int) -> tuple[float, float]:
    """``(lo, hi)`` in trace microseconds: about ``window_steps`` steps from the middle of the run."""
    all_events = [e for evs in traces.values() for e in evs]
    start = min(e["ts"] for e in all_events)
    end = max(e["ts"] + e["dur"] for e in all_events)
    width = (end - start) / max(1, steps) * window_steps
    lo = start + (end - start) / 2 - width / 2
    return lo, lo + width


def _draw_timeline(ax: Any, traces: dict[int, list[dict[str, Any]]], lo: float, hi: float) -> None:
    """One row per worker and lane of ``traces`` between ``lo`` and ``hi`` (milliseconds from ``lo`` on x)."""
    rows = [(rank, lane) for rank in traces for lane in LANE_ORDER]
    for y, (rank, lane) in enumerate(rows):
        bars = [((max(e["ts"], lo) - lo) / 1e3, (min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)) / 1e3)
                for e in traces[rank] if e.get("cat") == lane and e["ts"] < hi and e["ts"] + e["dur"] > lo]
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=LANE_COLORS.get(lane, "gray"))
    ax.set_yticks(range(len(rows)), [f"worker {r} {lane}" for r, lane in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # top to bottom, every row shown (empty lanes too)
    ax.set_xlabel("milliseconds (a window in the middle of the run)")
    ax.grid(axis="x", alpha=0.3)


def plot_timeline(out: str | os.PathLike, steps: int, title: str = "", window_steps: int = 4) -> Path | None:
    """Draw ``OUT/timeline.png``: about ``window_steps`` steps from the middle of the run (None if no spans)."""
    traces = read_traces(out)
    if not any(traces.values()):
        return None
    plt = pyplot()

    lo, hi = _window(traces, steps, window_steps)
    rows = len(traces) * len(LANE_ORDER)
    fig, ax = plt.subplots(figsize=(12, 0.45 * rows + 1.2), constrained_layout=True)
    _draw_timeline(ax, traces, lo, hi)
    ax.set_xlim(0, (hi - lo) / 1e3)
    if title:
        ax.set_title(title)
    return save_figure(fig, out, "timeline.png")


def plot_timelines(runs: list[tuple[str, str | os.PathLike, int]], path: str | os.PathLike,
                   window_steps: int = 4) -> Path | None:
    """Draw the timelines of several runs side by side in one figure at ``path`` (`quietsync compare --trace`).

    ``runs`` holds ``(label, run folder, committed steps)``; a run without a ``trace.json`` is left out (None
    when none has one). Every panel shows the same length of time from the middle of its run: that of about
    ``window_steps`` steps of the run whose steps take longest, so a faster run shows more steps in it.
    """
    panels = []
    for label, out, steps in runs:
        traces = read_traces(out)
        if any(traces.values()):
            panels.append((label, steps, traces, _window(traces, steps, window_steps)))
    if not panels:
        return None
    plt = pyplot()

    rows = max(len(traces) for _, _, traces, _ in panels) * len(LANE_ORDER)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 0.45 * rows + 1.5), squeeze=False,
                             constrained_layout=True)
    width = max(hi - lo for _, _, _, (lo, hi) in panels)
    for ax, (label, steps, traces, (lo, hi)) in zip(axes[0], panels):
        mid = (lo + hi) / 2
        _draw_timeline(ax, traces, mid - width / 2, mid + width / 2)
        ax.set_xlim(0, width / 1e3)
        ax.set_title(f"{label} ({steps} steps in the run)")
    path = Path(path)
    return save_figure(fig, path.parent, path.name)
