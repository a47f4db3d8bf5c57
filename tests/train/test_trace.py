"""--trace and --profile-steps: the merged Chrome trace, async comm slices, the timeline picture, and
torch.profiler with quietsync's record_function labels."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from quietsync.events import EventRecorder, Span, label
from quietsync.train.profile import StepProfiler, parse_profile_steps
from quietsync.train.trace import (
    ON_WIRE,
    QUEUED,
    TRACE_FILE,
    merge_traces,
    plot_timeline,
    read_traces,
    trace_events,
)

from ._run import refused

pytestmark = pytest.mark.timeout(240)

SPANS = [
    Span("compute", "micro_batch", 1.0, 1.5),
    Span("comm", "ddp_bucket", 1.2, 1.4, {"group": "world"}, t_wire=1.3),  # queued 0.1 s, on the wire 0.1 s
    Span("comm", "ddp_bucket", 1.25, 1.6, {"group": "world"}, t_wire=1.4),  # overlaps the first, no nesting
    Span("comm", "all_gather/params", 1.6, 1.7),  # no link emulation: no children
    Span("idle", "wait", 1.5, 1.6),
]


def _balanced(events):
    """``{(pid, id): [names opened, in order]}``, asserting every async begin has its end, properly nested."""
    stacks, seen = {}, {}
    for e in sorted((e for e in events if e["ph"] in "be"), key=lambda e: e["ts"]):  # stable: file order on ties
        key = (e["pid"], e["id"])
        stack = stacks.setdefault(key, [])
        if e["ph"] == "b":
            stack.append(e["name"])
            seen.setdefault(key, []).append(e["name"])
        else:
            assert stack and stack.pop() == e["name"], (key, e)
    assert all(not s for s in stacks.values())
    return seen


def test_trace_events_async_comm_slices():
    events = trace_events(SPANS, rank=1, clock_offset=1000.0)
    xs = [e for e in events if e["ph"] == "X"]
    assert [(e["cat"], e["tid"], e["pid"]) for e in xs] == [("compute", 0, 1), ("idle", 2, 1)]
    assert xs[0]["ts"] == pytest.approx(1001.0e6) and xs[0]["dur"] == pytest.approx(0.5e6)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
    assert names == {"worker 1", "compute", "comm", "idle"}
    opened = _balanced(events)
    assert sorted(opened.values()) == [["all_gather/params"], ["ddp_bucket", QUEUED, ON_WIRE],
                                       ["ddp_bucket", QUEUED, ON_WIRE]]
    first = next(e for e in events if e["ph"] == "b" and e["name"] == "ddp_bucket")
    assert first["cat"] == "comm" and first["args"]["group"] == "world"
    assert first["args"]["queued_ms"] == pytest.approx(100.0) and first["args"]["wire_ms"] == pytest.approx(100.0)
    assert SPANS[1].queued == pytest.approx(0.1) and SPANS[3].queued == 0.0


def test_merged_file_and_timeline(tmp_path):
    merged = merge_traces([trace_events(SPANS, r, 1000.0 + r * 0.01) for r in (0, 1)])
    ids = [e["id"] for e in merged["traceEvents"] if e["ph"] == "b" and e["name"] not in (QUEUED, ON_WIRE)]
    assert len(ids) == len(set(ids)) == 6  # unique across workers
    (tmp_path / TRACE_FILE).write_text(json.dumps(merged))
    traces = read_traces(tmp_path)
    assert sorted(traces) == [0, 1]
    comm = sorted(e["dur"] for e in traces[1] if e["cat"] == "comm")
    assert comm == pytest.approx([0.1e6, 0.2e6, 0.35e6])
    png = plot_timeline(tmp_path, steps=1, title="t")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_no_traces_no_picture(tmp_path):
    assert read_traces(tmp_path) == {}
    assert plot_timeline(tmp_path, steps=3) is None


def test_recorder_device_times_resolve_from_events():
    class FakeEvent:
        def synchronize(self) -> None:
            pass

        def elapsed_time(self, other) -> float:
            return 2.5  # milliseconds, as torch.cuda.Event reports

    rec = EventRecorder()
    rec.add("comm", "x", 0.0, 1.0, t_wire=0.5, device_events=(FakeEvent(), FakeEvent()), group="world")
    assert rec.spans()[0].device_s is None
    assert rec.resolve_device_times() == 1 and rec.resolve_device_times() == 0
    span = rec.spans()[0]
    assert span.device_s == pytest.approx(0.0025) and span.t_wire == 0.5 and span.meta == {"group": "world"}


def test_labels_only_while_profiling(tmp_path):
    assert type(label("quietsync/x")).__name__ == "nullcontext"
    prof = StepProfiler("1:1", tmp_path, 0, torch.device("cpu"))
    prof.before_micro_batch(0)
    with label("quietsync/inside"):
        torch.ones(4).sum()
    prof.after_commit(1)
    assert prof.close() is None  # already written by after_commit
    assert "quietsync/inside" in (tmp_path / "profile-rank0.json").read_text()


def test_profile_steps_spelling(monkeypatch, capsys):
    assert parse_profile_steps("2:3") == (2, 3)
    for bad in ("3", "0:2", "3:2", "a:b"):
        with pytest.raises(ValueError, match="profile_steps must look like A:B"):
            parse_profile_steps(bad)
    line = refused(monkeypatch, capsys, "--profile-steps", "2:1")
    assert "--profile-steps" in line
    line = refused(monkeypatch, capsys, "--max-steps", "3", "--profile-steps", "2:4")
    assert "--profile-steps must end by" in line


def test_two_workers_merged_trace_and_profile(finished_ddp_run):
    """The shared finished run (tests/train/conftest.py): ddp on 2 workers, --trace, links on both groups,
    --profile-steps 2:2."""
    out = finished_ddp_run
    assert not list(out.glob("trace-rank*.json"))  # one merged file, no per-worker ones
    events = json.loads((out / TRACE_FILE).read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    workers = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert workers == {"worker 0", "worker 1"}
    opened = _balanced(events)
    comm = [e for e in events if e["ph"] == "b" and e["name"] not in (QUEUED, ON_WIRE)]
    assert comm and all(e["cat"] == "comm" for e in comm)
    assert {e["pid"] for e in comm} == {0, 1}
    assert Counter(n for names in opened.values() for n in names)[ON_WIRE] == len(comm)  # all emulated
    ends = {(e["pid"], e["id"]): e["ts"] for e in events if e["ph"] == "e" and e["name"] not in (QUEUED, ON_WIRE)}
    for e in comm:
        total_ms = (ends[(e["pid"], e["id"])] - e["ts"]) / 1e3
        assert 0 <= e["args"]["queued_ms"] <= total_ms + 1e-6
        assert e["args"]["wire_ms"] == pytest.approx(total_ms - e["args"]["queued_ms"], abs=1e-3)
    assert {"compute", "idle"} <= {e["cat"] for e in events if e["ph"] == "X"}
    for rank in (0, 1):
        profile = (out / f"profile-rank{rank}.json").read_text()
        json.loads(profile)
        for name in ("quietsync/step", "quietsync/forward", "quietsync/backward", "quietsync/comm/all_reduce"):
            assert name in profile, (rank, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_give_device_times():
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    x = torch.randn(2048, 2048, device="cuda")
    start.record()
    for _ in range(10):
        x = x @ x / 2048
    end.record()
    rec = EventRecorder()
    rec.add("comm", "matmuls", 0.0, 1.0, device_events=(start, end))
    assert rec.resolve_device_times() == 1
    assert 0 < rec.spans()[0].device_s < 10
    event = trace_events(rec.spans(), 0, 0.0)
    assert next(e for e in event if e["ph"] == "b")["args"]["device_ms"] > 0
