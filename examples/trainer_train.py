"""A 🤗 ``transformers.Trainer`` run of a tiny causal LM through a quietsync strategy.

The only quietsync-specific line: ``QuietTrainer`` in place of ``Trainer`` with ``strategy=...``; the Trainer's
own clipping (``max_grad_norm``, 1.0 by default) and ``bf16``/``fp16`` go to the strategy. Run::

    torchrun --nproc_per_node 2 examples/trainer_train.py --strategy zero1
    torchrun --nproc_per_node 2 examples/trainer_train.py --strategy cdp --steps 4
    accelerate launch --multi_gpu --num_processes 2 examples/trainer_train.py --strategy ddp --accumulation 2

``--strategy`` takes any registered name, several separated by commas, or ``all`` (each trained in turn, from
the same initial model, in the same processes). ``--out FILE`` appends one JSON line per rank and strategy
(for the tests). ``--stage-cap N`` caps the stages of the strategies that size them as the network allows (acco,
dpu, wp: their ``max_accumulation``), so a short run commits even when the machine is loaded. ``--save-every N``
saves a checkpoint (the model; with ``--save-optimizer`` the strategy's state too) every N Trainer steps and
``--eval-every N`` evaluates every N. ``--stop-at N`` stops after N steps of the ``--steps`` schedule (as an
interrupted run would) and ``--resume`` continues from the last checkpoint in ``--output-dir``::

    torchrun --nproc_per_node 2 examples/trainer_train.py --strategy zero1 --steps 8 --save-every 4 \
        --save-optimizer --output-dir run --stop-at 4
    torchrun --nproc_per_node 2 examples/trainer_train.py --strategy zero1 --steps 8 --save-every 4 \
        --save-optimizer --output-dir run --resume
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import quietsync
from quietsync.hf_trainer import QuietTrainer


def corpus_bytes() -> bytes:
    """Training text as bytes: the embedded KJV corpus when installed, else a filler."""
    try:
        from quietsync.data.corpus import kjv_chapters

        return "".join(kjv_chapters()[:40]).encode()
    except (ImportError, FileNotFoundError):
        return (" ".join(f"line {i} of a small offline corpus about gradients and networks."
                         for i in range(4000))).encode()


def byte_windows(data: bytes, seq_len: int, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` random ``seq_len``-byte training examples (the byte is the token)."""
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    starts = torch.randint(0, len(ids) - seq_len, (count,), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": ids[s : s + seq_len], "labels": ids[s : s + seq_len]} for s in starts.tolist()]


class StopAt(TrainerCallback):
    """Stops training after ``step`` Trainer steps (an interruption that keeps the run's schedule)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


class CommittedSteps(TrainerCallback):
    """Records the lr of every step the strategy committed (the Trainer's own log shows its scheduler's lr at
    every Trainer step, committed or not)."""

    def __init__(self, trainer: QuietTrainer) -> None:
        self.trainer, self.lrs = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        optimizer = self.trainer.quiet_optimizer
        # (after a resume the first step may count a commit made before the checkpoint: no metrics here)
        metrics = None if optimizer is None or optimizer.step_was_skipped else optimizer.last_step_metrics()
        if metrics is not None:
            self.lrs.append(metrics.lr)


def _has_stages(strategy: str) -> bool:
    """Whether the strategy sizes its stages itself (its config has ``max_accumulation``)."""
    return "max_accumulation" in {f.name for f in dataclasses.fields(quietsync.strategies.get(strategy)[1])}


def train(args: argparse.Namespace, strategy: str, train_set: list, out_dir: str) -> dict:
    """One Trainer run of ``strategy``; returns this rank's outcome."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=32, n_layer=2, n_head=2,
                            bos_token_id=0, eos_token_id=0))
    initial = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    training_args = TrainingArguments(
        output_dir=out_dir, max_steps=args.steps, learning_rate=args.lr, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation, lr_scheduler_type="cosine", warmup_steps=args.warmup_steps,
        max_grad_norm=args.max_grad_norm, bf16=args.precision == "bf16", fp16=args.precision == "fp16",
        logging_steps=1, report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
        save_strategy="steps" if args.save_every else "no", save_steps=args.save_every or 500,
        save_only_model=not args.save_optimizer,
        eval_strategy="steps" if args.eval_every else "no", eval_steps=args.eval_every,
    )
    config = {"max_accumulation": args.stage_cap} if args.stage_cap and _has_stages(strategy) else None
    trainer = QuietTrainer(model=model, args=training_args, train_dataset=train_set, strategy=strategy,
                           strategy_config=config, eval_dataset=train_set[:8] if args.eval_every else None)
    committed = CommittedSteps(trainer)
    trainer.add_callback(committed)
    if args.stop_at:
        trainer.add_callback(StopAt(args.stop_at))
    # ends with the strategy finished: the last round synced or drained
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    optimizer = trainer.quiet_optimizer
    if optimizer.steps > len(committed.lrs):  # the step finish() committed (dpu, wp, acco: the update in flight)
        committed.lrs.append(optimizer.last_step_metrics().lr)
    with optimizer.committed_params() as model_now:
        flat = torch.cat([p.detach().float().flatten()
                          for p in trainer.accelerator.unwrap_model(model_now).parameters()])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = optimizer.last_step_metrics()  # None: no step committed
    if trainer.is_world_process_zero():
        sent = f"last step sent {metrics.bytes_sent / 1e3:.1f} kB" if metrics else "no step committed"
        print(f"{strategy}: {optimizer.steps} committed steps in {trainer.state.global_step} Trainer steps, "
              f"final loss {losses[-1]:.4f}, {sent}")
    record = {"rank": trainer.args.process_index, "world": trainer.args.world_size, "strategy": strategy,
              "steps": optimizer.steps, "global_step": trainer.state.global_step, "lrs": committed.lrs,
              "train_loss": result.training_loss, "finite": all(math.isfinite(x) for x in losses),
              "bytes_sent": metrics.bytes_sent if metrics else 0, "finished": optimizer.strategy.finished,
              "moved": float((flat.cpu() - initial).abs().max()),
              "evals": sum("eval_loss" in h for h in trainer.state.log_history),
              "checkpoints": sum(name.startswith("checkpoint-") for name in os.listdir(out_dir))
              if os.path.isdir(out_dir) else 0,
              "checksum": hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()}
    optimizer.close()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="zero1",
                        help=f"one of {', '.join(quietsync.available())}, several separated by commas, or all")
    parser.add_argument("--steps", type=int, default=20, help="Trainer steps (max_steps)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=2, help="the Trainer's linear warm-up (from lr 0)")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="the Trainer's max_grad_norm (0: off)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--stage-cap", type=int, default=None,
                        help="at most this many micro-batches per stage for acco, dpu and wp (max_accumulation)")
    parser.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N Trainer steps (0: none)")
    parser.add_argument("--eval-every", type=int, default=0, help="evaluate every N Trainer steps (0: never)")
    parser.add_argument("--save-optimizer", action="store_true",
                        help="checkpoints hold every rank's strategy state too (save_only_model=False), to resume")
    parser.add_argument("--stop-at", type=int, default=0, help="stop after N Trainer steps of the schedule (0: all)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    parser.add_argument("--output-dir", default=None,
                        help="the Trainer's output_dir (a folder per strategy in it); default: a temporary one")
    parser.add_argument("--out", default=None, help="append one JSON line per rank and strategy with the outcome")
    args = parser.parse_args()
    names = quietsync.available() if args.strategy == "all" else args.strategy.split(",")
    unknown = [n for n in names if n not in quietsync.available()]
    if unknown:
        parser.error(f"--strategy must name registered strategies ({', '.join(quietsync.available())}), got {unknown}")
    if args.stage_cap is not None:
        if args.stage_cap < 1:
            parser.error(f"--stage-cap must be an integer >= 1, got {args.stage_cap}")
        if not any(_has_stages(n) for n in names):
            parser.error(f"--stage-cap applies to acco, dpu and wp (their stages); --strategy names none: {names}")

    if args.stop_at > args.steps:
        parser.error(f"--stop-at must be at most --steps ({args.steps}), got {args.stop_at}")
    if args.resume and not args.output_dir:
        parser.error("--resume continues from the checkpoints in --output-dir: name it")
    for flag in ("save_every", "eval_every", "stop_at"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be an integer >= 0, got {getattr(args, flag)}")
    train_set = byte_windows(corpus_bytes(), args.seq_len, count=args.steps * args.accumulation * args.batch_size * 8)
    with tempfile.TemporaryDirectory() as scratch:
        out_dir = args.output_dir or scratch
        for name in names:
            record = train(args, name, train_set, os.path.join(out_dir, name))
            if args.out:
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
