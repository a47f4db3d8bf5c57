"""Checks of a ``quietsync train`` job that need the machine, run before any worker starts.

Flag values are checked by the config classes; what is checked here depends on the file system and the
host: the output, cache and checkpoint paths (:func:`check_paths`), the thread count
(:func:`check_threads`), the C++ compiler ``--compile`` needs on CPU (:func:`check_compiler`) and whether the
data holds enough text for the job (:func:`check_data`, which prepares the data once when ``--dataset`` is not a
prepared folder, for the workers to map). Each problem is a :class:`~quietsync.cli.flags.FlagError`: one line
naming the flag and what is allowed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..cli.flags import FlagError, flag_message
from ..data.cache import DEFAULT_CACHE_DIR
from .config import TrainConfig

__all__ = ["THREADS_PER_CORE", "check_compiler", "check_paths", "check_threads", "check_data", "compiler_problem",
           "data_problem"]

THREADS_PER_CORE = 4
"""``--threads`` may be at most this many times the host's CPU cores (more only thrashes)."""


def _check_folder(flag: str, path: str | os.PathLike, what: str) -> None:
    """``path`` is a writable folder, or a folder that can be created (its nearest existing parent is one)."""
    path = Path(path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FlagError(flag, f"{flag} must be a folder ({what}), but {path} is a file")
        if not os.access(path, os.W_OK | os.X_OK):  # a folder needs x as well as w to create files in it
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


def inductor_compiler() -> str:
    """The C++ compiler ``torch.compile`` (inductor) builds CPU kernels with: ``$CXX``, else ``g++``
    (``clang++`` on macOS) -- torch's own rule (``torch._inductor.config.cpp.cxx``)."""
    return os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")


def compiler_problem(timeout_s: float = 60.0) -> str | None:
    """Why ``--compile`` cannot work on CPU here (one line naming ``--compile`` and the compiler), or None: the
    compiler of :func:`inductor_compiler` is missing, or fails to build a one-line C++ program."""
    cxx = inductor_compiler()
    how = ("--compile needs a working C++ compiler on CPU (torch.compile builds its kernels with $CXX, else g++)"
           "; install one (e.g. apt install g++), point CXX at one, or drop --compile")
    path = shutil.which(cxx)
    if path is None:
        return f"{how}: the compiler {cxx!r} was not found"
    with tempfile.TemporaryDirectory(prefix="quietsync-cxx-") as tmp:
        try:
            done = subprocess.run([path, "-x", "c++", "-", "-o", os.path.join(tmp, "probe")],
                                  input="int main() { return 0; }\n", capture_output=True, text=True,
                                  timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{how}: the compiler {cxx!r} ({path}) could not be run: {e}"
    if done.returncode != 0:
        said = next((ln.strip() for ln in reversed(done.stderr.splitlines()) if ln.strip()), "")
        return (f"{how}: the compiler {cxx!r} ({path}) failed on a one-line program (exit {done.returncode}"
                + (f": {said}" if said else "") + ")")
    return None


def check_compiler(cfg: TrainConfig) -> None:
    """With ``--compile`` on a machine without CUDA, the C++ compiler torch.compile needs works (else a one-line
    :class:`FlagError` before any worker starts, instead of a compile error in every worker ~30 s later)."""
    if not cfg.compile:
        return
    import torch

    if torch.cuda.is_available():
        return
    problem = compiler_problem()
    if problem is not None:
        raise FlagError("--compile", problem)


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


def _data_error(cfg: TrainConfig, e: Exception) -> FlagError:
    flag, text = flag_message(str(e), ["dataset", "eval_fraction", "text_column", "token_dtype", "tokenizer",
                                       "vocab_size"])
    return FlagError(flag or "--dataset", text if flag else f"--dataset {cfg.dataset}: {text}")


def _job_index(cfg: TrainConfig) -> tuple[Path, dict]:
    """The job's prepared folder (prepared now if it is not) and its index, its shards checked (:class:`FlagError`,
    one line)."""
    from ..data.shards import check_shards, read_index
    from ..models.causal_lm import check_hub_model, is_pretrained
    from .job_data import job_folder

    # a hub name: the model first, as its tokenizer (the default --tokenizer) is loaded by the prepare below
    if is_pretrained(cfg.model) and not Path(cfg.model).exists() and cfg.tokenizer == cfg.model:
        try:
            check_hub_model(cfg.model)
        except ValueError as e:
            raise FlagError("--model", str(e)) from None
    try:
        folder = job_folder(cfg, progress=cfg.progress and sys.stderr.isatty())  # no bar redraws into a log file
        index = read_index(folder)
        check_shards(folder, index)  # a shard truncated or changed since it was prepared: here, not in the workers
    except (ValueError, OSError) as e:
        raise _data_error(cfg, e) from None
    return folder, index


def job_data_identity(cfg: TrainConfig) -> dict:
    """:func:`~quietsync.data.shards.data_identity` of the job's data, prepared first if it is not (what a resume
    compares with its checkpoint's; :class:`FlagError`, one line, for data that cannot be prepared or read)."""
    from ..data.shards import data_identity, open_prepared

    folder, _ = _job_index(cfg)
    try:
        return data_identity(open_prepared(folder))
    except (ValueError, OSError) as e:
        raise _data_error(cfg, e) from None


def check_data(cfg: TrainConfig, world: int) -> None:
    """Prepare the job's data if it is not (once, into the cache: :mod:`quietsync.train.job_data`), then check it
    from its index: its tokenizer and its size for the job. Never reads the tokens, so it takes the same time for
    any size of a prepared corpus.

    The workers find everything prepared afterwards. Raises :class:`FlagError` for a dataset that cannot be
    prepared, whose tokenizer is not the job's, or that is too small for the job.
    """
    from .job_data import split_tokens, tokenizer_problem

    folder, index = _job_index(cfg)
    try:
        problem = tokenizer_problem(cfg, index)
    except (ValueError, OSError) as e:
        raise _data_error(cfg, e) from None
    if problem is not None:
        raise FlagError(problem.split()[0], problem)  # the line starts with the flag it blames
    train, held = split_tokens(folder)
    problem = data_problem(train, held, cfg, world)
    if problem is not None:
        raise FlagError("--dataset", problem)
