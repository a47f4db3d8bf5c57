"""Pre-tokenized shards given as ``--dataset`` (``.bin`` of nanoGPT's layout, or ``.npy``; uint16 or uint32): indexed
where they are, nothing copied.

:func:`index_token_files` checks each file (a whole number of ids; a ``.npy`` 1-D, unsigned, little-endian; uint16
files whose every other id is 0 named as uint32 read as uint16), that the dtype holds the tokenizer's vocabulary,
and that every id is below it (a pass over the ids in blocks of 16 M) — ids from another tokenizer are refused by
name. The held-out split is the files named like one (``val.bin``), else the last ``eval_fraction`` of the tokens.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np

from .shards import DTYPES, dtype_problem, map_file, map_shard


class TokenFileError(ValueError):
    """Token files that cannot be used as asked (one line, naming the flag)."""


def _token_file(path: Path, bin_dtype: str) -> tuple[np.dtype, int, int]:
    """(dtype, byte offset of the first id, ids) of a ``.bin`` or ``.npy`` token file."""
    if path.suffix.lower() == ".npy":
        try:
            mapped = np.load(path, mmap_mode="r")
        except ValueError as e:
            raise TokenFileError(f"--dataset: {path} is not a readable .npy file ({e})") from None
        dtype, shape = mapped.dtype, mapped.shape
        if len(shape) != 1 or dtype.kind != "u" or dtype.itemsize not in (2, 4) or dtype.byteorder == ">":
            raise TokenFileError(f"--dataset: {path} holds {dtype.str} of shape {shape}; token shards are 1-D "
                          "little-endian uint16 or uint32")
        return DTYPES["uint16" if dtype.itemsize == 2 else "uint32"], int(mapped.offset), int(shape[0])
    dtype = DTYPES[bin_dtype]
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise TokenFileError(f"--dataset: {path} is {size} bytes, not a whole number of {bin_dtype} ids "
                             "(--token-dtype)")
    return dtype, 0, size // dtype.itemsize


def index_token_files(train_files: tuple[Path, ...], held_out_files: tuple[Path, ...], bin_dtype: str, vocab: int,
                      tokenizer: str, eval_fraction: float) -> tuple[str, dict[str, list[dict[str, Any]]], str]:
    """(dtype, the index entries of each split, how the split was made) of pre-tokenized files, after checking
    them against the tokenizer's ``vocab`` (:class:`TokenFileError`, one line, otherwise)."""
    dtypes = set()
    entries: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    for split, paths in (("train", train_files), ("eval", held_out_files)):
        for path in paths:
            dtype, offset, count = _token_file(path, bin_dtype)
            if count == 0:
                raise TokenFileError(f"--dataset: {path} holds no token ids (an empty file): remove it or write it "
                                     "again")
            name = "uint16" if dtype.itemsize == 2 else "uint32"
            dtypes.add(name)
            problem = dtype_problem(name, vocab)
            if problem:
                raise TokenFileError(f"--dataset {path}: {problem} (--tokenizer {tokenizer})")
            _check_ids(path, dtype, offset, count, vocab, name, tokenizer)
            # absolute: the files stay where they are, outside the prepared folder
            entries[split].append({"path": str(path.resolve()), "offset": offset, "tokens": count,
                                   "documents": None, "bytes": path.stat().st_size})
    if len(dtypes) > 1:  # the index holds one dtype for every shard
        raise TokenFileError(f"--dataset {train_files[0].parent} mixes uint16 and uint32 files")
    dtype = dtypes.pop()
    if entries["eval"]:
        return dtype, entries, "the input's held-out files"
    return (dtype, _cut_tail(entries["train"], eval_fraction, DTYPES[dtype].itemsize),
            f"the last {eval_fraction:g} of the tokens held out (--eval-fraction)")


def _check_ids(path: Path, dtype: np.dtype, offset: int, count: int, vocab: int, name: str, tokenizer: str) -> None:
    """Every id of the file is below ``vocab`` (read in blocks); a uint32 file read as uint16 is named."""
    mapped = map_file(path)
    ids = map_shard(path, dtype, offset, count, mapped)
    if name == "uint16" and path.suffix.lower() == ".bin" and count >= 64:
        head = ids[: min(count, 1 << 16)]
        # uint32 ids below 65 536 read as little-endian uint16: every other one is a zero high half
        if not head[1::2].any() and head[0::2].any():
            raise TokenFileError(f"--dataset {path}: every other uint16 id is 0, as uint32 ids read as uint16 "
                                 "are: --token-dtype uint32")
    block = 1 << 24
    for start in range(0, count, block):
        top = int(ids[start : start + block].max())
        mapped.madvise(mmap.MADV_DONTNEED)  # the pages scanned are the page cache's: do not keep them mapped
        if top >= vocab:
            raise TokenFileError(f"--dataset {path}: id {top} is outside the vocabulary of --tokenizer {tokenizer} "
                          f"({vocab} entries): the shards were made with another tokenizer")


def _cut_tail(train: list[dict[str, Any]], fraction: float, itemsize: int) -> dict[str, list[dict[str, Any]]]:
    """Hold out the last ``fraction`` of the tokens (cut from the last files)."""
    total = sum(e["tokens"] for e in train)
    held = max(1, int(total * fraction))  # never an empty held-out split, however small the fraction
    keep = total - held
    out: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    seen = 0
    for e in train:
        lo, hi = seen, seen + e["tokens"]
        if hi <= keep:
            out["train"].append(e)
        elif lo >= keep:
            out["eval"].append(e)
        else:
            # the file across the cut serves both splits: its tail is an eval entry at a later offset
            cut = keep - lo
            out["train"].append({**e, "tokens": cut})
            out["eval"].append({**e, "offset": e["offset"] + cut * itemsize, "tokens": e["tokens"] - cut})
        seen = hi
    return out


