"""The data of a ``quietsync train`` job: a prepared folder, mapped by every worker.

``--dataset`` is either a prepared folder (``quietsync prepare``'s output, taken as it is) or any input
:mod:`quietsync.data.sources` reads, which is then prepared once into ``--cache-dir`` (``prepared-<key>/``, the key
a digest of the input files' names, sizes and times, the tokenizer and the split): the first process takes the
folder's lock and prepares it — the launcher, before any worker starts, or under torchrun one worker while the
others wait — and later runs reuse it. :func:`open_job_data` then maps its shards (:mod:`quietsync.data.shards`).

With a prepared folder the tokenizer is the folder's. ``--tokenizer`` (or a ``--model`` folder's own tokenizer)
must be the same one (same fingerprint), and the flags that decided the folder (``--vocab-size``,
``--eval-fraction``, ``--text-column``, ``--token-dtype``) are refused when given with another value than the
folder's: :func:`prepared_flag_problem`.

:data:`IN_MEMORY_ENV` set to 1 makes every worker read its splits into memory as int64 instead (what every worker
did before the shards were mapped; for the benchmark that compares the two).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data.cache import DEFAULT_CACHE_DIR, build_in_place
from ..data.prepare import PrepareConfig, plan_request, prepare, request_key
from ..data.shards import (
    INDEX,
    TokenShards,
    data_identity,
    is_prepared,
    open_prepared,
    read_index,
    tokenizer_fingerprints,
)
from .config import TrainConfig

IN_MEMORY_ENV = "QUIETSYNC_DATA_IN_MEMORY"
"""Set to 1: each worker copies its splits into memory as int64 (the path before mapped shards; benchmarks)."""

FIXED_BY_FOLDER = {"vocab_size": "--vocab-size", "eval_fraction": "--eval-fraction", "text_column": "--text-column",
                   "token_dtype": "--token-dtype"}
"""Job fields a prepared folder decided (refused when given with another value)."""


def prepare_config(cfg: TrainConfig, progress: bool = False) -> PrepareConfig:
    """The implicit prepare of a job's ``--dataset``."""
    return PrepareConfig(dataset=cfg.dataset, text_column=cfg.text_column, tokenizer=cfg.tokenizer,
                         vocab_size=cfg.vocab_size, eval_fraction=cfg.eval_fraction, token_dtype=cfg.token_dtype,
                         progress=progress)


def job_folder(cfg: TrainConfig, progress: bool = False) -> Path:
    """The prepared folder of the job: ``--dataset`` itself, or its implicit one in the cache, prepared now (under
    a lock, by one process) unless it is there. ``ValueError`` (one line, naming the flag) for input that cannot
    be prepared."""
    if is_prepared(cfg.dataset):
        return Path(cfg.dataset)
    pcfg = prepare_config(cfg, progress)
    _, _, _, request = plan_request(pcfg)
    root = Path(cfg.cache_dir) if cfg.cache_dir is not None else DEFAULT_CACHE_DIR
    folder = root / f"prepared-{request_key(request)}"

    def build() -> None:
        def say(text: str) -> None:
            print(f"quietsync train: {text}", flush=True)

        say(f"preparing --dataset {cfg.dataset} once into {folder} (later runs reuse it)")
        prepare(pcfg, folder, say=say)

    # the index is written last: it marks a finished prepare
    build_in_place(folder / INDEX, folder.with_name(folder.name + ".lock"), build)
    return folder


@dataclass(frozen=True)
class JobData:
    """A job's tokenizer and mapped splits."""

    folder: Path
    """The prepared folder."""
    tokenizer: Any
    """The ``tokenizers.Tokenizer`` of the ids."""
    eos: int
    """The end-of-text id."""
    train: torch.Tensor | TokenShards
    """Training ids (mapped; in memory under :data:`IN_MEMORY_ENV`)."""
    eval: torch.Tensor | TokenShards
    """Held-out ids."""
    identity: dict[str, Any]
    """What the ids are (:func:`~quietsync.data.shards.data_identity`): saved with each checkpoint, compared on
    resume."""


def open_job_data(cfg: TrainConfig) -> JobData:
    """Prepare (if needed) and map the job's data; check the tokenizer. ``ValueError`` (one line) otherwise."""
    folder = job_folder(cfg)
    prepared = open_prepared(folder)
    tokenizer = prepared.tokenizer()
    problem = tokenizer_problem(cfg, prepared.index)
    if problem:
        raise ValueError(problem)
    identity = data_identity(prepared)
    train, held = prepared.train, prepared.eval
    if os.environ.get(IN_MEMORY_ENV) == "1":
        train, held = train.to_tensor(), held.to_tensor()
    return JobData(folder, tokenizer, prepared.eos, train, held, identity)


def split_tokens(folder: Path) -> tuple[int, int]:
    """(training tokens, held-out tokens) of a prepared folder, from its index."""
    index = read_index(folder)
    return int(index["splits"]["train"]["tokens"]), int(index["splits"]["eval"]["tokens"])


def tokenizer_problem(cfg: TrainConfig, index: dict[str, Any]) -> str | None:
    """Why ``--tokenizer`` (or the ``--model`` folder's own) is not the one the prepared folder's ids come from
    (one line), or None. Only checked when ``--dataset`` is a prepared folder (an implicit one is keyed by the
    tokenizer)."""
    if cfg.tokenizer is None or not is_prepared(cfg.dataset):
        return None
    from ..data.tokenizer import load_pretrained_tokenizer

    tok, _ = load_pretrained_tokenizer(cfg.tokenizer)
    theirs, as_written = tokenizer_fingerprints(tok)
    if index["tokenizer"]["fingerprint"] not in (theirs, as_written):
        # the same as --model when --tokenizer was not given (TrainConfig's default)
        flag = "--tokenizer" if cfg.tokenizer != cfg.model else "--model"
        return (f"{flag} {cfg.tokenizer} is not the tokenizer --dataset {cfg.dataset} was prepared with "
                f"({index['tokenizer']['about']}; fingerprints {theirs} and {index['tokenizer']['fingerprint']})")
    return None


def prepared_flag_problem(cfg: TrainConfig, given: set[str]) -> str | None:
    """A flag given with a prepared ``--dataset`` that the folder decided otherwise (one line), or None."""
    if not is_prepared(cfg.dataset):
        return None
    try:
        index = read_index(cfg.dataset)
    except ValueError as e:
        return str(e)
    request = index.get("request", {})
    source = request.get("source", {})
    # what the folder decided: the vocabulary only for a BPE it trained, the dtype only for token files
    have = {"vocab_size": index.get("vocab_size") if "bpe" in request.get("tokenizer", {}) else None,
            "eval_fraction": request.get("eval_fraction"), "text_column": source.get("text_column"),
            "token_dtype": index.get("dtype") if source.get("kind") == "tokens" else None}
    for name, flag in FIXED_BY_FOLDER.items():
        if name in given and have[name] is not None and getattr(cfg, name) != have[name]:
            asked = request.get("tokenizer", {}).get("bpe")
            if name == "vocab_size" and asked is not None and have[name] < asked and getattr(cfg, name) > have[name]:
                # the BPE stopped short of what was asked: preparing again with any larger size gives the same
                return (f"{flag} {getattr(cfg, name)} differs from the {have[name]} --dataset {cfg.dataset} was "
                        f"prepared with ({asked} were asked for, and its text gives at most {have[name]}): leave "
                        f"{flag} out")
            return (f"{flag} {getattr(cfg, name)} differs from the {have[name]} --dataset {cfg.dataset} was prepared "
                    f"with: prepare it again, or leave {flag} out")
        if name in given and have[name] is None:
            return f"{flag} does not apply to --dataset {cfg.dataset}: it was prepared already ({_about(index)})"
    return None


def _about(index: dict[str, Any]) -> str:
    return f"{index['tokenizer']['about']}, {index['split']}"

