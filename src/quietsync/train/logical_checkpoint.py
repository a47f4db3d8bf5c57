"""The world-size-independent part of a checkpoint, through ``torch.distributed.checkpoint`` (DCP).

Beside the per-worker files of a step (``OUT/checkpoints/step-N/rank{R}.pt``, exact at the same world size), a
strategy that can reshard (``Strategy.reshard_refusal is None``: ddp, zero1, fsdp, flexdemo) also writes
``step-N/logical/``, a DCP checkpoint of its logical state (:mod:`quietsync.strategies.checkpoint.logical`) plus the
job's:

* ``data.epoch``, ``data.consumed`` — the data stream's world-size-independent position
  (:meth:`~quietsync.data.sequences.ShardedSequences.logical_position`);
* ``world_size`` — the number of workers that wrote it;
* ``worker.<r>.tokens``, ``worker.<r>.micro_batches`` — each old worker's counters.

A job on another number of workers resumes from it: the model, the optimizer state (resharded by DCP), the
step and the lr schedule exactly; the data stream at the same global position, dealt over the new workers;
the per-worker counters folded (new worker ``r`` takes the sum of the old workers ``q`` with
``q mod new_world == r``, so totals are kept). Per-worker RNG states are not carried (the trainer's models have
no dropout and nothing else draws from them).

Every worker writes its own files into the one folder and reads the pieces it needs from all of them, so a
multi-node job needs a file system every node sees. The logical part is written *before* the rank files:
a step folder whose rank files are complete has a complete logical part (DCP writes ``.metadata`` last).
DCP's own collectives (planning, the final agreement) run on the transport's ``world`` process group and are
not metered. Its ``.metadata`` file is a pickle: it is read with an unpickler that only builds DCP's
metadata classes, so a crafted file cannot run code (tensor files are read with ``weights_only=True``).
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..data.sequences import ShardedSequences
from ..strategies import Strategy
from ..strategies.checkpoint.logical import ReshardError, SavedTensors

LOGICAL_DIR = "logical"
"""The DCP folder inside a step folder."""

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


def logical_folder(step_folder: str | os.PathLike) -> Path:
    """``STEP_FOLDER/logical``."""
    return Path(step_folder) / LOGICAL_DIR


def has_logical(step_folder: str | os.PathLike) -> bool:
    """Whether ``step_folder`` holds a complete logical part (its ``.metadata`` is written last)."""
    return (logical_folder(step_folder) / ".metadata").is_file()


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # torch.Size and torch dtypes: the shapes and properties of the tensors it lists
        if name in _ALLOWED.get(module, ()) or (module == "torch" and (
                name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """DCP's file-system reader whose metadata unpickler builds DCP's metadata classes and nothing else."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise ValueError(f"refusing to load checkpoint metadata {path}: {exc}") from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path} is not a torch.distributed.checkpoint metadata file")
        # as FileSystemReader.read_metadata does: the load id is carried on storage_meta
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def saved_tensors(step_folder: str | os.PathLike) -> SavedTensors:
    """``{key: (global shape, dtype)}`` of the tensors in ``step_folder``'s logical part (read safely)."""
    metadata = SafeReader(logical_folder(step_folder)).read_metadata()
    return {k: (m.size, m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}


def check_logical_files(step_folder: str | os.PathLike) -> None:
    """Check every file a load of ``step_folder``'s logical part reads: the metadata (read safely) and each
    data file it points into, which must exist and be long enough for every piece it holds. Raises
    ``ValueError`` naming the bad file (a shard cut short by a crash or a full disk would otherwise end the
    load in a bare ``EOFError`` deep inside DCP)."""
    folder = logical_folder(step_folder)
    metadata = SafeReader(folder).read_metadata()
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str) or "/" in path or path.startswith("."):
            raise ValueError(f"checkpoint metadata {folder / '.metadata'} names a data file {path!r} outside "
                             "its folder")
        need[path] = max(need.get(path, 0), int(info.offset) + int(info.length))
    for name, end in sorted(need.items()):
        path = folder / name
        if not path.is_file():
            raise ValueError(f"checkpoint file {path} is missing (its metadata lists it)")
        size = path.stat().st_size
        if size < end:
            raise ValueError(f"checkpoint file {path} is truncated: {size} bytes, its metadata needs {end}")


def logical_world(step_folder: str | os.PathLike) -> int | None:
    """How many workers wrote ``step_folder``'s logical part (None when it has no complete, readable one)."""
    if not has_logical(step_folder):
        return None
    try:
        saved = saved_tensors(step_folder)
    except (ValueError, OSError):
        return None
    return sum(1 for k in saved if k.startswith("worker.") and k.endswith(".tokens")) or None


def _group(strategy: Strategy) -> Any:
    return strategy.transport.process_group("world")


def _no_dist(strategy: Strategy) -> bool:
    return _group(strategy) is None and not strategy.transport.distributed()


@contextmanager
def _quiet_single_process(no_dist: bool) -> Iterator[None]:
    """DCP warns on every single-process save/load that it assumes one process: that is what we meant."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save_logical(step_folder: str | os.PathLike, strategy: Strategy, stream: ShardedSequences,
                 tokens_total: int) -> Path:
    """Write the logical part of a checkpoint (every worker calls it, at the same step); returns its folder.

    Raises :class:`~quietsync.strategies.checkpoint.logical.ReshardError` on every worker where the strategy cannot be
    resharded or a round is open."""
    state = strategy.logical_state_dict()
    epoch, consumed = stream.logical_position()
    rank = strategy.rank
    # the job's counters as int64 tensors: the logical part holds tensors only (docs/train.md)
    state.update({
        "data.epoch": torch.tensor(epoch, dtype=torch.int64),
        "data.consumed": torch.tensor(consumed, dtype=torch.int64),
        "world_size": torch.tensor(strategy.world_size, dtype=torch.int64),
        f"worker.{rank}.tokens": torch.tensor(tokens_total, dtype=torch.int64),
        f"worker.{rank}.micro_batches": torch.tensor(strategy.micro_batches, dtype=torch.int64),
    })
    folder = logical_folder(step_folder)
    folder.mkdir(parents=True, exist_ok=True)
    no_dist = _no_dist(strategy)
    with _quiet_single_process(no_dist):
        dcp.save(state, storage_writer=FileSystemWriter(folder), process_group=_group(strategy), no_dist=no_dist)
    return folder


def _fold(values: dict[int, int], world: int, rank: int) -> int:
    """New worker ``rank``'s share of the old workers' counters: the sum over old ``q`` with ``q % world == rank``."""
    return sum(v for q, v in values.items() if q % world == rank)


def load_logical(step_folder: str | os.PathLike, strategy: Strategy, stream: ShardedSequences) -> int:
    """Resume ``strategy`` and ``stream`` from the logical part of ``step_folder`` (every worker calls it);
    returns this worker's token count. Sets ``strategy.micro_batches`` to its folded share.

    Raises :class:`~quietsync.strategies.checkpoint.logical.ReshardError` (on every worker, before any collective) when
    the strategy cannot be resharded or the checkpoint does not fit it, ``ValueError`` when its metadata
    cannot be read safely."""
    if strategy.reshard_refusal is not None:
        raise ReshardError(f"strategy {strategy.name} cannot be resharded: {strategy.reshard_refusal}")
    folder = logical_folder(step_folder)
    if not has_logical(step_folder):
        raise ReshardError(f"{step_folder} has no complete world-size-independent part ({folder}/.metadata)")
    check_logical_files(step_folder)  # every worker, before any collective: all raise, naming the file
    saved = saved_tensors(step_folder)
    old_ranks = sorted({int(k.split(".")[1]) for k in saved if k.startswith("worker.") and k.endswith(".tokens")})
    # DCP loads in place: a scalar tensor to receive each of the job's values
    meta = {"data.epoch": torch.zeros((), dtype=torch.int64), "data.consumed": torch.zeros((), dtype=torch.int64),
            "world_size": torch.zeros((), dtype=torch.int64)}
    for q in old_ranks:
        meta[f"worker.{q}.tokens"] = torch.zeros((), dtype=torch.int64)
        meta[f"worker.{q}.micro_batches"] = torch.zeros((), dtype=torch.int64)
    missing = sorted(k for k in meta if k not in saved)
    if missing or not old_ranks:
        raise ReshardError(f"{folder} is not a quietsync logical checkpoint (it lacks {missing or 'worker.*'})")

    def read(targets: dict[str, torch.Tensor]) -> None:
        targets.update(meta)  # read in the strategy's one load
        no_dist = _no_dist(strategy)
        with _quiet_single_process(no_dist):
            dcp.load(targets, storage_reader=SafeReader(folder), process_group=_group(strategy), no_dist=no_dist)

    strategy.load_logical_state_dict(saved, read)
    if int(meta["world_size"]) != len(old_ranks):
        raise ReshardError(f"{folder} holds the counters of {len(old_ranks)} workers but was written by "
                           f"{int(meta['world_size'])}")
    stream.continue_from(int(meta["data.epoch"]), int(meta["data.consumed"]))
    world, rank = strategy.world_size, strategy.rank
    strategy.micro_batches = _fold({q: int(meta[f"worker.{q}.micro_batches"]) for q in old_ranks}, world, rank)
    return _fold({q: int(meta[f"worker.{q}.tokens"]) for q in old_ranks}, world, rank)
