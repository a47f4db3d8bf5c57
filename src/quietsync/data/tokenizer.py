"""A byte-level BPE tokenizer trained locally on the corpus and cached on disk.

Nothing is downloaded: the tokenizer is trained with the ``tokenizers`` library on the training
documents of the corpus (never on the held-out part). The result is cached as
``<cache_dir>/tokenizer-<corpus fingerprint>-v<vocab size>.json``; concurrent workers build it once
(see :mod:`quietsync.data.cache`). Byte-level BPE round-trips any text exactly.

``--tokenizer`` instead takes a pretrained tokenizer (a local folder with ``tokenizer.json``, e.g. a previous
run's ``OUT/model``, or a hub name): :func:`load_pretrained_tokenizer`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..validate import check_int
from .cache import DEFAULT_CACHE_DIR, build_once
from .corpus import Corpus

EOS_TOKEN = "<|endoftext|>"
"""Special token put between documents (also used as BOS/EOS/pad id of the model)."""

MIN_VOCAB = 256 + 1
"""Smallest vocabulary: the 256 byte symbols plus the end-of-text token."""


def tokenizer_path(corpus: Corpus, vocab_size: int, cache_dir: str | os.PathLike | None = None) -> Path:
    """Cache path for the tokenizer of ``corpus`` with ``vocab_size`` entries."""
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    return root / f"tokenizer-{corpus.fingerprint()[:20]}-v{vocab_size}.json"


def train_tokenizer(corpus: Corpus, vocab_size: int):
    """Train a byte-level BPE with ``vocab_size`` entries on the training documents of ``corpus``."""
    return train_bpe(corpus.documents, vocab_size, length=len(corpus.documents))


def train_bpe(documents: Iterable[str], vocab_size: int, length: int | None = None):
    """Train a byte-level BPE with ``vocab_size`` entries (and the end-of-text token) on ``documents``, read once as
    a stream (the trainer keeps word counts, not the text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    check_int("vocab_size", vocab_size, MIN_VOCAB)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer, length=length)
    return tok


def load_or_train_tokenizer(corpus: Corpus, vocab_size: int, cache_dir: str | os.PathLike | None = None):
    """The cached tokenizer for ``corpus`` and ``vocab_size``, trained on first use."""
    from tokenizers import Tokenizer

    path = tokenizer_path(corpus, vocab_size, cache_dir)
    build_once(path, lambda tmp: train_tokenizer(corpus, vocab_size).save(str(tmp)))
    return Tokenizer.from_file(str(path))


def load_pretrained_tokenizer(name: str) -> tuple[Any, int]:
    """(the ``tokenizers.Tokenizer`` behind ``AutoTokenizer.from_pretrained(name)``, its end-of-text id).
    ``ValueError`` naming ``--tokenizer`` when it cannot be loaded or has no fast version or no end token."""
    from transformers import AutoTokenizer

    if Path(name).is_file():  # its folder: from_pretrained would take a file's path for a hub name and retry online
        if Path(name).name != "tokenizer.json":
            raise ValueError(f"--tokenizer: {name!r} is a file; give the folder that holds its tokenizer.json")
        name = str(Path(name).parent)
    if not Path(name).exists():  # a hub name: asked first, or the hub client spends a minute on retries
        from .sources import hub_unreachable, only_a_path

        if only_a_path(name):
            raise ValueError(f"--tokenizer {name}: no such folder")
        unreachable = hub_unreachable()
        if unreachable is not None:
            raise ValueError(f"--tokenizer: {name!r} is no folder here, and the Hugging Face hub, where such a name is "
                             f"looked up, {unreachable}")
    try:
        fast = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__  # refusals are one line
        raise ValueError(f"--tokenizer: cannot load {name!r} ({first})") from None
    if not getattr(fast, "is_fast", False):  # the ids come from its Rust backend_tokenizer, which only a fast one has
        raise ValueError(f"--tokenizer: {name!r} has no fast (tokenizers) version")
    eos = fast.eos_token if fast.eos_token is not None else EOS_TOKEN  # one naming no eos_token may still hold ours
    tok = fast.backend_tokenizer
    idx = tok.token_to_id(eos)
    if idx is None:
        raise ValueError(f"--tokenizer: {name!r} has no end-of-text token (eos_token, or {EOS_TOKEN})")
    return tok, idx


def job_tokenizer(pretrained: str | None, corpus: Corpus, vocab_size: int,
                  cache_dir: str | os.PathLike | None = None) -> tuple[Any, int]:
    """(tokenizer, end-of-text id) of a job: the ``--tokenizer`` given, else the cached BPE of the corpus."""
    if pretrained:
        return load_pretrained_tokenizer(pretrained)
    tok = load_or_train_tokenizer(corpus, vocab_size, cache_dir)
    return tok, eos_id(tok)


def eos_id(tokenizer) -> int:
    """Id of the end-of-text token."""
    idx = tokenizer.token_to_id(EOS_TOKEN)
    if idx is None:
        raise ValueError(f"tokenizer has no {EOS_TOKEN} token")
    return idx
