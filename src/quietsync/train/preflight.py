"""Checks of a ``quietsync train`` job that need the machine, run before any worker starts.

Flag values are checked by the config classes; what is checked here depends on the file system and the
host: the output, cache and checkpoint paths (:func:`check_paths`), the thread count
(:func:`check_threads`) and whether the data holds enough text for the job (:func:`check_data`, which
loads the corpus and builds the cached tokenizer and token streams that the workers then reuse). Each
problem is a :class:`~quietsync.cli.flags.FlagError`: one line naming the flag and what is allowed.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..cli.flags import FlagError, flag_message
from .cache import DEFAULT_CACHE_DIR
from .config import TrainConfig

__all__ = ["THREADS_PER_CORE", "check_paths", "check_threads", "check_data", "data_problem"]

THREADS_PER_CORE = 4
"""``--threads`` may be at most this many times the host's CPU cores (more only thrashes)."""


def _check_folder(flag: str, path: str | os.PathLike, what: str) -> None:
    """``path`` is a writable folder, or a folder that can be created (its nearest existing parent is one)."""
    path = Path(path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FlagError(flag, f"{flag} must be a folder ({what}), but {path} is a file")
        if not os.access(path, os.W_OK | os.X_OK):
            raise FlagError(flag, f"{flag} must be a writable folder ({what}), but {path} is not writable")
        return
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise FlagError(flag, f"{flag} must be a folder ({what}), but {parent} on its path is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FlagError(flag, f"{flag} cannot be created ({what}): {parent} is not writable")


def check_paths(cfg: TrainConfig) -> None:
    """``--out`` and ``--cache-dir`` are (or can become) writable folders; ``--resume DIR`` is a folder."""
    _check_folder("--out", cfg.out, "the run's outputs")
    _check_folder("--cache-dir", cfg.cache_dir if cfg.cache_dir is not None else DEFAULT_CACHE_DIR,
                  "tokenizer and token cache")
    if cfg.resume not in (None, "latest") and not Path(cfg.resume).is_dir():
        what = "a file" if Path(cfg.resume).exists() else "missing"
        raise FlagError("--resume", f"--resume must be a checkpoint folder (OUT/checkpoints/step-N) or given "
                                    f"bare for the newest under --out; {cfg.resume} is {what}")


def check_threads(cfg: TrainConfig) -> None:
    """``--threads`` is 0 (auto) or at most :data:`THREADS_PER_CORE` × the CPU cores."""
    cores = os.cpu_count() or 1
    cap = THREADS_PER_CORE * cores
    if cfg.threads > cap:
        raise FlagError("--threads", f"--threads must be an integer in [0, {cap}] (0 = auto; at most "
                                     f"{THREADS_PER_CORE} x the {cores} CPU cores), got {cfg.threads}")


def data_problem(train_tokens: int, eval_tokens: int, cfg: TrainConfig, world: int) -> str | None:
    """Why the token streams are too short for the job (one line naming the flags), or None.

    Training needs ``world × --micro-batch-size`` windows of ``--seq-len`` tokens, plus one window of slack
    for the random offset of each epoch; evaluation needs at least one ``--seq-len`` window of held-out text.
    """
    need = cfg.seq_len * (world * cfg.micro_batch_size + 1)
    if train_tokens < need:
        return (f"--dataset {cfg.dataset} is too small: its training text is {train_tokens} tokens, and "
                f"{world} worker(s) x --micro-batch-size {cfg.micro_batch_size} x --seq-len {cfg.seq_len} "
                f"need at least {need}")
    if eval_tokens < cfg.seq_len:
        return (f"--dataset {cfg.dataset} is too small: its held-out text (--eval-fraction "
                f"{cfg.eval_fraction:g}) is {eval_tokens} tokens, shorter than one --seq-len {cfg.seq_len} window")
    return None


def check_data(cfg: TrainConfig, world: int) -> None:
    """Load the corpus, build (or read) the cached tokenizer and token streams, and check their sizes.

    The workers find everything in the cache afterwards. Raises :class:`FlagError` for a dataset that cannot
    be loaded or split, or is too small for the job.
    """
    from .corpus import load_corpus
    from .data import encode_split
    from .tokenizer import job_tokenizer

    try:
        corpus = load_corpus(cfg.dataset, cfg.eval_fraction)
    except (ValueError, OSError) as e:
        flag, text = flag_message(str(e), ["dataset", "eval_fraction"])
        raise FlagError(flag or "--dataset", text if flag else f"--dataset {cfg.dataset}: {text}") from None
    tokenizer, eos = job_tokenizer(cfg.tokenizer, corpus, cfg.vocab_size, cfg.cache_dir)
    train = encode_split(tokenizer, corpus.documents, eos, cfg.cache_dir).numel()
    held = encode_split(tokenizer, corpus.eval_documents, eos, cfg.cache_dir).numel()
    problem = data_problem(train, held, cfg, world)
    if problem is not None:
        raise FlagError("--dataset", problem)
