"""Prepared token shards: the folder ``quietsync prepare`` writes and every worker memory-maps.

A prepared folder::

    DIR/index.json          what the folder holds (below); written last, so a folder without it is not prepared
    DIR/tokenizer.json      the tokenizer the ids come from
    DIR/train-00000.bin     token ids, little-endian uint16 (a vocabulary of at most 65 536) or uint32:
    DIR/eval-00000.bin      the split's documents back to back, each followed by the end-of-text id (nanoGPT's
                            layout: ``np.memmap(path, dtype, mode="r")`` reads one)

``index.json`` (format ``quietsync-tokens``, version 1)::

    {"format": "quietsync-tokens", "version": 1, "dtype": "uint16", "eos": 0, "vocab_size": 4096,
     "tokenizer": {"fingerprint": "…", "about": "byte-level BPE trained on …"},
     "source": {…what was read…}, "split": "every 50th document held out",
     "splits": {"train": {"documents": 1166, "tokens": 1093521,
                          "shards": [{"path": "train-00000.bin", "offset": 0, "tokens": 1093521, "bytes": 2187042}]},
                "eval": {…}},
     "prepare": {"seconds": 4.1, "tokens_per_s": …, "workers": 2}}

A shard's ``path`` is relative to the folder, or absolute for pre-tokenized files used where they are;
``offset`` is the byte where its first token starts (an ``.npy`` header, or a held-out tail cut from a file) and
``bytes`` the file's size when it was indexed (checked at every open).

:func:`open_prepared` reads the index and maps each split as one :class:`TokenShards`: the concatenation of its
shards, read-only, shared through the page cache by every worker of a machine, so a worker's resident memory does
not grow with the corpus (only the pages its windows touch are mapped in, and they are the page cache's).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "quietsync-tokens"
"""``index.json``'s ``format``."""

VERSION = 1
"""``index.json``'s ``version``."""

INDEX = "index.json"
"""The index file of a prepared folder."""

TOKENIZER = "tokenizer.json"
"""The tokenizer file of a prepared folder."""

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""Token dtypes of a shard, little-endian."""


def token_dtype(vocab_size: int) -> str:
    """The smallest shard dtype that holds every id of a ``vocab_size`` vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"  # ids run to vocab_size - 1: 65 536 entries fit uint16


def dtype_problem(dtype: str, vocab_size: int) -> str | None:
    """Why ``dtype`` cannot hold a ``vocab_size`` vocabulary (one line), or None."""
    if vocab_size > int(np.iinfo(DTYPES[dtype]).max) + 1:
        return (f"{dtype} token ids cannot hold a vocabulary of {vocab_size} (at most "
                f"{int(np.iinfo(DTYPES[dtype]).max) + 1}): uint32 is needed")
    return None


def tokenizer_fingerprint(tokenizer) -> str:
    """A digest of what decides a ``tokenizers.Tokenizer``'s ids: its model (vocabulary, merges), normalizer,
    pre-tokenizer, post-processor and added tokens (not its decoder, padding or truncation). A post-processor that
    adds nothing to a single sequence (the template ``$A`` without special tokens, which transformers' tokenizer
    classes add to a tokenizer that has none) counts as none: the ids are the same."""
    return _fingerprint(json.loads(tokenizer.to_str()), as_written=False)


def tokenizer_fingerprints(tokenizer) -> tuple[str, str]:
    """:func:`tokenizer_fingerprint`, and the digest of the post-processor as written (what folders prepared before
    the no-op template counted as none hold)."""
    spec = json.loads(tokenizer.to_str())
    return _fingerprint(spec, as_written=False), _fingerprint(spec, as_written=True)


def _fingerprint(spec: dict[str, Any], as_written: bool) -> str:
    kept = {k: spec.get(k) for k in ("model", "normalizer", "pre_tokenizer", "post_processor")}
    if not as_written and _adds_nothing(kept["post_processor"]):
        kept["post_processor"] = None
    # sorted: the same tokens listed in another order give the same ids
    kept["added_tokens"] = sorted((t["id"], t["content"], bool(t.get("special"))) for t in spec.get("added_tokens", []))
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def _adds_nothing(post: Any) -> bool:
    """Whether a post-processor leaves a single sequence's ids as they are (documents are encoded one at a time)."""
    if not isinstance(post, dict) or post.get("type") != "TemplateProcessing" or post.get("special_tokens"):
        return False
    single = post.get("single") or []
    return len(single) == 1 and single[0].get("Sequence", {}).get("id") == "A"


FOLIO_BYTES = 2 << 20
"""The largest block of page cache the kernel maps at one fault (a PMD-sized folio); windows are let go of in
aligned blocks of this size."""


class TokenShards:
    """One split's token ids: its shards, mapped read-only, as one sequence (a window may span two shards).

    A page a window touched stays mapped into the process until released — and the kernel maps page-cache pages in
    large folios (up to 2 MB per fault on this machine's kernel), so a few hundred random windows would map most of
    a shard. Those pages count in the process's resident memory although they are the page cache's: shared with
    every other worker, dropped by the kernel under pressure. :meth:`windows` therefore lets go of them as soon as
    it has copied a window out (``MADV_DONTNEED`` on the aligned 2 MB around it: the page cache keeps the pages, a
    later read maps them back), so a
    worker's resident memory stays where it started however long it runs (nanoGPT re-creates its ``np.memmap``
    every batch for the same reason)."""

    def __init__(self, arrays: list[np.ndarray], maps: list[tuple[mmap.mmap, int] | None] | None = None) -> None:
        maps = list(maps) if maps is not None else [None] * len(arrays)
        kept = [(a, m) for a, m in zip(arrays, maps) if a.size]
        self.arrays = [a for a, _ in kept]
        self.maps = [m for _, m in kept]
        """Each array's mapping and the byte its first id is at (None: not mapped)."""
        lengths = [int(a.size) for a in self.arrays]
        self.bounds = np.cumsum([0, *lengths], dtype=np.int64)
        """Start of each shard in the sequence, and its length at the end."""

    def release(self) -> None:
        """Unmap every page read so far (they stay in the page cache)."""
        for m in {id(m[0]): m[0] for m in self.maps if m is not None}.values():
            if hasattr(m, "madvise"):
                m.madvise(mmap.MADV_DONTNEED)

    def _release_window(self, shard: int, first: int, length: int) -> None:
        """Unmap the pages around ids ``[first, first + length)`` of ``shard`` (whole :data:`FOLIO_BYTES` regions:
        the kernel maps a large folio at once)."""
        where = self.maps[shard]
        if where is None or not hasattr(where[0], "madvise"):
            return
        m, offset = where
        itemsize = self.arrays[shard].itemsize
        lo = (offset + first * itemsize) // FOLIO_BYTES * FOLIO_BYTES
        hi = min(len(m), -(-(offset + (first + length) * itemsize) // FOLIO_BYTES) * FOLIO_BYTES)
        m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def numel(self) -> int:
        """Tokens in the split."""
        return int(self.bounds[-1])

    def __len__(self) -> int:
        return self.numel()

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the sequence (a copy, in the shards' dtype)."""
        if not 0 <= start <= stop <= self.numel():
            raise IndexError(f"tokens [{start}, {stop}) are outside the split's {self.numel()}")
        # side="right": a start on a boundary belongs to the shard that begins there
        first = int(np.searchsorted(self.bounds, start, side="right")) - 1
        parts = []
        while start < stop:
            a, lo = self.arrays[first], int(self.bounds[first])
            take = min(stop, lo + a.size) - start
            parts.append(a[start - lo : start - lo + take])
            start += take
            first += 1
        return np.concatenate(parts) if len(parts) != 1 else parts[0].copy()

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """``[len(starts), length]`` int64 ids: the windows starting at ``starts``, as ``tokens[starts[:, None] +
        arange(length)]`` of the whole split in memory gives them."""
        starts_np = starts.numpy() if isinstance(starts, torch.Tensor) else np.asarray(starts)
        shard = np.searchsorted(self.bounds, starts_np, side="right") - 1
        out = np.empty((starts_np.size, length), dtype=np.int64)
        spans = False
        for i, (s, k) in enumerate(zip(starts_np.tolist(), shard.tolist())):
            lo = int(self.bounds[k])
            if s + length <= lo + self.arrays[k].size:
                out[i] = self.arrays[k][s - lo : s - lo + length]
                self._release_window(k, s - lo, length)
            else:
                out[i] = self.read(s, s + length)
                spans = True
        # read() lets go of nothing it touched: release every mapping's pages
        if spans:
            self.release()
        return torch.from_numpy(out)

    def to_tensor(self) -> torch.Tensor:
        """The whole split in memory as int64 (what every worker held before the shards were mapped)."""
        tokens = torch.from_numpy(self.read(0, self.numel()).astype(np.int64))
        self.release()  # every page was touched; the tensor is a copy
        return tokens


@dataclass(frozen=True)
class Prepared:
    """A prepared folder, opened: its index and its two splits, mapped."""

    folder: Path
    """The folder."""
    index: dict[str, Any]
    """``index.json``."""
    train: TokenShards
    """The training split."""
    eval: TokenShards
    """The held-out split."""

    @property
    def eos(self) -> int:
        """The end-of-text id."""
        return int(self.index["eos"])

    @property
    def vocab_size(self) -> int:
        """Entries of the tokenizer's vocabulary."""
        return int(self.index["vocab_size"])

    @property
    def fingerprint(self) -> str:
        """The tokenizer's fingerprint (:func:`tokenizer_fingerprint`)."""
        return str(self.index["tokenizer"]["fingerprint"])

    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` the ids come from."""
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.folder / TOKENIZER))


def is_prepared(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a prepared dataset's index."""
    path = Path(folder) / INDEX
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):  # AttributeError: JSON that is not an object
        return False


def read_index(folder: str | os.PathLike) -> dict[str, Any]:
    """``index.json`` of a prepared folder, checked (``ValueError``, one line, naming what is wrong)."""
    folder = Path(folder)
    path = folder / INDEX
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--dataset {folder}: cannot read {INDEX} ({type(e).__name__}: {e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"--dataset {folder}: {INDEX} is not a quietsync prepared index")
    if index.get("version") != VERSION:
        raise ValueError(f"--dataset {folder}: index version {index.get('version')} is not {VERSION}: prepare it "
                         "again with this quietsync")
    if index.get("dtype") not in DTYPES:
        raise ValueError(f"--dataset {folder}: index dtype {index.get('dtype')!r} is not uint16 or uint32")
    problem = dtype_problem(index["dtype"], int(index["vocab_size"]))
    if problem:
        raise ValueError(f"--dataset {folder}: {problem}")
    if not (folder / TOKENIZER).is_file():
        raise ValueError(f"--dataset {folder}: {TOKENIZER} is missing")
    return index


def shard_path(folder: Path, entry: dict[str, Any]) -> Path:
    """Where a shard of the index lives."""
    path = Path(entry["path"])
    return path if path.is_absolute() else folder / path


def map_file(path: Path) -> mmap.mmap:
    """``path`` mapped read-only, random access advised (windows are read at random: no read-ahead)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # outlives the file: mmap keeps its own descriptor
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return mapped


def map_shard(path: Path, dtype: np.dtype, offset: int, tokens: int, mapped: mmap.mmap | None = None) -> np.ndarray:
    """``tokens`` ids of ``dtype`` from byte ``offset`` of ``path`` (or of its mapping ``mapped``), read-only."""
    if tokens == 0:  # nothing to map (and mmap refuses an empty file)
        return np.empty(0, dtype=dtype)
    return np.frombuffer(mapped if mapped is not None else map_file(path), dtype=dtype, count=tokens, offset=offset)


def _checked_shard(folder: Path, entry: dict[str, Any], dtype: np.dtype) -> Path:
    """The path of a shard of the index, there and of the size the index gives (``ValueError``, one line)."""
    path = shard_path(folder, entry)
    offset, tokens = int(entry["offset"]), int(entry["tokens"])
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ValueError(f"--dataset {folder}: shard {path} is missing: prepare it again") from None
    if size != int(entry["bytes"]) or offset + tokens * dtype.itemsize > size:
        raise ValueError(f"--dataset {folder}: shard {path} is {size} bytes, the index says {entry['bytes']} "
                         "(changed or truncated since it was prepared): prepare it again")
    return path


def check_shards(folder: str | os.PathLike, index: dict[str, Any]) -> None:
    """Every shard ``index`` lists is there, of the size it gives (``ValueError``, one line): one ``stat`` per
    shard, no token read, so the launcher can refuse a damaged folder before any worker starts."""
    dtype = DTYPES[index["dtype"]]
    for split in index["splits"].values():
        for entry in split["shards"]:
            _checked_shard(Path(folder), entry, dtype)


def _open_split(folder: Path, index: dict[str, Any], split: str) -> TokenShards:
    dtype = DTYPES[index["dtype"]]
    arrays = []
    maps: dict[Path, mmap.mmap] = {}
    where: list[tuple[mmap.mmap, int]] = []
    for entry in index["splits"][split]["shards"]:
        path = _checked_shard(folder, entry, dtype)
        offset, tokens = int(entry["offset"]), int(entry["tokens"])
        if tokens:
            if path not in maps:
                maps[path] = map_file(path)
            arrays.append(map_shard(path, dtype, offset, tokens, maps[path]))
            where.append((maps[path], offset))
    return TokenShards(arrays, where)


def open_prepared(folder: str | os.PathLike) -> Prepared:
    """Map a prepared folder (``ValueError``, one line, for a folder that is not one or whose shards changed)."""
    folder = Path(folder)
    index = read_index(folder)
    return Prepared(folder, index, _open_split(folder, index, "train"), _open_split(folder, index, "eval"))


IDENTITY_SAMPLES = 9
"""Places of each split whose ids :func:`data_identity` digests (its start, its end and evenly between)."""

IDENTITY_SAMPLE_TOKENS = 1024
"""Ids digested at each place."""


def data_identity(prepared: Prepared) -> dict[str, Any]:
    """What the ids of a prepared folder are, cheaply (a resumed run checks it is given the data it trained on):
    each split's length and :data:`IDENTITY_SAMPLES` runs of :data:`IDENTITY_SAMPLE_TOKENS` ids spread over it,
    with the tokenizer's fingerprint — a few kilobytes read whatever the corpus's size. Not the shard layout or the
    index's times: the same data prepared again, or cut into other shards, is the same data.

    Returns ``{"digest", "tokenizer", "train_tokens", "eval_tokens"}``."""
    h = hashlib.sha256(prepared.fingerprint.encode("utf-8"))
    sizes = {}
    for name, split in (("train", prepared.train), ("eval", prepared.eval)):
        n = split.numel()
        sizes[name] = n
        h.update(f"{name}:{n};".encode())
        span = min(n, IDENTITY_SAMPLE_TOKENS)
        for i in range(IDENTITY_SAMPLES if span else 0):
            start = (n - span) * i // (IDENTITY_SAMPLES - 1)
            # int64: the same ids give the same digest whether the shards hold uint16 or uint32
            h.update(split.read(start, start + span).astype("<i8").tobytes())
        split.release()
    return {"digest": h.hexdigest()[:24], "tokenizer": prepared.fingerprint, "train_tokens": sizes["train"],
            "eval_tokens": sizes["eval"]}
