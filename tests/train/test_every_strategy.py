"""The training loop runs every registered strategy (world of one, a few steps), logs its steps and saves a
checkpoint where it can (which the non-finite policy checks: no false alarm on any strategy's state)."""

from __future__ import annotations

import pytest

from quietsync.strategies import available, get
from quietsync.train.args import parse_train_args
from quietsync.train.checkpoint import latest_checkpoint
from quietsync.train.loop import run
from quietsync.train.metrics import STEP_FIELDS, read_jsonl

from .conftest import synthetic_text

# Strategies whose committed parameters only move at a sync (localsgd, diloco: the globally agreed θ) sync
# within the 3 steps, so the evaluation after step 3 sees trained parameters.
STRATEGY_FLAGS = {"localsgd": ["--sync-every", "3"], "diloco": ["--sync-every", "3"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", available())
def test_loop_runs_strategy(strategy, tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    data = tmp_path / "text.txt"
    data.write_text(synthetic_text(1500))
    cfg, scfg, nodes = parse_train_args([
        "--strategy", strategy, "--nproc", "1", "--model", "tiny", "--max-steps", "3", "--micro-batch-size", "2",
        "--seq-len", "32", "--vocab-size", "300", "--dataset", str(data), "--cache-dir", str(tmp_path / "c"),
        "--out", str(tmp_path / "out"), "--eval-windows", "4", "--no-progress", "--no-plot",
        *STRATEGY_FLAGS.get(strategy, []), *(["--save-every", "3"] if get(strategy)[0].resumable else []),
    ])
    summary = run(cfg, scfg, nodes)
    assert summary["steps"] == 3 and summary["strategy"] == strategy
    assert summary["last_eval_loss"] < summary["first_eval_loss"]
    steps = [r for r in read_jsonl(tmp_path / "out" / "metrics-rank0.jsonl") if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(set(STEP_FIELDS) <= set(r) and r["micro_batches"] >= 1 for r in steps)
    # all micro-batches computed; overlapping strategies may have begun the next round
    assert summary["micro_batches"] >= sum(r["micro_batches"] for r in steps)
    if get(strategy)[0].resumable:
        assert latest_checkpoint(tmp_path / "out", [0]).name == "step-0000003"
