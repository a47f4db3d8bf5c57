"""Where the documents of ``--dataset`` come from, read as a stream (never the whole corpus in memory).

:func:`resolve_source` names the kind of input from what is on disk; :meth:`Source.documents` yields its
documents in a fixed order, a few at a time. Kinds:

* ``kjv``: the embedded King James Bible, one document per chapter (:mod:`quietsync.data.corpus`);
* ``text``: a text file, or a folder whose ``*.txt`` files (recursively, sorted) are read, cut into chunks of
  about ``chunk_chars`` characters at line boundaries — the same chunks as :func:`~quietsync.data.corpus.chunk_text`
  of the whole file, read block by block;
* ``json`` / ``parquet`` / ``arrow``: files (or a folder of them) read by the ``datasets`` library's own
  streaming readers; each non-blank value of the text column (``--text-column``; default ``text``, else the only
  string column) is a document;
* ``saved``: a ``datasets.Dataset.save_to_disk`` folder (``load_from_disk``, memory-mapped Arrow), the same way;
* ``tokens``: pre-tokenized shards, ``.bin`` (raw token ids, nanoGPT's layout; ``--token-dtype``) or ``.npy``,
  uint16 or uint32; they are used as they are (nothing is copied or tokenized), with the tokenizer named by
  ``--tokenizer``;
* ``hub``: a Hugging Face hub dataset, streamed (needs a network), at most ``max_chars`` characters per split.

The held-out split: for tables, token shards and hub datasets, files named like a held-out split (``val``,
``valid``, ``validation``, ``dev``, ``test``, ``eval`` — nanoGPT's ``val.bin``, ``validation-*.parquet``) form it
when there are any; otherwise, and always for text, every k-th document is held out (k = round(1 /
eval_fraction)), as :func:`~quietsync.data.corpus.split_documents` does (for token shards without a held-out file:
the last ``eval_fraction`` of the tokens).

Every problem is a ``ValueError`` whose message is one line naming the flag (``--dataset``, ``--text-column``,
``--token-dtype``).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .corpus import DEFAULT_DATASET, kjv_chapters, kjv_path, looks_like_path

SourceKind = Literal["kjv", "text", "json", "parquet", "arrow", "saved", "tokens", "hub"]

SUFFIXES: dict[str, SourceKind] = {
    ".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow",
    ".bin": "tokens", ".npy": "tokens",
}
"""File suffix -> kind, for files and folders given as ``--dataset``."""

NOT_DATA = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "config.json", "generation_config.json",  # a tokenizer or model saved beside the data
    "dataset_infos.json",  # a hub dataset repository's card metadata beside its data files
})
"""Names of files in a ``--dataset`` folder that are not data, whatever their suffix (a nanoGPT-style folder's
``tokenizer.json`` beside ``train.bin`` is no JSON table); a file given by name is read whatever it is called."""

TABLES: tuple[SourceKind, ...] = ("json", "parquet", "arrow", "saved", "hub")
"""Kinds whose documents are the rows of a text column."""

HELD_OUT_NAME = re.compile(r"(^|[-_.])(val|valid|validation|dev|test|eval|evaluation)([-_.]|\d|$)")
"""A file whose name (without suffix, lower case) matches holds held-out data."""

PREPARED_INDEX = "index.json"
"""The file that marks a prepared folder (:mod:`quietsync.data.shards`)."""

PREPARE_STATE = "prepare-state.json"
"""The journal of an unfinished prepare (:mod:`quietsync.data.prepare`), removed when its index is written."""

READ_BLOCK = 1 << 22
"""Characters of a text file read at a time."""

ROWS_PER_READ = 1024
"""Rows of a table read at a time."""


def is_held_out_file(path: Path) -> bool:
    """Whether ``path``'s name says it holds a held-out split (``val.bin``, ``validation-00000.parquet``)."""
    name = path.name.lower()
    for suffix in path.suffixes:
        name = name.removesuffix(suffix.lower())
    return HELD_OUT_NAME.search(name) is not None


@dataclass(frozen=True)
class Source:
    """One ``--dataset``: its kind, its files and how its documents are read."""

    kind: SourceKind
    """What the input is (see the module doc)."""
    name: str
    """``--dataset`` as given."""
    files: tuple[Path, ...] = ()
    """Training files, in reading order (none for kjv and hub)."""
    held_out_files: tuple[Path, ...] = ()
    """Files named like a held-out split (tables and token shards only)."""
    text_column: str | None = None
    """The column whose values are the documents (tables)."""
    options: dict = field(default_factory=dict)
    """chunk_chars (text), max_chars (hub), token_dtype (tokens)."""

    def identity(self) -> dict:
        """What identifies this input on disk (keys the prepared cache): kind, files with size and modification
        time, text column, chunk size."""
        paths = self.files + self.held_out_files
        if self.kind == "saved":  # the folder's files (its own times change only when entries come and go)
            paths = tuple(sorted(p for p in self.files[0].rglob("*") if p.is_file()))
        files = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]
        ident = {"kind": self.kind, "name": self.name, "files": files, "text_column": self.text_column,
                 **self.options}
        if self.kind == "kjv":
            path = kjv_path()
            ident["files"] = [[str(path), path.stat().st_size, path.stat().st_mtime_ns]]
        return ident

    def progress_total(self) -> tuple[int | None, str]:
        """(the progress bar's total, its unit): input bytes for text, JSON and Arrow files, rows for Parquet and
        ``save_to_disk`` folders (from their metadata), chapters for the Bible; unknown for a hub stream."""
        if self.kind == "kjv":
            return 1189, "docs"  # the Bible's chapters: one document each
        if self.kind in ("text", "json", "arrow", "tokens"):
            return sum(p.stat().st_size for p in self.files + self.held_out_files), "B"
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            return sum(pq.ParquetFile(p).metadata.num_rows for p in self.files + self.held_out_files), "rows"
        if self.kind == "saved":
            datasets = _datasets()
            loaded = datasets.load_from_disk(str(self.files[0]))
            return sum(loaded.num_rows.values()) if isinstance(loaded, dict) else loaded.num_rows, "rows"
        return None, "docs"

    def total_bytes(self) -> int | None:
        """Bytes of the input files (the default tokenizer's sampling stride is chosen from it), when known."""
        if self.kind in ("text", "json", "parquet", "arrow", "saved", "tokens"):
            paths = self.files + self.held_out_files
            if self.kind == "saved":
                paths = tuple(p for p in self.files[0].rglob("*.arrow"))
            return sum(p.stat().st_size for p in paths)
        return None

    def documents(self, held_out: bool = False) -> Iterator[tuple[str, int]]:
        """``(document, position)`` in a fixed order, the position in :meth:`progress_total`'s unit; ``held_out``:
        the held-out files' (or the held-out split's) instead."""
        if self.kind == "kjv":
            if held_out:
                return iter(())
            return ((doc, i + 1) for i, doc in enumerate(kjv_chapters()))
        if self.kind == "text":
            return _text_documents(self.held_out_files if held_out else self.files, self.options["chunk_chars"])
        if self.kind in ("json", "parquet", "arrow"):
            files = self.held_out_files if held_out else self.files
            # held-out files are read after the training ones: their positions go on from the training total
            start = sum(p.stat().st_size for p in self.files) if held_out and self.kind != "parquet" else 0
            if held_out and self.kind == "parquet":
                start = self.progress_total()[0] - sum(_parquet_rows(p) for p in self.held_out_files)
            return _table_documents(self, files, start)
        if self.kind == "saved":
            return _saved_documents(self, held_out)
        if self.kind == "hub":
            return _hub_documents(self, held_out)
        raise ValueError(f"--dataset {self.name}: token shards have no documents to read")


def resolve_source(dataset: str, text_column: str | None = None, *, chunk_chars: int = 4000,
                   max_chars: int = 50_000_000, token_dtype: str = "uint16") -> Source:
    """The :class:`Source` of ``--dataset`` (``ValueError``, one line, when it cannot be read as one)."""
    if dataset == DEFAULT_DATASET:
        _no_column(text_column, dataset, "the embedded Bible")
        return Source("kjv", dataset)
    path = Path(dataset).expanduser()
    if not path.exists():
        if looks_like_path(dataset):
            raise ValueError(f"--dataset: no such file or folder: {dataset}")
        return Source("hub", dataset, text_column=text_column, options={"max_chars": max_chars})
    if path.is_dir() and (path / PREPARED_INDEX).is_file():
        from .shards import read_index

        try:
            read_index(path)
        except ValueError as e:  # cut short (a prepare killed mid-write, a partial copy): not a dataset to train on
            raise ValueError(f"{str(e).rstrip('.')}; the folder is not a usable prepared dataset: prepare it again "
                             "from its source (quietsync prepare --dataset SOURCE --out FOLDER)") from None
        raise ValueError(f"--dataset {dataset} is already prepared (it holds {PREPARED_INDEX}): train on it as it is")
    if path.is_dir() and (path / PREPARE_STATE).is_file():  # its shards and JSON would read as mixed kinds
        raise UnfinishedPrepare(path, dataset)
    if path.is_dir() and any((path / name).is_file() for name in ("dataset_info.json", "state.json",
                                                                  "dataset_dict.json")):
        return Source("saved", dataset, (path,), text_column=text_column)
    files = _files_of(path, dataset)
    kinds = sorted({_kind_of(p) for p in files})
    if len(kinds) > 1:
        counts = ", ".join(f"{sum(_kind_of(p) == k for p in files)} {k}" for k in kinds)
        raise ValueError(f"--dataset {dataset} mixes kinds of files ({counts}): point it at one kind")
    kind = kinds[0]
    # text is always split every k-th document, whatever its files are called
    if kind == "text":
        _no_column(text_column, dataset, "text files")
        return Source("text", dataset, tuple(files), options={"chunk_chars": chunk_chars})
    held = tuple(p for p in files if is_held_out_file(p))
    train = tuple(p for p in files if p not in held)
    if not train:
        raise ValueError(f"--dataset {dataset}: every file is named like a held-out split "
                         f"({', '.join(p.name for p in held[:3])}); training files are needed too")
    if kind == "tokens":
        _no_column(text_column, dataset, "token shards")
        if token_dtype not in ("uint16", "uint32"):
            raise ValueError(f"--token-dtype must be uint16 or uint32, got {token_dtype!r}")
        return Source("tokens", dataset, train, held, options={"token_dtype": token_dtype})
    return Source(kind, dataset, train, held, text_column=text_column)


class UnfinishedPrepare(ValueError):
    """``--dataset`` names the folder of an interrupted prepare: its journal, no index (one line; ``quietsync
    prepare`` adds the command that finishes it, from the journal)."""

    def __init__(self, folder: Path, dataset: str) -> None:
        self.folder, self.dataset = folder, dataset
        self.what = (f"--dataset {dataset} is an unfinished quietsync prepare (it holds {PREPARE_STATE} and no "
                     f"{PREPARED_INDEX} yet: it was interrupted)")
        super().__init__(f"{self.what}: run the prepare that wrote it again (it resumes where it stopped), then "
                         "train on it")


def _no_column(text_column: str | None, dataset: str, what: str) -> None:
    if text_column is not None:
        raise ValueError(f"--text-column is for tables (JSONL, Parquet, Arrow, datasets folders, hub datasets); "
                         f"--dataset {dataset} is {what}")


def _kind_of(path: Path) -> SourceKind:
    """The kind of an input file from its suffix; a suffix of no known kind is text (a file given by name)."""
    return SUFFIXES.get(path.suffix.lower(), "text")


def _files_of(path: Path, dataset: str) -> list[Path]:
    """The input files of a file or folder given as ``--dataset``: a file of any name (an unknown suffix is text:
    :func:`_kind_of`), or a folder's files of the known suffixes but for :data:`NOT_DATA`, recursively, sorted."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                   and not p.name.startswith(".") and p.name.lower() not in NOT_DATA)
    if not files:
        raise ValueError(f"--dataset folder {dataset} holds no {', '.join(SUFFIXES)} files")
    return files


# ---------------------------------------------------------------------------------------------------- text


def _text_documents(files: tuple[Path, ...], chunk_chars: int) -> Iterator[tuple[str, int]]:
    """The chunks of each file in turn (see :func:`stream_chunks`), with the bytes of the files read so far."""
    done = 0
    for file in files:
        size = file.stat().st_size
        with open(file, encoding="utf-8", errors="replace") as f:
            for chunk in stream_chunks(f, chunk_chars):
                yield chunk, done + min(size, f.buffer.tell())
        done += size


def stream_chunks(f, chunk_chars: int) -> Iterator[str]:
    """:func:`~quietsync.data.corpus.chunk_text` of the text file ``f``, reading :data:`READ_BLOCK` characters
    at a time: the same chunks, whatever the file's size.

    Lines are cut by ``str.splitlines`` as in ``chunk_text``; the last piece of a block may be an unfinished
    line, so it is carried over to the next block (in text mode every line boundary is one character, so a
    boundary is never split between blocks)."""
    current: list[str] = []
    size = 0
    carry = ""
    while True:
        block = f.read(READ_BLOCK)
        if not block:
            break
        lines = (carry + block).splitlines(keepends=True)
        carry = lines.pop() if lines else ""
        for line in lines:
            current.append(line)
            size += len(line)
            if size >= chunk_chars:
                chunk = "".join(current)
                if chunk.strip():
                    yield chunk
                current, size = [], 0
    if carry:
        current.append(carry)
    if current:
        chunk = "".join(current)
        if chunk.strip():
            yield chunk


# --------------------------------------------------------------------------------------------------- tables


def _stream_table(kind: SourceKind, files: tuple[Path, ...]):
    """The files as one ``datasets.IterableDataset`` (the library's own readers, streamed)."""
    datasets = _datasets()
    builder = {"json": "json", "parquet": "parquet", "arrow": "arrow"}[kind]
    # a plain list of data_files lands in the library's "train" split
    return datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train", streaming=True)


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ValueError("--dataset: JSONL, Parquet and Arrow files need the datasets package "
                         "(pip install 'quietsync[train]')") from None
    datasets.disable_progress_bars()  # prepare's own bar is the one on stderr
    # its error logs repeat what it raises, which reaches the user as one line
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    return datasets


def text_column_of(ds, text_column: str | None, dataset: str) -> str:
    """The text column of a ``datasets`` table: ``text_column`` if given (it must hold strings), else ``text``,
    else the only string column. ``ValueError`` (one line) naming ``--text-column`` otherwise."""
    features = ds.features
    if features is None:  # a stream whose features are unknown: judged by its first row
        first = next(iter(ds), None)
        if first is None:
            raise ValueError(f"--dataset {dataset} holds no rows")
        types = {name: ("string" if isinstance(v, str) else type(v).__name__) for name, v in first.items()}
    else:
        types = {name: _feature_type(f) for name, f in features.items()}
    strings = [n for n, t in types.items() if t in ("string", "large_string")]
    if text_column is not None:
        if text_column not in types:
            raise ValueError(f"--text-column {text_column} is not a column of --dataset {dataset} "
                             f"(columns: {', '.join(types)})")
        if text_column not in strings:
            raise ValueError(f"--text-column {text_column} of --dataset {dataset} holds {types[text_column]}, not "
                             f"text (text columns: {', '.join(strings) or 'none'})")
        return text_column
    if "text" in strings:
        return "text"
    if len(strings) == 1:
        return strings[0]
    if not strings:
        raise ValueError(f"--dataset {dataset} has no text column (columns: "
                         f"{', '.join(f'{n} ({t})' for n, t in types.items())})")
    raise ValueError(f"--dataset {dataset} has several text columns ({', '.join(strings)}): choose one with "
                     "--text-column")


def _feature_type(feature) -> str:
    dtype = getattr(feature, "dtype", None)
    return str(dtype) if dtype is not None else type(feature).__name__


def _parquet_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def _table_documents(source: Source, files: tuple[Path, ...], start: int) -> Iterator[tuple[str, int]]:
    """Non-blank values of the text column of ``files``, with the position after each (rows for Parquet, else
    characters of text, which track the bytes of JSON and Arrow files)."""
    if not files:
        return
    ds = _stream_table(source.kind, files)
    column = text_column_of(ds, source.text_column, source.name)
    yield from _rows(ds.select_columns([column]), column, start, by_rows=source.kind == "parquet")


def _rows(ds, column: str, start: int = 0, by_rows: bool = True) -> Iterator[tuple[str, int]]:
    """Non-blank string values of ``column``, :data:`ROWS_PER_READ` rows at a time, with the position after each
    (rows, or characters when not ``by_rows``); a non-string value is refused naming ``--text-column``."""
    position = start
    for batch in ds.iter(batch_size=ROWS_PER_READ):
        for text in batch[column]:
            if by_rows:
                position += 1  # every row, blank or not: the total is the files' row count
            if text is None:
                continue
            if not isinstance(text, str):
                raise ValueError(f"--text-column {column} holds {type(text).__name__} values, not text")
            if not by_rows:
                position += len(text)
            if text.strip():
                yield text, position


def _saved_documents(source: Source, held_out: bool) -> Iterator[tuple[str, int]]:
    datasets = _datasets()
    loaded = datasets.load_from_disk(str(source.files[0]))
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        held = next((s for s in ("validation", "valid", "dev", "test") if s in loaded), None)
        if held_out:
            if held is None:
                return
            ds = loaded[held]
        else:
            ds = loaded["train"] if "train" in loaded else loaded[next(n for n in names if n != held)]
    else:
        if held_out:
            return
        ds = loaded
    column = text_column_of(ds, source.text_column, source.name)
    start = 0
    if held_out:  # read after the training split
        start = (loaded["train"] if "train" in loaded else loaded[next(n for n in loaded if n != held)]).num_rows
    yield from _rows(ds.select_columns([column]), column, start)


def saved_has_held_out(source: Source) -> bool:
    """Whether a ``save_to_disk`` folder is a ``DatasetDict`` with a validation/test split."""
    datasets = _datasets()
    loaded = datasets.load_from_disk(str(source.files[0]))
    return isinstance(loaded, datasets.DatasetDict) and any(s in loaded for s in ("validation", "valid", "dev",
                                                                                   "test"))


# ------------------------------------------------------------------------------------------------------- hub


HUB_PROBE_S = 10.0
"""Seconds the hub's endpoint may take to answer :func:`hub_unreachable`'s one request."""

OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
"""Variables that put the Hugging Face libraries in offline mode (they then answer from their caches, at once)."""


def only_a_path(name: str) -> bool:
    """Whether a ``--model``/``--tokenizer`` name can only be a local path: no valid hub repo id (``./x``, ``~/x``,
    ``a/b/c``, ``/abs``), or ``owner/name`` whose ``owner`` is a local folder."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return "/" in name and Path(name).parent.is_dir()


@functools.cache
def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached from here (one line), or None: one HEAD of its endpoint, no
    retries, through ``huggingface_hub``'s own client (so ``HF_ENDPOINT``, proxies and a custom client count as they
    do for the real requests). Without it a name that is no local path and no reachable dataset was tried with 5
    retries, 25 s of back-off, before failing. Asked once per process; not in offline mode."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE or any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
                                       for v in OFFLINE_VARS):
        return None
    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_S)
    except Exception as e:  # any request that gets no answer (DNS, refused, timeout, TLS): the hub's would not
        reason = " ".join(str(e).split()) or "no answer"
        return f"{constants.ENDPOINT} cannot be reached ({type(e).__name__}: {reason})"
    return None


def hub_splits(source: Source):
    """The streamed splits of a hub dataset (``owner/name`` or ``name:config``); a name the hub cannot answer for
    is refused (``ValueError``, one line) saying it is no local path either."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--dataset {source.name!r} is neither 'kjv' nor an existing path; hub datasets need "
                         "`pip install datasets` and a network") from None
    # the user may have meant a local path: a mistyped one lands here too
    missing = f"--dataset {source.name}: no file or folder of that name here ({os.getcwd()})"
    unreachable = hub_unreachable()
    if unreachable is not None:
        raise ValueError(f"{missing}, and the Hugging Face hub, where such a name is looked up as a dataset, "
                         f"{unreachable}")
    path, _, config = source.name.partition(":")
    try:
        return datasets.load_dataset(path, config or None, streaming=True)
    except (ConnectionError, FileNotFoundError) as e:  # DatasetNotFoundError is a FileNotFoundError
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"{missing}, nor a hub dataset that can be read ({reason})") from None


def _hub_documents(source: Source, held_out: bool) -> Iterator[tuple[str, int]]:
    splits = hub_splits(source)
    if held_out:
        name = next((s for s in ("validation", "test") if s in splits), None)
        if name is None:
            return
        split = splits[name]
    else:
        split = splits["train"] if "train" in splits else next(iter(splits.values()))
    column = text_column_of(split, source.text_column, source.name)
    total = 0
    for text, position in _rows(split, column):
        yield text, position
        total += len(text)
        if total >= source.options["max_chars"]:
            return


def hub_has_held_out(source: Source) -> bool:
    """Whether the hub dataset has a validation or test split."""
    return any(s in hub_splits(source) for s in ("validation", "test"))


def cpu_count() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))  # not os.cpu_count(): taskset or a cpuset may allow fewer
    except AttributeError:  # pragma: no cover (not Linux)
        return os.cpu_count() or 1
