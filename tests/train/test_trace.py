"""--trace: Chrome trace events per worker and the timeline picture."""

from __future__ import annotations

import json

import pytest

from quietsync.events import Span
from quietsync.train.trace import plot_timeline, read_traces, trace_events, write_trace

pytestmark = pytest.mark.timeout(60)


def test_trace_events_and_files(tmp_path):
    spans = [Span("compute", "micro_batch", 1.0, 1.5), Span("comm", "all_gather/params", 1.2, 1.4, {"group": "world"}),
             Span("idle", "wait", 1.5, 1.6)]
    events = trace_events(spans, rank=1, clock_offset=1000.0)
    xs = [e for e in events if e["ph"] == "X"]
    assert [(e["cat"], e["tid"], e["pid"]) for e in xs] == [("compute", 0, 1), ("comm", 1, 1), ("idle", 2, 1)]
    assert xs[0]["ts"] == pytest.approx(1001.0e6) and xs[0]["dur"] == pytest.approx(0.5e6)
    assert xs[1]["args"] == {"group": "world"}
    assert {e["args"]["name"] for e in events if e["ph"] == "M"} == {"worker 1", "compute", "comm", "idle"}
    for rank in (0, 1):
        write_trace(tmp_path, rank, spans, 1000.0 + rank * 0.01)
    assert json.loads((tmp_path / "trace-rank0.json").read_text())["displayTimeUnit"] == "ms"
    assert sorted(read_traces(tmp_path)) == [0, 1]
    png = plot_timeline(tmp_path, steps=1, title="t")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_no_traces_no_picture(tmp_path):
    assert plot_timeline(tmp_path, steps=3) is None
