"""The oracle of the torchft ddp tests: a one-process replay of a run's logged commits, written from the step's
definition (each committed step: AdamW on the mean of the committing replicas' gradients, each the gradient of the
mean loss of its slot's windows, at the logged learning rate), with the windows' token offsets computed from the
data order's own definition -- nothing of quietsync's training code is used."""

from __future__ import annotations

from pathlib import Path

import torch

from .torchft_replicas import merged


def window_starts(tokens: torch.Tensor, seq_len: int, seed: int, windows: list[int]) -> torch.Tensor:
    """Token offsets of windows of the training sequence, from its definition (each epoch a seeded random offset
    and permutation of the non-overlapping windows; window g is window g mod N of epoch g div N)."""
    n = (tokens.numel() - seq_len) // seq_len
    starts = []
    for w in windows:
        g = torch.Generator().manual_seed(seed * 1_000_003 + w // n)
        offset = int(torch.randint(0, seq_len, (1,), generator=g))
        starts.append(offset + int(torch.randperm(n, generator=g)[w % n]) * seq_len)
    return torch.tensor(starts)


def replay(root: Path, steps: list[dict], per_replica: int = 2, seq_len: int = 32,
           counted_in: int | None = None) -> torch.nn.Module:
    """The replayed model after ``steps`` (records holding ``commits``); ``per_replica`` windows a slot, in slot
    order. ``counted_in``: the commit whose mean also counts one replica that contributed nothing (its sum divided
    by one more) -- the wrong average of an asynchronous join."""
    from quietsync.data.shards import open_prepared
    from quietsync.models.causal_lm import build_model

    (folder,) = [p for p in (root / "cache").glob("prepared-*") if p.is_dir()]  # prepared once by the run
    prepared = open_prepared(folder)
    tokens, eos = prepared.train.to_tensor(), prepared.eos
    model = build_model("tiny", prepared.tokenizer().get_vocab_size(), eos, seed=0)
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    decay = [p for p in model.parameters() if p.ndim >= 2 and id(p) not in embeddings]
    rest = [p for p in model.parameters() if p.ndim < 2 or id(p) in embeddings]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.95))
    params = list(model.parameters())
    for record in steps:
        windows = merged(record)["committed"]
        slots = [windows[i:i + per_replica] for i in range(0, len(windows), per_replica)]
        total = [torch.zeros_like(p) for p in params]
        for slot in slots:
            starts = window_starts(tokens, seq_len, 0, slot)
            batch = tokens[starts[:, None] + torch.arange(seq_len)[None, :]]
            grads = torch.autograd.grad(model(input_ids=batch, labels=batch).loss, params)
            torch._foreach_add_(total, grads)
        count = len(slots) + (1 if counted_in in [c["id"] for c in record["commits"]] else 0)
        for p, g in zip(params, total):
            p.grad = g / count
        for group in opt.param_groups:
            group["lr"] = record["lr"]
        opt.step()
    return model
