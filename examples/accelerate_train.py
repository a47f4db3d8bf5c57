"""An ordinary 🤗 Accelerate training loop of a tiny causal LM, with a quietsync strategy in place of DDP.

The quietsync-specific lines are the ``QuietAccelerator(strategy=...)`` construction and ``optimizer.finish()`` at
the end; everything else is the usual Accelerate idiom (prepare, accumulate, backward, optimizer/scheduler step).
A strategy that schedules forward and backward itself (``cdp``) is fed with
``accelerator.forward_backward(batch, loss_fn)`` instead of ``loss = ...; accelerator.backward(loss)``
(``--forward-backward`` uses that call for every strategy). Run::

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --strategy zero1
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --strategy acco --steps 20
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --strategy cdp --steps 4
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --strategy diloco \
        --strategy-config '{"sync_every": 4}'

(on a CPU-only machine ``--multi_gpu`` starts gloo workers; ``accelerate launch --mixed_precision bf16`` trains in
bf16, and the loop clips with ``accelerator.clip_grad_norm_`` as Accelerate's own examples do). ``--strategy``
takes any registered name
(``quietsync.strategies.available()``), several separated by commas, or ``all`` (each trained in turn, from the
same initial model, in the same processes). ``--out FILE`` appends one JSON line per rank and strategy (for the
tests).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, get_cosine_schedule_with_warmup

import quietsync
from quietsync.accelerate import QuietAccelerator


def corpus_bytes() -> bytes:
    """Training text as bytes (the byte is the token): the embedded KJV corpus when installed, else a filler."""
    try:
        from quietsync.data.corpus import kjv_chapters

        return "".join(kjv_chapters()[:40]).encode()
    except (ImportError, FileNotFoundError):
        return (" ".join(f"line {i} of a small offline corpus about gradients and networks."
                         for i in range(4000))).encode()


class ByteWindows(torch.utils.data.IterableDataset):
    """An endless stream of random ``seq_len + 1``-byte windows (seeded: every process sees the same stream,
    Accelerate hands each process its own batches of it)."""

    def __init__(self, data: bytes, seq_len: int, seed: int = 0) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len, self.seed = seq_len, seed

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed)
        while True:
            i = int(torch.randint(0, len(self.data) - self.seq_len - 1, (1,), generator=gen))
            window = self.data[i : i + self.seq_len + 1]
            yield {"input_ids": window[:-1], "labels": window[:-1]}


def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The micro-batch's loss (``accelerator.forward_backward``'s loss function: it calls ``model`` once)."""
    return model(**batch).loss


def train(args: argparse.Namespace, strategy: str, last: bool) -> dict:
    """One run of ``strategy``: ``args.steps`` committed optimizer steps; returns this rank's outcome."""
    accelerator = QuietAccelerator(strategy=strategy, strategy_config=args.strategy_config,
                                   gradient_accumulation_steps=args.accumulation)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    initial = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    optim_cls = torch.optim.SGD if args.sgd else torch.optim.AdamW
    optimizer = optim_cls(model.parameters(), lr=args.lr)
    # Accelerate steps a scheduler once per process per optimizer step, hence the factor.
    scheduler = get_cosine_schedule_with_warmup(optimizer, 2 * accelerator.num_processes,
                                                args.steps * accelerator.num_processes)
    loader = torch.utils.data.DataLoader(ByteWindows(corpus_bytes(), args.seq_len), batch_size=args.batch_size)

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    feed = args.forward_backward or optimizer.owns_schedule  # cdp: the strategy runs forward and backward

    bytes_sent, losses, lrs, micro_batches = 0, [], [], 0
    for batch in loader:
        with accelerator.accumulate(model):
            if feed:
                loss = accelerator.forward_backward(batch, loss_fn)  # None while cdp's pipeline fills
            else:
                loss = model(**batch).loss
                accelerator.backward(loss)
            if args.max_grad_norm and accelerator.sync_gradients:  # clips the gradient the strategy commits
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        micro_batches += 1
        if loss is not None:
            losses.append(loss.item())
        if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:  # a committed step
            m = optimizer.last_step_metrics()
            bytes_sent += m.bytes_sent
            lrs.append(m.lr)
            accelerator.print(f"{strategy} step {m.step:3d}  loss {losses[-1]:.4f}  lr {m.lr:.2e}  "
                              f"sent {m.bytes_sent / 1e3:.1f} kB  micro-batches {m.micro_batches}")
        if optimizer.steps + optimizer.steps_in_flight >= args.steps:  # counting an update finish() commits
            break

    added = optimizer.finish()  # every process: the last round synced (localsgd, diloco) or drained (acco, ...)
    if added:
        lrs.append(optimizer.last_step_metrics().lr)
    with optimizer.committed_params() as committed:  # evaluation sees θ, not a strategy's estimate
        flat = torch.cat([p.detach().float().flatten() for p in accelerator.unwrap_model(committed).parameters()])
        checksum = hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()
        param_sum = float(flat.double().sum())
    accelerator.print(f"{strategy} done: {optimizer.steps} steps, {bytes_sent / 1e6:.3f} MB sent by rank 0")
    record = {"rank": accelerator.process_index, "world": accelerator.num_processes, "strategy": strategy,
              "steps": optimizer.steps, "finish_steps": added, "micro_batches": micro_batches,
              "bytes_sent": bytes_sent, "final_loss": losses[-1] if losses else None, "lrs": lrs,
              "checksum": checksum, "param_sum": param_sum, "moved": float((flat.cpu() - initial).abs().max()),
              "pid": os.getpid()}
    if last:
        accelerator.end_training()  # finish (done already) and close; Accelerate's end destroys the process group
    else:
        optimizer.close()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="zero1",
                        help=f"one of {', '.join(quietsync.available())}, several separated by commas, or all")
    parser.add_argument("--steps", type=int, default=20, help="committed optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--sgd", action="store_true", help="torch.optim.SGD instead of AdamW")
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="accelerator.clip_grad_norm_ before each step (0: no clipping)")
    parser.add_argument("--forward-backward", action="store_true",
                        help="feed every strategy with accelerator.forward_backward (cdp always is)")
    parser.add_argument("--strategy-config", type=json.loads, default=None,
                        help='the strategy\'s knobs as JSON, e.g. \'{"sync_every": 16}\' for diloco')
    parser.add_argument("--out", default=None, help="append one JSON line per rank and strategy with the outcome")
    args = parser.parse_args()
    names = quietsync.available() if args.strategy == "all" else args.strategy.split(",")
    unknown = [n for n in names if n not in quietsync.available()]
    if unknown:
        parser.error(f"--strategy must name registered strategies ({', '.join(quietsync.available())}), got {unknown}")

    for i, name in enumerate(names):
        record = train(args, name, last=i == len(names) - 1)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
