"""quietsync.hf_trainer: a transformers.Trainer run through a strategy on 2 torchrun workers."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


@pytest.mark.long
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
    # cdp's micro-batches are in flight at every step: a checkpoint during training holds the model alone
    with pytest.raises(ValueError, match=r"^strategy cdp keeps micro-batches in flight across steps.*"
                                         r"save_only_model=True"):
        QuietTrainer(model=model, args=args, strategy="cdp")
    # a slow worker takes fewer steps per round: the Trainer's gathers at every step would pair up wrong and hang
    with pytest.raises(ValueError, match=r"^inner_steps='adaptive' gives each worker its own number of inner steps.*"
                                         r"the HF Trainer's gathers\) cannot drive it"):
        QuietTrainer(model=model, args=args, strategy="localsgd", strategy_config={"inner_steps": "adaptive"})
    model_only = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_only_model=True)
    assert QuietTrainer(model=model, args=model_only, strategy="cdp").quiet_strategy == "cdp"
    # last: an fp16 Trainer fixes the process's AcceleratorState at fp16 for every Trainer after it
    fp16 = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, fp16=True)
    with pytest.raises(ValueError, match="fp16 is not supported by strategy cdp"):
        QuietTrainer(model=model, args=fp16, strategy="cdp")


@pytest.mark.timeout(120)
def test_the_trainer_declares_the_collectives_its_loop_runs_between_steps(tmp_path):
    """The Trainer gathers between steps (token counts, the logged loss); QuietTrainer says so to the strategy
    (``Strategy.loop_collectives``), so a drifting worker never waits inside a step for a peer that waits in such a
    gather (tests/strategies/overlap/test_acco.py). A plain ``QuietOptimizer`` declares none."""
    import torch
    from transformers import TrainingArguments

    from quietsync.hf_trainer import QuietTrainer
    from quietsync.quiet_optimizer import QuietOptimizer

    model = torch.nn.Linear(2, 2)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = QuietTrainer(model=model, args=args, strategy="acco")
    trainer.create_optimizer()
    assert trainer.quiet_optimizer is not None and trainer.quiet_optimizer.strategy.loop_collectives
    trainer.quiet_optimizer.strategy.close()
    plain = QuietOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "acco")
    assert not plain.strategy.loop_collectives
    plain.strategy.close()

@pytest.mark.timeout(120)
def test_a_checkpoint_of_another_number_of_processes_is_refused_on_resume_naming_it(tmp_path):
    import torch
    from transformers import TrainingArguments

    from quietsync.hf_trainer import QuietTrainer
    from quietsync.quiet_optimizer import optimizer_file

    model = torch.nn.Linear(2, 2)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = QuietTrainer(model=model, args=args, strategy="zero1")
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    trainer._load_optimizer_and_scheduler(str(checkpoint))  # the model alone (save_only_model): nothing to load
    for rank in range(4):
        torch.save({}, checkpoint / optimizer_file(rank, 4))
    with pytest.raises(ValueError, match=r"holds the quietsync optimizer state of another number of processes "
                                         r"\(quietsync-optimizer-rank0-of-4\.pt, \.\.\.\), this run has 1"):
        trainer._load_optimizer_and_scheduler(str(checkpoint))
    trainer.quiet_optimizer.close()


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
