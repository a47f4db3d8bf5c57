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


def test_trainer_takes_its_default_clipping_and_refuses_what_it_cannot_do(tmp_path):
    import torch
    from transformers import TrainingArguments

    from quietsync.hf_trainer import QuietTrainer

    model = torch.nn.Linear(2, 2)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)  # max_grad_norm 1.0
    with pytest.raises(ValueError, match="strategy must be one of"):
        QuietTrainer(model=model, args=args, strategy="nope")
    assert QuietTrainer(model=model, args=args, strategy="zero1").quiet_precision == "fp32"
    negative = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="max_grad_norm must be >= 0"):
        QuietTrainer(model=model, args=negative, strategy="zero1")
    fp16 = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, fp16=True)
    with pytest.raises(ValueError, match="fp16 is not supported by strategy cdp"):
        QuietTrainer(model=model, args=fp16, strategy="cdp")

def _regression_trainer(cls, tmp_path, args_overrides=None, seen=None, **kwargs):
    import torch
    from transformers import TrainingArguments

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

        def forward(self, x, labels):
            if seen is not None:
                seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
            out = self.net(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    g = torch.Generator().manual_seed(3)
    data = [{"x": torch.randn(6, generator=g), "labels": torch.randn(2, generator=g)} for _ in range(32)]
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=4,
                             per_device_train_batch_size=4, learning_rate=0.1, optim="sgd",
                             lr_scheduler_type="constant", logging_steps=1, max_grad_norm=0.05, save_strategy="no",
                             seed=1, **(args_overrides or {}))
    model = Regression()
    trainer = cls(model=model, args=args, train_dataset=data, **kwargs)
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.timeout(120)
def test_trainer_max_grad_norm_clips_like_the_plain_trainer(tmp_path):
    import torch
    from transformers import Trainer

    from quietsync.hf_trainer import QuietTrainer

    want, want_norms = _regression_trainer(Trainer, tmp_path / "plain")
    got, norms = _regression_trainer(QuietTrainer, tmp_path / "quiet", strategy="zero1")
    assert len(norms) == 4 and all(n > 0.05 for n in want_norms)  # every step clipped
    assert norms == pytest.approx(want_norms, rel=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.timeout(120)
def test_trainer_bf16_runs_the_forward_under_the_strategy_autocast(tmp_path):
    import torch

    from quietsync.hf_trainer import QuietTrainer

    seen: list = []
    params, norms = _regression_trainer(QuietTrainer, tmp_path, {"bf16": True}, seen, strategy="ddp")
    assert seen and all(dtype == torch.bfloat16 for dtype in seen)
    assert len(norms) == 4 and all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in params)
