"""End to end: `quietsync train` on 2 local workers (embedded corpus, tiny model), and exact resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quietsync.train.checkpoint import latest_checkpoint, resolve_resume
from quietsync.train.metrics import EVAL_FIELDS, STEP_FIELDS, SUMMARY_FIELDS, read_jsonl

from ._run import train
from .conftest import synthetic_text

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.long
@pytest.mark.timeout(300)
def test_cli_two_workers_smoke(tmp_path):
    """The command as a user runs it (the launcher's own workers), end to end; then the same job through the
    tests' forked harness (tests/train/_run.train, used by the other whole-run tests) gives the same run, step for
    step."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env.update(OFFLINE)
    flags = [
        "--nproc", "2", "--model", "tiny",
        "--max-steps", "4", "--eval-every", "2", "--eval-windows", "8", "--micro-batch-size", "2",
        "--seq-len", "32", "--vocab-size", "512", "--cache-dir", str(tmp_path / "cache"),
        "--link", "inter=1gbit,1ms", "--slow-worker", "1:1.5", "--no-progress", "--trace",
    ]
    cmd = [sys.executable, "-m", "quietsync", "train", *flags, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval loss first -> last" in proc.stdout and proc.stdout.count("strategy ") == 2  # rank 0 only
    assert sorted(p.name for p in out.iterdir()) == [
        "loss.png", "metrics-rank0.jsonl", "metrics-rank1.jsonl", "model", "summary.json", "timeline.png",
        "trace.json"]
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert {"compute", "comm"} <= {e.get("cat") for e in events if e.get("pid") == 1}
    for rank in (0, 1):
        rows = read_jsonl(out / f"metrics-rank{rank}.jsonl")
        steps = [r for r in rows if "event" not in r]
        evals = [r for r in rows if r.get("event") == "eval"]
        assert [r["step"] for r in steps] == [1, 2, 3, 4]
        assert [r["step"] for r in evals] == [0, 2, 4]
        for r in steps:
            assert set(STEP_FIELDS) <= set(r) and r["rank"] == rank
            assert r["micro_batches"] == 1 and r["tokens"] == 2 * 32
            assert r["bytes_sent"] > 0 and r["bytes_sent"] == sum(g["sent"] for g in r["bytes_by_group"].values())
            assert r["lr"] > 0 and r["loss"] > 0
        assert (steps[-1]["slow_sleep_s"] > 0) == (rank == 1)  # --slow-worker 1:1.5
        assert all(set(EVAL_FIELDS) <= set(e) for e in evals)
    summary = json.loads((out / "summary.json").read_text())
    assert set(SUMMARY_FIELDS) <= set(summary)
    assert summary["strategy"] == "zero1" and summary["world_size"] == 2 and summary["nodes"] == 2
    assert summary["steps"] == 4 and summary["tokens"] == 2 * 4 * 2 * 32
    assert summary["replicas"] == {"checked": True, "differ": []}  # the workers' committed parameters, bit for bit
    assert summary["last_eval_loss"] < summary["first_eval_loss"]
    rank_bytes = sum(r["bytes_sent"] for k in (0, 1) for r in read_jsonl(out / f"metrics-rank{k}.jsonl")
                     if "event" not in r)
    assert summary["bytes_sent"] > rank_bytes  # plus the initial parameter broadcast
    assert summary["bytes_sent_per_step"] * 4 == pytest.approx(rank_bytes)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"

    forked = train(*flags, "--out", str(tmp_path / "forked"))
    assert forked.returncode == 0, forked.stderr[-3000:]
    assert "eval loss first -> last" in forked.stdout and forked.stdout.count("strategy ") == 2
    assert sorted(p.name for p in (tmp_path / "forked").iterdir()) == sorted(p.name for p in out.iterdir())
    keys = ("step", "rank", "loss", "lr", "tokens", "tokens_total", "micro_batches", "bytes_sent", "bytes_recv",
            "bytes_by_group")
    for rank in (0, 1):
        rows = [{k: r.get(k) for k in keys} for r in read_jsonl(out / f"metrics-rank{rank}.jsonl")]
        again = [{k: r.get(k) for k in keys} for r in read_jsonl(tmp_path / "forked" / f"metrics-rank{rank}.jsonl")]
        assert again == rows  # the same losses, bit for bit, and the same bytes
    again = json.loads((tmp_path / "forked" / "summary.json").read_text())
    for k in ("steps", "tokens", "micro_batches", "bytes_sent", "bytes_by_group", "eval", "nodes", "world_size"):
        assert again[k] == summary[k], k


@pytest.mark.timeout(240)
def test_resume_continues_exactly(tmp_path, monkeypatch):
    from quietsync.strategies import get
    from quietsync.train.config import TrainConfig
    from quietsync.train.loop import run

    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    data = tmp_path / "text.txt"
    data.write_text(synthetic_text(3000))
    common = dict(strategy="zero1", nproc=1, model="tiny", max_steps=6, micro_batch_size=2, seq_len=32,
                  vocab_size=300, dataset=str(data), cache_dir=str(tmp_path / "cache"), eval_every=0,
                  eval_windows=4, progress=False, plot=False)
    scfg = get("zero1")[1](accumulation=2)
    full = run(TrainConfig(out=str(tmp_path / "a"), save_every=3, **common), scfg)
    assert full["steps"] == 6
    ckpt = latest_checkpoint(tmp_path / "a", [0])
    assert ckpt is not None and ckpt.name == "step-0000006"
    step3 = resolve_resume(str(tmp_path / "a" / "checkpoints" / "step-0000003"), tmp_path / "a", [0])
    a = read_jsonl(tmp_path / "a" / "metrics-rank0.jsonl")
    # resume into the same folder: the metrics file is cut back to step 3 and continues from there
    resumed = run(TrainConfig(out=str(tmp_path / "a"), resume=str(step3), **common), scfg)
    b = read_jsonl(tmp_path / "a" / "metrics-rank0.jsonl")
    a_steps = [r for r in a if "event" not in r]
    b_steps = [r for r in b if "event" not in r]
    assert [r["step"] for r in b_steps] == [1, 2, 3, 4, 5, 6]
    assert b_steps[:3] == a_steps[:3]  # kept as they were
    assert [r["loss"] for r in b_steps[3:]] == [r["loss"] for r in a_steps[3:]]  # bit-identical continuation
    assert [r["tokens_total"] for r in b_steps] == [r["tokens_total"] for r in a_steps]
    assert b_steps[3]["time_s"] > b_steps[2]["time_s"]  # the clock continues
    assert [r["step"] for r in b if r.get("event") == "eval"] == [0, 6]
    assert resumed["last_eval_loss"] == full["last_eval_loss"]
    assert resumed["first_eval_loss"] == full["first_eval_loss"]
    assert resumed["tokens"] == full["tokens"]
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resolve_resume("latest", tmp_path / "b", [0])
