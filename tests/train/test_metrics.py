"""Metrics files, summary table and loss plot."""

from __future__ import annotations

import json

import pytest

from quietsync.train.metrics import (
    EVAL_FIELDS,
    STEP_FIELDS,
    MetricsWriter,
    format_summary,
    read_jsonl,
    write_summary,
)
from quietsync.train.plots import knob_changes, loss_curves, plot_loss

pytestmark = pytest.mark.timeout(60)


def step_record(step: int, rank: int, loss: float) -> dict:
    return {
        "step": step, "rank": rank, "loss": loss, "lr": 1e-3, "tokens": 100, "tokens_total": 100 * step,
        "micro_batches": 1, "compute_s": 0.1, "comm_s": 0.01, "idle_s": 0.0, "bytes_sent": 10,
        "bytes_recv": 10, "bytes_by_group": {"world": {"sent": 10, "recv": 10}}, "slow_sleep_s": 0.0,
        "time_s": 0.1 * step,
    }


def test_writer_schema_and_resume_truncation(tmp_path):
    with MetricsWriter(tmp_path, 1) as w:
        w.eval(0, 8.0, 0, 0.1, 0.0)
        for s in range(1, 6):
            w.step(step_record(s, 1, 8.0 - s))
        w.eval(5, 3.0, 500, 0.1, 0.5)
        with pytest.raises(ValueError, match="lacks"):
            w.step({"step": 6})
    rows = read_jsonl(tmp_path / "metrics-rank1.jsonl")
    assert [r.get("event") for r in rows] == ["eval", None, None, None, None, None, "eval"]
    assert set(EVAL_FIELDS) <= set(rows[0]) and rows[0]["perplexity"] == pytest.approx(2980.96, rel=1e-3)
    assert all(set(STEP_FIELDS) <= set(r) for r in rows[1:6])
    with MetricsWriter(tmp_path, 1, resume_step=3) as w:
        assert [r["step"] for r in w.kept] == [0, 1, 2, 3]
        w.step(step_record(4, 1, 1.0))
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics-rank1.jsonl")] == [0, 1, 2, 3, 4]
    with MetricsWriter(tmp_path, 1):  # a fresh run starts empty
        pass
    assert read_jsonl(tmp_path / "metrics-rank1.jsonl") == []


def test_extra_with_tensors_is_written_as_json(tmp_path):
    import numpy as np
    import torch

    record = step_record(1, 0, 1.0)
    record["extra"] = {"per_worker": torch.tensor([2, 3]), "ratio": np.float32(0.5), "stage": (1, 2)}
    with MetricsWriter(tmp_path, 0) as w:
        w.step(record)
    assert read_jsonl(tmp_path / "metrics-rank0.jsonl")[0]["extra"] == {
        "per_worker": [2, 3], "ratio": 0.5, "stage": [1, 2]}


def test_torn_last_line_is_skipped(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n{"step": 2, "lo')
    assert read_jsonl(p) == [{"step": 1}]


def test_append_keeps_the_file_as_it_is_and_writes_after_it(tmp_path):
    """A replica restarted under --fault-tolerance torchft continues its records without rewriting them (its
    peers wait for it); a record torn by the kill stays unreadable on its own line, the next ones are whole."""
    with MetricsWriter(tmp_path, 2) as w:
        for s in range(1, 4):
            w.step(step_record(s, 2, 1.0))
    path = tmp_path / "metrics-rank2.jsonl"
    before = path.read_bytes()
    with MetricsWriter(tmp_path, 2, append=True) as w:
        assert w.kept == []  # not read
        w.step(step_record(4, 2, 1.0))
    assert path.read_bytes().startswith(before)
    with open(path, "a") as f:
        f.write('{"step": 5, "ran')  # killed mid-line
    with MetricsWriter(tmp_path, 2, append=True) as w:
        w.step(step_record(6, 2, 1.0))
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 6]
    with MetricsWriter(tmp_path / "fresh", 0, append=True) as w:  # no file yet: it starts one
        w.step(step_record(1, 0, 1.0))
    assert [r["step"] for r in read_jsonl(tmp_path / "fresh" / "metrics-rank0.jsonl")] == [1]
    with pytest.raises(ValueError, match="append"):
        MetricsWriter(tmp_path, 2, resume_step=3, append=True)


def test_summary_file_and_table(tmp_path):
    summary = {
        "strategy": "zero1", "world_size": 2, "nodes": 2, "model": "tiny", "parameters": 950_000, "steps": 10,
        "micro_batches": 20, "tokens": 20_480, "wall_s": 12.5, "setup_s": 3.0, "tokens_per_s": 1638.4,
        "first_eval_loss": 8.3, "last_eval_loss": 6.1, "bytes_sent": 8_000_000, "bytes_recv": 8_000_000,
        "bytes_by_group": {"world": {"sent": 8_000_000, "recv": 8_000_000}}, "compute_s": 20.0, "comm_s": 2.0,
        "idle_s": 2.5, "compute_fraction": 20 / 22.5, "bytes_sent_per_step": 700_000,
    }
    path = write_summary(tmp_path, summary)
    assert json.loads(path.read_text())["last_eval_loss"] == 6.1
    table = format_summary(summary)
    assert "8.300 -> 6.100" in table and "zero1" in table and "88.9%" in table and "bytes world" in table
    assert "0.70 MB (all workers)" in table
    assert "--adapt" not in table  # a run without changes lists none

    changes = [{"step": 16 * i, "knob": "topk", "old": 2 ** (7 - i), "new": 2 ** (6 - i)} for i in range(1, 7)]
    table = format_summary({**summary, "adapt": changes})
    rows = dict(line.split(" | ", 1) for line in table.splitlines() if " | " in line)
    label = "--adapt topk".ljust(len(next(iter(rows))))
    assert rows[label] == "64 -> 32 (step 16), 32 -> 16 (step 32), 16 -> 8 (step 48), 8 -> 4 (step 64), and 2 more"
    table = format_summary({**summary, "adapt": [{**changes[0], "knob": "cap"}, changes[1]]})
    assert "--adapt changes " in table and "| cap 64 -> 32 (step 16), topk 32 -> 16 (step 32)\n" in table


def test_loss_curves_and_plot(tmp_path):
    for rank in (0, 1):
        with MetricsWriter(tmp_path, rank) as w:
            w.eval(0, 8.0 + rank, 0, 0.1, 0.0)
            for s in range(1, 4):
                w.step(step_record(s, rank, 5.0 + rank))
            w.eval(3, 4.0 + rank, 300, 0.1, 0.3)
    c = loss_curves(tmp_path)
    assert c["step"] == [1.0, 2.0, 3.0] and c["loss"] == [5.5, 5.5, 5.5]
    assert c["tokens"] == [200.0, 400.0, 600.0]  # summed over workers
    assert c["eval_step"] == [0.0, 3.0] and c["eval_loss"] == [8.0, 4.0]  # rank 0's evaluation
    assert c["eval_tokens"] == [0.0, 600.0]
    assert loss_curves(tmp_path, world_size=4)["tokens"] == [400.0, 800.0, 1200.0]
    png = plot_loss(tmp_path, title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_non_finite_numbers_are_written_as_strict_json_null(tmp_path):
    import json
    import math

    from quietsync.train.metrics import STEP_FIELDS, MetricsWriter, metrics_path, write_summary

    def strict(text):
        return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))

    path = write_summary(tmp_path, {"last_eval_loss": math.nan, "eval": [{"loss": math.inf}], "steps": 2})
    assert strict(path.read_text()) == {"last_eval_loss": None, "eval": [{"loss": None}], "steps": 2}
    with MetricsWriter(tmp_path, 0, None) as w:
        w.step({**{k: 0 for k in STEP_FIELDS}, "step": 1, "loss": float("nan"), "extra": {"x": -math.inf}})
    (line,) = metrics_path(tmp_path, 0).read_text().splitlines()
    assert strict(line)["loss"] is None and strict(line)["extra"] == {"x": None}
    # plain json.dumps would have written the invalid token NaN: the test can fail
    assert "NaN" in json.dumps({"loss": math.nan})


def test_adapt_changes_are_read_from_the_step_records_and_drawn(tmp_path):
    change = {"step": 2, "knob": "sync_every", "old": 16, "new": 128, "bandwidth_mbit": 10.0, "step_s": 0.1,
              "share": 0.05, "why": "10 Mbit/s ..."}

    def write(with_change: bool) -> None:
        for rank in (0, 1):
            (tmp_path / f"metrics-rank{rank}.jsonl").unlink(missing_ok=True)
            with MetricsWriter(tmp_path, rank) as w:
                for s in range(1, 4):
                    rec = step_record(s, rank, 5.0)
                    if s == 2 and with_change:
                        rec["extra"] = {"synced": True, "adapt": change}
                    w.step(rec)

    write(True)
    assert knob_changes(tmp_path) == [change]
    drawn = plot_loss(tmp_path).read_bytes()
    write(False)
    assert knob_changes(tmp_path) == []
    plain = plot_loss(tmp_path).read_bytes()
    assert drawn[:8] == plain[:8] == b"\x89PNG\r\n\x1a\n" and drawn != plain  # the change's line is on the plot


@pytest.mark.timeout(120)
def test_a_run_says_each_knob_change_of_adapt_as_it_happens_and_lists_it_in_its_summary(tmp_path):
    from ._run import small_job, train

    out = tmp_path / "run"
    # 8 Mbit/s: at the first decision k = 16's exchange takes ~10% of the step, far over the 1% allowed: k = 4
    run = train(*small_job(tmp_path), "--strategy", "demo", "--topk", "16", "--adapt", "--adapt-every", "1",
                "--adapt-topk", "16,4", "--adapt-overhead", "0.01", "--link", "inter=8mbit", "--max-steps", "2",
                "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    change = json.loads((out / "summary.json").read_text())["adapt"]
    assert change == [{"step": 1, "knob": "topk", "old": 16, "new": 4}]
    assert "step      1  --adapt: topk 16 -> 4; " in run.stdout  # and why, in the controller's words
    assert "| 16 -> 4 (step 1)" in run.stdout
