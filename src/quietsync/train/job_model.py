"""The model of a ``quietsync train`` job: ``--model`` built or loaded, checked and prepared as the flags say
(shared by the trainer's loop and the torchft replica loop)."""

from __future__ import annotations

from typing import Any

import torch

from ..models.causal_lm import (
    build_model,
    compile_blocks,
    config_max_positions,
    enable_activation_checkpointing,
    is_pretrained,
    load_pretrained,
)


def worker_preload(model: str) -> tuple[str, ...]:
    """What the local workers of a job on ``--model model`` load lazily, for the launcher's forkserver to import once
    before it forks them (:func:`quietsync.cli.launch.launch`'s ``preload``): the presets' GPT-Neo, and for a
    pretrained model the model and tokenizer classes of transformers (several CPU-seconds a process, paid once).
    ``torch._dynamo`` too: torch.optim imports it when the first optimizer is built (~2 CPU-seconds a worker)."""
    return ("torch._dynamo", "quietsync.models.gpt_neo", *(("quietsync.models.warm",) if is_pretrained(model) else ()))


def job_model(cfg: Any, vocab_size: int, eos: int, device: torch.device) -> torch.nn.Module:
    """The model of a job on ``device``: ``--model`` (a preset built from ``--seed``, or a pretrained folder), its
    position limit checked against ``--seq-len``, then ``--activation-checkpointing`` and ``--compile`` applied block
    by block (``cfg``: the job's :class:`~quietsync.train.config.TrainConfig`)."""
    if is_pretrained(cfg.model):
        model = load_pretrained(cfg.model, vocab_size, progress=cfg.progress)
    else:
        model = build_model(cfg.model, vocab_size, eos, seed=cfg.seed)
    # a hub model's limit is known only once loaded (the parser checked presets and folders)
    limit = config_max_positions(model.config)
    if limit is not None and cfg.seq_len > limit:
        raise ValueError(f"--seq-len must be <= {limit} for model {cfg.model}, got {cfg.seq_len}")
    model.to(device)
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    if cfg.compile:
        compile_blocks(model)
    return model


def model_vocab_problem(cfg: Any, given: set[str]) -> str | None:
    """A ``--vocab-size`` given with a ``--model`` folder whose ``config.json`` says another (one line), or None:
    the folder's embedding decides the vocabulary, and the flag was silently ignored (yet recorded in summary.json),
    as a prepared ``--dataset`` refuses it."""
    import json
    from pathlib import Path

    config = Path(cfg.model) / "config.json"
    if "vocab_size" not in given or not is_pretrained(cfg.model) or not config.is_file():
        return None
    try:
        theirs = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None  # loading the model says what is wrong with it
    if isinstance(theirs, int) and theirs != cfg.vocab_size:
        return (f"--vocab-size {cfg.vocab_size} differs from the {theirs} of --model {cfg.model} (its config.json): "
                f"leave --vocab-size out")
    return None


__all__ = ["job_model", "model_vocab_problem", "worker_preload"]
