"""quietsync.hf_trainer: a transformers.Trainer run through a strategy on 2 torchrun workers."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_trainer_with_gradient_accumulation_under_torchrun_keeps_replicas_identical(tmp_path):
    """gradient_accumulation_steps=2 becomes the strategy's accumulation: one commit per Trainer step (one
    launch, two strategies; every strategy in tests/test_front_doors.py)."""
    from .test_front_doors import torchrun_trainer

    records = torchrun_trainer(tmp_path / "out.jsonl", "--strategy", "zero1,ddp", "--steps", "3",
                               "--accumulation", "2")
    for name, (r0, r1) in records.items():
        assert r0["world"] == 2 and r0["checksum"] == r1["checksum"], name
        assert r0["steps"] == 3 and r0["global_step"] == 3, name  # one commit per Trainer step
        assert r0["finite"] and math.isfinite(r0["train_loss"]) and r0["bytes_sent"] > 0, name


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
