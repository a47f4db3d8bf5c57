"""``quietsync prepare``: tokenize a corpus once, in parallel, into memory-mappable token shards.

:func:`prepare` reads the documents of ``--dataset`` as a stream (:mod:`quietsync.data.sources`), splits off the
held-out documents, encodes batches of documents on every core (the ``tokenizers`` library's Rust encoder runs
without Python's lock, one encoding thread per core, in order), and appends each split's ids, every document
followed by the end-of-text id, to shards of at most ``shard_tokens`` tokens (:mod:`quietsync.data.shards`).
Only a few batches of text are in memory at any time. The index is written last.

* **Tokenizer**: ``--tokenizer`` (a folder with ``tokenizer.json`` or a hub name), or else the default one, a
  byte-level BPE of ``--vocab-size`` trained on the training documents — all of them when the corpus has at most
  ``tokenizer_sample_chars`` characters (so a small corpus gets exactly the tokenizer ``quietsync train`` always
  trained), else every m-th training document, m chosen from the input's size so that about that many characters
  are sampled across the whole corpus (the index and the output say which).
* **Interrupted and resumed**: every few seconds the shards are flushed and ``prepare-state.json`` records how many
  documents are written and how long each shard is; the same command again truncates the shards to that point,
  skips the documents already written and goes on. A different command in a half-written folder is refused (or
  redone with ``--overwrite``). A refusal found while reading (an empty text column) removes what was written.
* **Pre-tokenized shards** (``.bin``/``.npy``) are indexed where they are, after a check that their ids fit the
  tokenizer's vocabulary.

``quietsync train`` prepares implicitly, into ``--cache-dir``, keyed by the input, the tokenizer and the split: the
first process takes a lock and prepares, the others wait for it (:func:`prepared_for_job`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..validate import check_float, check_int
from .shard_writer import ShardStateError, SplitWriter
from .shards import (
    DTYPES,
    FORMAT,
    INDEX,
    TOKENIZER,
    VERSION,
    is_prepared,
    token_dtype,
    tokenizer_fingerprint,
)
from .sources import PREPARE_STATE, Source, UnfinishedPrepare, cpu_count, resolve_source, saved_has_held_out
from .token_files import TokenFileError, index_token_files

STATE = PREPARE_STATE
"""The journal of an unfinished prepare (removed when the index is written)."""

BATCH_CHARS = 1 << 20
"""Characters of text per encoding batch."""

CHECKPOINT_S = 2.0
"""Seconds between two journal entries (at most the work an interrupted prepare redoes; each entry fsyncs the
shards, a small cost at this cadence)."""


@dataclass
class PrepareConfig:
    """What ``quietsync prepare`` (and ``quietsync train``'s implicit prepare) does."""

    dataset: str = "kjv"
    """Input: 'kjv', a text file or folder of .txt files, JSONL/Parquet/Arrow files or a folder of them, a
    datasets.save_to_disk folder, pre-tokenized .bin/.npy shards, or a hub dataset name (needs a network)."""
    out: str | None = None
    """Folder to write the shards and index.json to (created; resumed when an earlier prepare of the same input
    was interrupted)."""
    text_column: str | None = None
    """Column holding the text (tables); default: 'text', else the only string column."""
    tokenizer: str | None = None
    """Pretrained tokenizer: a folder with tokenizer.json or a hub name (required for pre-tokenized shards);
    default: a byte-level BPE of --vocab-size trained on the training documents."""
    vocab_size: int = 4096
    """Size of the default tokenizer's vocabulary (at least 257: the 256 bytes and end-of-text)."""
    eval_fraction: float = 0.02
    """Fraction of the documents held out for evaluation (every k-th one) when the input names no held-out files."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """dtype of pre-tokenized .bin files (nanoGPT's: uint16); .npy files say their own."""
    tokenizer_sample_chars: int = 50_000_000
    """The default tokenizer is trained on all training text up to this many characters, else on a sample of
    documents spread over the corpus of about this size."""
    shard_tokens: int = 1 << 26
    """Tokens per shard file (the last one of a split holds the rest)."""
    workers: int = 0
    """Encoding threads (0 = one per core)."""
    overwrite: bool = False
    """Replace what --out holds from an earlier prepare (a finished one, or an unfinished one of other input)."""
    progress: bool = True
    """Show a progress bar with tokens/s on stderr."""

    def __post_init__(self) -> None:
        from .tokenizer import MIN_VOCAB

        check_int("vocab_size", self.vocab_size, MIN_VOCAB)
        check_float("eval_fraction", self.eval_fraction, 0, 0.5, low_open=True, high_open=True)
        check_int("tokenizer_sample_chars", self.tokenizer_sample_chars, 1)
        check_int("shard_tokens", self.shard_tokens, 1)
        check_int("workers", self.workers, 0)
        if self.token_dtype not in DTYPES:
            raise ValueError(f"token_dtype must be uint16 or uint32, got {self.token_dtype!r}")


class Refused(ValueError):
    """A prepare that cannot be done as asked (one line, naming the flag)."""


# --------------------------------------------------------------------------------------------- the request


def _request(cfg: PrepareConfig, source: Source, tokenizer_about: dict[str, Any]) -> dict[str, Any]:
    """What decides the folder's contents (an unfinished prepare resumes only for the same request)."""
    by_file = _held_out_by_file(source)
    # no eval_fraction when files name the held-out split: it cannot change the contents then
    request = {"format": FORMAT, "version": VERSION, "source": source.identity(), "tokenizer": tokenizer_about,
               "eval_fraction": None if by_file else cfg.eval_fraction}
    if source.kind != "tokens":  # token files are indexed in place, never cut into shards
        request["shard_tokens"] = cfg.shard_tokens
    return request


def plan_request(cfg: PrepareConfig) -> tuple[Source, Any, int | None, dict[str, Any]]:
    """(the source, the pretrained tokenizer or None, its end-of-text id, the request) of a prepare, without
    reading the input (:class:`Refused`, one line, when it cannot be read as asked)."""
    try:
        source = resolve_source(cfg.dataset, cfg.text_column, token_dtype=cfg.token_dtype)
    except UnfinishedPrepare as e:
        raise Refused(unfinished_prepare(e)) from None
    except ValueError as e:
        raise Refused(str(e)) from None
    pretrained, eos, tokenizer_about = _tokenizer_request(cfg, source)
    return source, pretrained, eos, _request(cfg, source, tokenizer_about)


def unfinished_prepare(e: UnfinishedPrepare) -> str:
    """:class:`~quietsync.data.sources.UnfinishedPrepare`'s line with the command that finishes the prepare, from
    its journal's request (the flags that differ from the defaults); its plain line when the journal is unreadable."""
    folder = e.folder
    try:
        request = json.loads((folder / STATE).read_text())["request"]
        source, tokenizer = request["source"], request["tokenizer"]
        name, out, where = source["name"], e.dataset, ""
        tail, files = Path(name).parts, source.get("files") or []
        if files and not Path(name).expanduser().exists():
            # the request holds the name as spelled: run it again from where it was spelled (found from the files)
            first = Path(files[0][0])
            named = next((p for p in (first, *first.parents) if p.parts[-len(tail):] == tail), None)
            if named is not None and len(named.parts) > len(tail):
                where, out = f"cd {Path(*named.parts[:-len(tail)])} && ", str(folder.resolve())
        flags = [f"--dataset {name}", f"--out {out}"]
        default = {f.name: f.default for f in fields(PrepareConfig)}
        given = {"text_column": source.get("text_column"), "tokenizer": tokenizer.get("pretrained"),
                 "vocab_size": tokenizer.get("bpe"), "tokenizer_sample_chars": tokenizer.get("sample_chars"),
                 "eval_fraction": request.get("eval_fraction"), "shard_tokens": request.get("shard_tokens")}
        flags += [f"--{field.replace('_', '-')} {value}" for field, value in given.items()
                  if value is not None and value != default[field]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a journal cut short: no command to give
        return str(e)
    return (f"{e.what}: finish it with the same command, which resumes where it stopped ({where}quietsync prepare "
            f"{' '.join(flags)}), then train on it")


def request_key(request: dict[str, Any]) -> str:
    """A short digest of a request (the implicit prepare's cache folder name)."""
    return hashlib.sha256(json.dumps(request, sort_keys=True).encode("utf-8")).hexdigest()[:20]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a temporary sibling renamed into place)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # named in OURS: a leftover from a kill is cleaned up too
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------- splits


def split_stream(documents: Iterable[tuple[str, int]], k: int) -> Iterator[tuple[str, bool, int]]:
    """``(document, held out?, position)``: every k-th document held out, counting from the (k-1)-th — and when
    there are fewer than k, the last one — as :func:`~quietsync.data.corpus.split_documents` splits a list (one
    document is held back until the next one is read)."""
    pending: tuple[str, int] | None = None
    i = 0
    any_held = False
    for doc, read in documents:
        if pending is not None:
            held = i % k == k - 1
            any_held |= held
            yield pending[0], held, pending[1]
            i += 1
        pending = (doc, read)
    if pending is not None:
        held = i % k == k - 1 or not any_held
        yield pending[0], held, pending[1]


def _held_out_by_file(source: Source) -> bool:
    if source.kind == "saved":
        return saved_has_held_out(source)
    if source.kind == "hub":
        from .sources import hub_has_held_out

        return hub_has_held_out(source)
    return bool(source.held_out_files)


def labelled_documents(source: Source, k: int, by_file: bool) -> Iterator[tuple[str, bool, int]]:
    """Every document of ``source`` with its split: the held-out files after the training ones when the input
    names them, else every k-th document."""
    if by_file:
        for doc, read in source.documents():
            yield doc, False, read
        for doc, read in source.documents(held_out=True):
            yield doc, True, read
    else:
        yield from split_stream(source.documents(), k)


# ------------------------------------------------------------------------------------------------ tokenizer


def _bpe_sample(source: Source, k: int, by_file: bool, sample_chars: int, total: int | None
                ) -> tuple[Iterator[str], int, dict[str, int]]:
    """(the training documents the default tokenizer learns from, the stride m: every m-th document, the count of
    held-out documents passed over so far: ``{"held": n}``)."""
    # m rounded up, so 1 in m documents comes to at most about sample_chars characters
    stride = 1 if total is None or total <= sample_chars else -(-total // sample_chars)

    passed = {"held": 0}

    def docs() -> Iterator[str]:
        seen = 0
        taken = 0
        for doc, held, _ in labelled_documents(source, k, by_file):
            if held:
                passed["held"] += 1
                continue
            if seen % stride == 0:
                yield doc
                taken += len(doc)
                if stride == 1 and total is None and taken >= sample_chars:
                    return  # a stream of unknown size: its first sample_chars characters
            seen += 1

    return docs(), stride, passed


def _default_tokenizer(cfg: PrepareConfig, source: Source, k: int, by_file: bool, say: Callable[[str], None]):
    """Train the default byte-level BPE on the training documents (or a sample spread over them)."""
    from .tokenizer import train_bpe

    total = source.total_bytes() if source.kind != "kjv" else None
    docs, stride, passed = _bpe_sample(source, k, by_file, cfg.tokenizer_sample_chars, total)
    what = "every training document" if stride == 1 else f"1 in every {stride} training documents"
    if stride == 1 and total is None and source.kind == "hub":
        what = f"the first {cfg.tokenizer_sample_chars:,} characters of training text"
    say(f"training the default tokenizer (byte-level BPE, {cfg.vocab_size} entries) on {what}")
    t0 = time.perf_counter()
    counted = _Counted(docs)
    tok = train_bpe(counted, cfg.vocab_size)
    if counted.documents == 0:  # known only once the trainer has read the stream
        raise Refused(_no_text(source, by_file, passed["held"]))
    entries = tok.get_vocab_size()
    asked = "" if entries >= cfg.vocab_size else f" (of {cfg.vocab_size} asked for)"
    if asked:  # a small text runs out of pairs seen twice: the vocabulary is smaller, and preparing again won't help
        say(f"the tokenizer stopped at {entries} of the {cfg.vocab_size} entries asked for: the text has no more "
            f"merges to learn (pairs seen at least twice); --vocab-size above {entries} gives the same")
    about = f"byte-level BPE, {entries} entries{asked}, trained on {what} ({counted.chars:,} characters)"
    return tok, about, time.perf_counter() - t0


def _no_text(source: Source, by_file: bool, documents: int, held_out: bool = False) -> str:
    """Why the input has too little text to split (one line); ``documents``: all of them, held out or not."""
    if by_file:
        part = "held-out files / split" if held_out else "training files / split"
        return f"--dataset {source.name}: its {part} hold no text (no non-blank document)"
    first = "--dataset must hold at least 2 documents (non-blank chunks or rows) to split off a held-out part"
    if documents == 0:
        return f"{first}; {source.name} holds none (only blank text)"
    # one document is the held-out one (split_stream): the training count, 0, read as an empty input
    chunks = (f" (text is cut into documents of about {source.options['chunk_chars']:,} characters)"
              if source.kind == "text" else "")
    return (f"{first}; {source.name} holds {documents:,} document{'s' if documents > 1 else ''}{chunks}, taken for "
            "held-out evaluation, so none is left to train on")


class _Counted:
    """An iterator that counts the documents and characters it passed on."""

    def __init__(self, docs: Iterator[str]) -> None:
        self.docs, self.documents, self.chars = docs, 0, 0

    def __iter__(self) -> Iterator[str]:
        for doc in self.docs:
            self.documents += 1
            self.chars += len(doc)
            yield doc


def _tokenizer_request(cfg: PrepareConfig, source: Source) -> tuple[Any, int | None, dict[str, Any]]:
    """(the pretrained tokenizer or None, its eos id, what the request records about the tokenizer)."""
    if cfg.tokenizer:
        from .tokenizer import load_pretrained_tokenizer

        try:
            tok, eos = load_pretrained_tokenizer(cfg.tokenizer)
        except ValueError as e:
            raise Refused(str(e)) from None
        return tok, eos, {"pretrained": cfg.tokenizer, "fingerprint": tokenizer_fingerprint(tok)}
    if source.kind == "tokens":
        raise Refused(f"--dataset {cfg.dataset} holds token ids: name the tokenizer they were made with "
                      "(--tokenizer: a folder with tokenizer.json or a hub name)")
    return None, None, {"bpe": cfg.vocab_size, "sample_chars": cfg.tokenizer_sample_chars}


# -------------------------------------------------------------------------------------------------- encoding


def encode_ids(tokenizer, documents: list[str], eos: int, dtype: np.dtype) -> np.ndarray:
    """The ids of ``documents``, each followed by ``eos``, as one array of ``dtype``."""
    out: list[int] = []
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # the same ids, without offsets
    for enc in encode(documents):
        out.extend(enc.ids)
        out.append(eos)
    return np.asarray(out, dtype=dtype)


def encode_in_order(encode: Callable[[Any], Any], batches: Iterable[Any], workers: int) -> Iterator[Any]:
    """``encode(batch)`` for each batch, on ``workers`` threads, yielded in order; at most ``2 × workers`` batches
    are read ahead (so memory stays a few batches of text whatever the corpus)."""
    if workers <= 1:
        yield from map(encode, batches)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="quietsync-encode") as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.submit(encode, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


@dataclass
class _Batch:
    """Documents of one encoding batch, with their split."""

    documents: list[str]
    held: list[bool]
    read: int
    """Input bytes read when the batch was full."""


def _batches(labelled: Iterator[tuple[str, bool, int]], skip: int) -> Iterator[_Batch]:
    """Batches of about :data:`BATCH_CHARS` characters, after ``skip`` documents already written."""
    docs: list[str] = []
    held: list[bool] = []
    chars = 0
    read = 0
    for i, (doc, h, read) in enumerate(labelled):
        if i < skip:  # skipped after labelling: every k-th counts from the first document
            continue
        docs.append(doc)
        held.append(h)
        chars += len(doc)
        if chars >= BATCH_CHARS:
            yield _Batch(docs, held, read)
            docs, held, chars = [], [], 0
    if docs:
        yield _Batch(docs, held, read)


# ---------------------------------------------------------------------------------------------------- progress


class Progress:
    """A tqdm bar over the input's bytes (or documents) with the tokens written and tokens/s; silent when off."""

    def __init__(self, on: bool, total: tuple[int | None, str], start_tokens: int = 0) -> None:
        self.bar = None
        self.t0 = time.perf_counter()
        self.tokens = start_tokens
        self.start_tokens = start_tokens
        if on:
            from tqdm import tqdm

            self.bar = tqdm(total=total[0], unit=total[1] if total[1] == "B" else f" {total[1]}", unit_scale=True,
                            file=sys.stderr,
                            desc="quietsync prepare", dynamic_ncols=True, mininterval=0.5)

    def update(self, position: int, tokens: int) -> None:
        """``tokens`` more were written; the input was read up to ``position``."""
        self.tokens += tokens
        if self.bar is None:
            return
        self.bar.update(max(0, (min(position, self.bar.total) if self.bar.total else position) - self.bar.n))
        rate = (self.tokens - self.start_tokens) / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / 1e6:.1f}M tokens, {rate / 1e6:.2f}M tokens/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            if self.bar.total:
                self.bar.update(self.bar.total - self.bar.n)
            self.bar.close()


# ----------------------------------------------------------------------------------------------------- prepare


@dataclass
class Prepared:
    """What :func:`prepare` did."""

    folder: Path
    """The prepared folder."""
    index: dict[str, Any]
    """Its index."""
    already: bool
    """It was prepared before (nothing was done)."""


def _folder_state(folder: Path, request: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """The journal to resume from (None: start afresh); clears the folder's earlier prepare when asked to.

    Refuses a folder holding another prepare (unless ``overwrite``) or files that are not a prepare's."""
    state_path = folder / STATE
    if folder.exists() and not folder.is_dir():
        raise Refused(f"--out {folder} is a file")
    ours = is_prepared(folder) or state_path.exists()
    if overwrite and ours:
        _remove_ours(folder)
        return None
    if is_prepared(folder):
        raise Refused(f"--out {folder} already holds a prepared dataset of other input or settings: "
                      "--overwrite replaces it")
    if state_path.exists():
        try:
            state = json.loads(state_path.read_text())
        except ValueError:
            state = None  # unreadable: refused below like another prepare's journal
        if state is not None and state.get("request") == request:
            return state
        raise Refused(f"--out {folder} holds an unfinished prepare of other input or settings: --overwrite "
                      "starts this one instead")
    if folder.exists() and any(not _is_ours(p) for p in folder.iterdir()):
        raise Refused(f"--out {folder} is not empty and holds no prepare: choose a new folder")
    if folder.exists():  # only files a prepare writes, from one stopped before its first journal entry
        _remove_ours(folder)
    return None


OURS = ("train-*.bin", "eval-*.bin", INDEX, TOKENIZER, STATE, f".{STATE}.tmp-*", f".{INDEX}.tmp-*")
"""The names a prepare writes in its folder."""


def _is_ours(path: Path) -> bool:
    return path.is_file() and any(path.match(pattern) for pattern in OURS)


def _remove_ours(folder: Path) -> None:
    """Remove what a prepare writes in ``folder`` (never other files); the folder too when it is then empty."""
    for pattern in OURS:
        for path in folder.glob(pattern):
            path.unlink()
    try:
        folder.rmdir()
    except OSError:
        pass  # it holds other files: the folder stays


def prepare(cfg: PrepareConfig, folder: str | os.PathLike | None = None, *,
            say: Callable[[str], None] | None = None) -> Prepared:
    """Prepare ``cfg.dataset`` into ``folder`` (default ``cfg.out``); see the module doc. Raises :class:`Refused`
    (one line) for input that cannot be prepared as asked; an interrupted prepare leaves a journal to resume from."""
    say = say or (lambda text: print(f"quietsync prepare: {text}", flush=True))
    folder = Path(folder if folder is not None else cfg.out).expanduser()
    source, pretrained, eos, request = plan_request(cfg)
    if is_prepared(folder) and not cfg.overwrite:
        index = json.loads((folder / INDEX).read_text())
        if index.get("request") == request:
            return Prepared(folder, index, already=True)
    state = _folder_state(folder, request, cfg.overwrite)
    try:
        if source.kind == "tokens":
            return _index_token_files(cfg, source, folder, pretrained, eos, request)
        return _encode_corpus(cfg, source, folder, pretrained, eos, request, state, say)
    except (TokenFileError, ShardStateError) as e:
        _remove_ours(folder)
        raise Refused(str(e)) from None
    except Refused:
        _remove_ours(folder)
        raise


def _index_token_files(cfg: PrepareConfig, source: Source, folder: Path, tokenizer, eos: int,
                       request: dict[str, Any]) -> Prepared:
    """Index pre-tokenized files where they are (:mod:`quietsync.data.token_files`); write the tokenizer and
    the index."""
    vocab = tokenizer.get_vocab_size()
    dtype, entries, split = index_token_files(source.files, source.held_out_files, source.options["token_dtype"],
                                              vocab, str(cfg.tokenizer), cfg.eval_fraction)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / TOKENIZER))
    index = _index(request, dtype, eos, vocab, tokenizer, f"pretrained {cfg.tokenizer}", source, split, entries,
                   {"indexed_in_place": True})
    _write_json(folder / INDEX, index)
    return Prepared(folder, index, already=False)


def _encode_corpus(cfg: PrepareConfig, source: Source, folder: Path, tokenizer, eos: int | None,
                   request: dict[str, Any], state: dict[str, Any] | None, say: Callable[[str], None]) -> Prepared:
    from tokenizers import Tokenizer

    from .tokenizer import eos_id

    k = max(2, round(1.0 / cfg.eval_fraction))  # as corpus.split_documents: k = 1 would hold out everything
    by_file = _held_out_by_file(source)
    if source.kind in ("json", "parquet", "arrow", "saved", "hub"):
        _check_column_first(source)
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tokenizer_s = 0.0
    if state is not None and state.get("tokenizer_done"):
        tokenizer = Tokenizer.from_file(str(folder / TOKENIZER))  # the shards kept hold its ids
        about = state["tokenizer_about"]
    else:
        if tokenizer is None:
            tokenizer, about, tokenizer_s = _default_tokenizer(cfg, source, k, by_file, say)
        else:
            about = f"pretrained {cfg.tokenizer}"
        tokenizer.save(str(folder / TOKENIZER))
        state = None
    if eos is None:
        eos = eos_id(tokenizer)
    vocab = tokenizer.get_vocab_size()
    dtype = token_dtype(vocab)
    writers = {"train": SplitWriter(folder, "train", dtype, cfg.shard_tokens),
               "eval": SplitWriter(folder, "eval", dtype, cfg.shard_tokens)}
    skip = 0
    elapsed_before = 0.0
    if state is not None:
        on_disk = sum(p.stat().st_size for split in writers for p in folder.glob(f"{split}-*.bin"))
        kept = sum(int(s["tokens"]) for split in writers for s in state["shards"][split]) * DTYPES[dtype].itemsize
        # what the journal's last entry records is kept; what was written after it (not yet durable) is redone
        say(f"resuming {folder}: {int(state['documents']):,} documents ({kept:,} bytes of shards) kept from the "
            f"journal's last entry; {max(0, on_disk - kept):,} bytes written after it are encoded again")
        for split, w in writers.items():
            w.restore(state["shards"][split])
        skip = int(state["documents"])
        elapsed_before = float(state.get("seconds", 0.0))
    journal = {"request": request, "tokenizer_done": True, "tokenizer_about": about}

    def write_journal(documents: int, seconds: float) -> None:
        for w in writers.values():
            w.flush()
        _write_json(folder / STATE, {**journal, "documents": documents, "seconds": seconds,
                                     "shards": {s: w.state() for s, w in writers.items()}})

    # journal at once: a kill before the first checkpoint still keeps the trained tokenizer
    write_journal(skip, elapsed_before)
    workers = cfg.workers or cpu_count()
    np_dtype = DTYPES[dtype]

    def encode(batch: _Batch) -> tuple[_Batch, np.ndarray | None, np.ndarray | None]:
        if all(batch.held) or not any(batch.held):
            ids = encode_ids(tokenizer, batch.documents, eos, np_dtype)
            return batch, (None, ids) if batch.held[0] else (ids, None)
        train = [d for d, h in zip(batch.documents, batch.held) if not h]
        held = [d for d, h in zip(batch.documents, batch.held) if h]
        return batch, (encode_ids(tokenizer, train, eos, np_dtype), encode_ids(tokenizer, held, eos, np_dtype))

    documents = skip
    progress = Progress(cfg.progress, source.progress_total(), sum(w.tokens for w in writers.values()))
    t_encode = time.perf_counter()
    last = t_encode
    try:
        for batch, (train_ids, held_ids) in encode_in_order(
                encode, _batches(labelled_documents(source, k, by_file), skip), workers):
            n_held = sum(batch.held)
            if train_ids is not None:
                writers["train"].write(train_ids, len(batch.documents) - n_held)
            if held_ids is not None:
                writers["eval"].write(held_ids, n_held)
            documents += len(batch.documents)
            progress.update(batch.read, (0 if train_ids is None else train_ids.size)
                            + (0 if held_ids is None else held_ids.size))
            now = time.perf_counter()
            if now - last >= CHECKPOINT_S:
                write_journal(documents, elapsed_before + now - t0)
                last = now
    finally:
        progress.close()
    encode_s = time.perf_counter() - t_encode
    entries = {s: w.close() for s, w in writers.items()}
    if writers["train"].documents == 0 or writers["eval"].documents == 0:
        raise Refused(_no_text(source, by_file, documents, held_out=writers["train"].documents > 0))
    tokens = sum(w.tokens for w in writers.values())
    # the rate counts only this run's tokens, not those kept from before a resume
    new_tokens = tokens - progress.start_tokens
    seconds = elapsed_before + time.perf_counter() - t0
    split = ("the input's held-out files / split" if by_file
             else f"every {k}th document held out (--eval-fraction {cfg.eval_fraction:g})")
    index = _index(request, dtype, eos, vocab, tokenizer, about, source, split, entries,
                   {"seconds": round(seconds, 3), "tokenizer_seconds": round(tokenizer_s, 3),
                    "encode_seconds": round(encode_s, 3),
                    "tokens_per_s_encoding": round(new_tokens / max(encode_s, 1e-9)), "workers": workers})
    _write_json(folder / INDEX, index)
    (folder / STATE).unlink(missing_ok=True)  # after the index: a kill in between leaves a finished folder
    rate = new_tokens / max(encode_s, 1e-9) / 1e6
    say(f"{tokens:,} tokens ({index['splits']['train']['tokens']:,} train, {index['splits']['eval']['tokens']:,} "
        f"held out) from {documents:,} documents in {seconds:.1f} s; encoding {rate:.2f}M tokens/s on {workers} "
        f"threads; {dtype} shards in {folder}")
    return Prepared(folder, index, already=False)


def _check_column_first(source: Source) -> None:
    """Name the text column before anything is written (a missing or non-text column is refused here)."""
    try:
        next(iter(source.documents()), None)
    except ValueError as e:  # ours name their flag; a reader's (a JSON parse error) gets the file's
        text = " ".join(str(e).split())
        raise Refused(text if text.startswith("--") else f"--dataset {source.name}: {text}") from None
    except RuntimeError as e:
        if not isinstance(e.__cause__, StopIteration):
            raise
        # the table reader found not one row to infer its columns from
        raise Refused(f"--dataset {source.name} holds no rows (its files are empty)") from None


def _index(request: dict[str, Any], dtype: str, eos: int, vocab: int, tokenizer, about: str, source: Source,
           split: str, entries: dict[str, list[dict[str, Any]]], prepare_info: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT, "version": VERSION, "dtype": dtype, "eos": int(eos), "vocab_size": int(vocab),
        "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer), "about": about},
        "source": {"dataset": source.name, "kind": source.kind, "text_column": source.text_column},
        "split": split,
        "splits": {s: {"documents": sum(e.get("documents") or 0 for e in es) if es and es[0].get("documents")
                       is not None else None, "tokens": sum(e["tokens"] for e in es), "shards": es}
                   for s, es in entries.items()},
        "prepare": prepare_info, "request": request,
    }
