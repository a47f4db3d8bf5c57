"""A 🤗 ``transformers.Trainer`` run of a tiny causal LM through a quietsync strategy.

The only quietsync-specific line: ``QuietTrainer`` in place of ``Trainer`` with ``strategy=...``; the Trainer's
own clipping (``max_grad_norm``, 1.0 by default) and ``bf16``/``fp16`` go to the strategy. Run::

    torchrun --nproc_per_node 2 examples/trainer_train.py --strategy zero1
    accelerate launch --multi_gpu --num_processes 2 examples/trainer_train.py --strategy ddp --accumulation 2

``--out FILE`` appends one JSON line per rank (for the tests).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import quietsync
from quietsync.hf_trainer import QuietTrainer


def corpus_bytes() -> bytes:
    """Training text as bytes: the embedded KJV corpus when installed, else a filler."""
    try:
        from quietsync.train.corpus import kjv_chapters

        return "".join(kjv_chapters()[:40]).encode()
    except (ImportError, FileNotFoundError):
        return (" ".join(f"line {i} of a small offline corpus about gradients and networks." for i in range(4000))).encode()


def byte_windows(data: bytes, seq_len: int, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` random ``seq_len``-byte training examples (the byte is the token)."""
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    starts = torch.randint(0, len(ids) - seq_len, (count,), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": ids[s : s + seq_len], "labels": ids[s : s + seq_len]} for s in starts.tolist()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="zero1", choices=quietsync.available())
    parser.add_argument("--steps", type=int, default=20, help="Trainer steps (max_steps)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="the Trainer's max_grad_norm (0: off)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--out", default=None, help="append one JSON line per rank with the outcome")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0))
    train = byte_windows(corpus_bytes(), args.seq_len, count=args.steps * args.accumulation * args.batch_size * 8)
    with tempfile.TemporaryDirectory() as out_dir:
        training_args = TrainingArguments(
            output_dir=out_dir, max_steps=args.steps, learning_rate=args.lr, per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.accumulation, lr_scheduler_type="cosine", warmup_steps=2,
            max_grad_norm=args.max_grad_norm, bf16=args.precision == "bf16", fp16=args.precision == "fp16",
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
        )
        trainer = QuietTrainer(model=model, args=training_args, train_dataset=train, strategy=args.strategy)
        result = trainer.train()
        optimizer = trainer.quiet_optimizer
        with optimizer.committed_params() as committed:
            flat = torch.cat([p.detach().float().flatten() for p in trainer.accelerator.unwrap_model(committed).parameters()])
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        sent = optimizer.last_step_metrics().bytes_sent
        if trainer.is_world_process_zero():
            print(f"{args.strategy}: {optimizer.steps} committed steps, final loss {losses[-1]:.4f}, "
                  f"last step sent {sent / 1e3:.1f} kB")
        if args.out:
            record = {"rank": trainer.args.process_index, "world": trainer.args.world_size, "steps": optimizer.steps,
                      "global_step": trainer.state.global_step, "train_loss": result.training_loss,
                      "finite": all(math.isfinite(x) for x in losses), "bytes_sent": sent,
                      "checksum": hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()}
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        optimizer.close()


if __name__ == "__main__":
    main()
