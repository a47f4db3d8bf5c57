"""Token streams cut into fixed-length sequences, sharded across workers.

* :func:`encode_split` turns the documents of one split, held in memory, into one token stream (an end-of-text
  token after each document), cached on disk next to the tokenizer, as int64 in memory: what every worker did
  before ``quietsync prepare`` (kept for small corpora held as a :class:`~quietsync.data.corpus.Corpus`, and as
  the in-memory reference of tests and benchmarks).
* :class:`ShardedSequences` is the infinite training iterator of one worker: every epoch it draws a
  seeded random offset and permutation of the non-overlapping ``seq_len`` windows and gives worker
  ``r`` the windows ``perm[r::world_size]`` (truncated so every worker has as many), so the workers'
  shards are disjoint and depend only on ``seed``, the epoch and the world size. Its position is in
  ``state_dict()`` for exact resume. Globally the workers consume each epoch's permutation as one stream, in
  order: after ``i`` windows per worker, ``perm[:world_size * i]`` have been read. That prefix length is the
  world-size-independent position (:meth:`~ShardedSequences.logical_position`); a job resumed on another
  number of workers deals the rest of the epoch, ``perm[consumed:]``, round-robin over its workers
  (:meth:`~ShardedSequences.continue_from`).
* :func:`eval_batches` gives each worker its fixed, disjoint part of the held-out windows.

Both read a split either from memory (a 1-D int64 tensor, as :func:`encode_split` makes it) or from its prepared
shards, memory-mapped (:class:`~quietsync.data.shards.TokenShards`): the same windows give the same ids, so a
run is the same either way. What a worker holds for the data besides the mapped pages is the epoch's order of
its own windows (int32: 4 bytes per window of the epoch ÷ the number of workers) and one micro-batch.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from ..validate import check_int
from .cache import DEFAULT_CACHE_DIR, build_once
from .shards import TokenShards

Tokens = torch.Tensor | TokenShards
"""A split's token ids: in memory (1-D int64) or memory-mapped shards."""


def gather_windows(tokens: Tokens, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[len(starts), seq_len]`` int64 ids of the windows starting at ``starts``."""
    if isinstance(tokens, TokenShards):
        return tokens.windows(starts, seq_len)
    return tokens[starts[:, None] + torch.arange(seq_len)[None, :]]


def _documents_digest(documents: tuple[str, ...] | list[str]) -> str:
    h = hashlib.sha256()
    for doc in documents:
        data = doc.encode("utf-8")
        # length-prefixed: the same text cut into other documents gives another key
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def encode_documents(tokenizer, documents, eos: int) -> np.ndarray:
    """Token ids of ``documents``, each followed by ``eos``, as one 1-D array."""
    out: list[int] = []
    for enc in tokenizer.encode_batch(list(documents)):
        out.extend(enc.ids)
        out.append(eos)
    # uint16 when every id fits: half the cached file of int32
    dtype = np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.int32
    return np.asarray(out, dtype=dtype)


def token_cache_path(tokenizer, documents, eos: int, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where :func:`encode_split` caches the stream of ``documents`` (keyed by tokenizer and text)."""
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    key = hashlib.sha256(
        (tokenizer.to_str() + _documents_digest(documents) + str(eos)).encode("utf-8")
    ).hexdigest()[:24]
    return root / f"tokens-{key}.npy"


def encode_split(
    tokenizer, documents, eos: int, cache_dir: str | os.PathLike | None = None
) -> torch.Tensor:
    """The token stream of ``documents`` (cached on disk, keyed by tokenizer and text), as int64."""
    path = token_cache_path(tokenizer, documents, eos, cache_dir)

    def build(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, encode_documents(tokenizer, documents, eos))

    build_once(path, build)
    return torch.from_numpy(np.load(path).astype(np.int64))


class ShardedSequences:
    """Infinite, seeded iterator over one worker's micro-batches of ``[micro_batch_size, seq_len]`` ids."""

    def __init__(
        self,
        tokens: Tokens,
        seq_len: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        if isinstance(tokens, torch.Tensor) and tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        check_int("world_size", world_size, 1)
        check_int("rank", rank, 0, world_size - 1)
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        # one window of slack for the per-epoch random offset
        self.num_windows = (tokens.numel() - seq_len) // seq_len
        self.windows_per_rank = self.num_windows // world_size
        if self.windows_per_rank < micro_batch_size:
            raise ValueError(
                f"the training text ({tokens.numel()} tokens) is too short for {world_size} worker(s) with "
                f"micro_batch_size {micro_batch_size} and seq_len {seq_len}"
            )
        self.epoch = 0
        self.index = 0
        self.base = 0
        """Windows of this epoch's permutation consumed before this worker's windows start (non-zero only in
        the epoch a job resumed on another number of workers)."""
        self._order_epoch = -1
        self._offset = 0
        self._mine = torch.empty(0, dtype=torch.long)
        self.last_starts: tuple[int, torch.Tensor] | None = None
        """``(epoch, start offsets)`` of the windows of the latest micro-batch (the data audit reads it)."""

    def _order(self) -> None:
        if self._order_epoch == self.epoch:
            return
        # distinct (seed, epoch) pairs seed distinct streams (for epochs below 1_000_003)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        self._offset = int(torch.randint(0, self.seq_len, (1,), generator=g))
        # int32 when it fits: the same permutation as int64 (torch draws it the same way), half the memory
        dtype = torch.int32 if self.num_windows < 2**31 else torch.int64
        perm = torch.randperm(self.num_windows, generator=g, dtype=dtype)
        self._mine = perm[self.base + self.rank :: self.world_size][: self._limit()].clone()  # only this worker's
        del perm
        self._order_epoch = self.epoch

    def _limit(self) -> int:
        """Windows per worker in the current epoch (all workers get as many)."""
        return (self.num_windows - self.base) // self.world_size

    def window_starts(self) -> torch.Tensor:
        """Start offsets (in tokens) of this worker's windows in the current epoch."""
        self._order()
        return self._offset + self._mine.long() * self.seq_len

    def __iter__(self) -> ShardedSequences:
        return self

    def __next__(self) -> torch.Tensor:
        # a tail too short for a full micro-batch is dropped; base only shifts the epoch a job resumed in
        if self.index + self.micro_batch_size > self._limit():
            self.epoch += 1
            self.index = 0
            self.base = 0
        self._order()
        starts = self._offset + self._mine[self.index : self.index + self.micro_batch_size].long() * self.seq_len
        self.index += self.micro_batch_size
        self.last_starts = (self.epoch, starts)
        return gather_windows(self.tokens, starts, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        """Position in the stream (epoch and index); the rest is derived from the constructor."""
        return {"epoch": self.epoch, "index": self.index, "base": self.base, "seed": self.seed,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by :meth:`state_dict` (same seed and world size)."""
        # another world size resumes through logical_position / continue_from, not here
        if state["seed"] != self.seed or state["world_size"] != self.world_size:
            raise ValueError(
                f"data state was saved with seed {state['seed']} and world size {state['world_size']}, "
                f"now {self.seed} and {self.world_size}"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.base = int(state.get("base", 0))
        self._order_epoch = -1  # _order redraws for the loaded epoch and base

    def logical_position(self) -> tuple[int, int]:
        """``(epoch, consumed)``: windows of the epoch's permutation read by all workers together — the same
        on every worker, and meaningful for any world size."""
        return self.epoch, self.base + self.world_size * self.index

    def continue_from(self, epoch: int, consumed: int) -> None:
        """Continue after ``consumed`` windows of ``epoch``'s permutation (a :meth:`logical_position` saved by
        any number of workers): worker ``r`` reads ``perm[consumed + r :: world_size]``, so no window of the
        epoch is read twice or skipped, except the epoch's tail that does not fill one more micro-batch on
        every worker (which each world size cuts at its own place)."""
        check_int("epoch", epoch, 0)
        check_int("consumed", consumed, 0, self.num_windows)
        self.epoch, self.index, self.base = int(epoch), 0, int(consumed)
        self._order_epoch = -1


def eval_batches(
    tokens: Tokens,
    seq_len: int,
    micro_batch_size: int,
    max_windows: int,
    rank: int = 0,
    world_size: int = 1,
) -> list[torch.Tensor]:
    """This worker's part of the first ``max_windows`` held-out windows, in batches.

    Windows are non-overlapping from offset 0; worker ``r`` takes windows ``r::world_size``.
    """
    n = min((tokens.numel()) // seq_len, max_windows)  # no slack: eval windows start at 0
    if n < 1:
        raise ValueError(f"the held-out text ({tokens.numel()} tokens) is shorter than seq_len {seq_len}")
    mine = torch.arange(n)[rank::world_size]
    batches = []
    for i in range(0, mine.numel(), micro_batch_size):
        starts = mine[i : i + micro_batch_size] * seq_len
        batches.append(gather_windows(tokens, starts, seq_len))
    return batches
