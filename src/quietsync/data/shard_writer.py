"""Writing one split's token ids into shard files, resumably (the write side of :mod:`quietsync.data.shards`).

:class:`SplitWriter` appends ids to ``<split>-00000.bin``, ``-00001``, … of at most ``shard_tokens`` ids each, in the
split's dtype; :meth:`~SplitWriter.state` is what a journal records after :meth:`~SplitWriter.flush`, and
:meth:`~SplitWriter.restore` goes back to it after an interruption (shards cut to their recorded lengths, later
ones removed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .shards import DTYPES


class ShardStateError(ValueError):
    """A shard is shorter than the journal says (it cannot be resumed)."""


class SplitWriter:
    """Appends one split's ids to shards ``<split>-00000.bin``, ``-00001``, … of at most ``shard_tokens``."""

    def __init__(self, folder: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, DTYPES[dtype], shard_tokens
        self.shards: list[dict[str, Any]] = []
        """Every shard so far (the last one open): path, tokens, documents."""
        self.file = None

    @property
    def tokens(self) -> int:
        """Tokens written."""
        return sum(s["tokens"] for s in self.shards)

    @property
    def documents(self) -> int:
        """Documents written."""
        return sum(s["documents"] for s in self.shards)

    def _open_next(self) -> None:
        if self.file is not None:
            self.file.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self.shards.append({"path": name, "tokens": 0, "documents": 0})
        self.file = open(self.folder / name, "wb")

    def write(self, ids: np.ndarray, documents: int) -> None:
        """Append ``ids`` (``documents`` whole documents) to the shards."""
        ids = ids.astype(self.dtype, copy=False)
        done = 0
        while done < ids.size:
            # a shard is opened only when ids come for it: a split never ends with an empty shard
            if self.file is None or self.shards[-1]["tokens"] >= self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part = ids[done : done + room]
            part.tofile(self.file)
            self.shards[-1]["tokens"] += int(part.size)
            done += part.size
        if self.shards:
            self.shards[-1]["documents"] += documents  # counted where the documents end

    def flush(self) -> None:
        """Make what was written durable (the journal then records it)."""
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())

    def state(self) -> list[dict[str, Any]]:
        """The shards, for the journal."""
        return [dict(s) for s in self.shards]

    def restore(self, shards: list[dict[str, Any]]) -> None:
        """Go back to a journalled state: the shards cut to their recorded lengths, later ones removed."""
        self.shards = [dict(s) for s in shards]
        names = {s["path"] for s in self.shards}
        for path in self.folder.glob(f"{self.split}-*.bin"):
            if path.name not in names:
                path.unlink()
        for s in self.shards:
            path = self.folder / s["path"]
            if not path.exists() or path.stat().st_size < s["tokens"] * self.dtype.itemsize:
                raise ShardStateError(f"shard {path} is shorter than the journal records: run with --overwrite")
            os.truncate(path, s["tokens"] * self.dtype.itemsize)
        if self.shards:
            self.file = open(self.folder / self.shards[-1]["path"], "ab")  # writing goes on after the ids kept

    def close(self) -> list[dict[str, Any]]:
        """Close the open shard; return the index entries."""
        if self.file is not None:
            self.file.close()
            self.file = None
        itemsize = self.dtype.itemsize
        return [{"path": s["path"], "offset": 0, "tokens": s["tokens"], "documents": s["documents"],
                 "bytes": s["tokens"] * itemsize} for s in self.shards]


