"""quietsync.hf_trainer: a transformers.Trainer run through a strategy on 2 torchrun workers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from .distributed import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def torchrun_example(strategy: str, out: Path, *extra: str, timeout: float = 120.0) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}  # gloo workers on CPU, also on a GPU machine (its launcher would pick NCCL)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "examples" / "trainer_train.py"), "--strategy", strategy, "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["zero1", "ddp"])
def test_trainer_under_torchrun_keeps_replicas_identical(strategy, tmp_path):
    records = torchrun_example(strategy, tmp_path / "out.jsonl", "--steps", "3", "--accumulation", "2")
    assert [r["rank"] for r in records] == [0, 1] and all(r["world"] == 2 for r in records)
    assert records[0]["checksum"] == records[1]["checksum"]
    assert all(r["steps"] == 3 and r["global_step"] == 3 for r in records)  # one commit per Trainer step
    assert all(r["finite"] and math.isfinite(r["train_loss"]) and r["bytes_sent"] > 0 for r in records)


def test_trainer_refuses_gradient_clipping_and_unknown_strategies(tmp_path):
    import torch
    from transformers import TrainingArguments

    from quietsync.hf_trainer import QuietTrainer

    model = torch.nn.Linear(2, 2)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="strategy must be one of"):
        QuietTrainer(model=model, args=args, strategy="nope")
    clipping = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)  # default 1.0
    with pytest.raises(ValueError, match="max_grad_norm"):
        QuietTrainer(model=model, args=clipping, strategy="zero1")
