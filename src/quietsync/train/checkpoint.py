"""Checkpoints of a training job: one file per worker and step, and a world-size-independent part.

Layout: ``OUT/checkpoints/step-0000100/rank{R}.pt``, each holding that worker's ``strategy.state_dict()``
(model, optimizer shard, pending buffers), its data-stream position, its token count and RNG state: what a
resume on the same number of workers loads, exactly. Strategies that can reshard also write
``step-0000100/logical/`` (:mod:`~quietsync.train.logical_checkpoint`, through torch.distributed.checkpoint),
what a resume on another number of workers loads.
Files are written to a temporary name and renamed, so a file that exists is complete; a step folder is
complete when its logical part is complete and so is every rank file of the workers that wrote it (it then
loads on any number of workers), or — a strategy without a logical part (cdp cannot checkpoint at all; older
checkpoints) — when each of this run's workers has its rank file in it. Before workers start, every file a
resume reads is checked (:func:`files_problem`), so a cut-short shard is named, not met as a bare ``EOFError``.
``--resume`` without a folder takes the newest complete one. A write cut short leaves only files under a
temporary name (:data:`PARTIAL_WRITES`), removed at the next resume (:func:`remove_partial_writes`).
Files are read back with ``weights_only=True``: tensors and plain data only, so loading never runs code.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import cause_chain
from ..faults.inject import mid_write

STEP_DIR = re.compile(r"^step-(\d+)$")
"""Names of step folders under ``OUT/checkpoints``."""

PARTIAL_WRITES = ("rank*.pt.tmp", "logical/*.tmp")
"""What a write cut short (``kill -9`` mid-save) leaves in a step folder: the temporary names files are
written under before their rename (rank files; DCP's ``.metadata``)."""


def checkpoint_root(out: str | os.PathLike) -> Path:
    """``OUT/checkpoints``."""
    return Path(out) / "checkpoints"


def rank_file(folder: str | os.PathLike, rank: int) -> Path:
    """``FOLDER/rank{rank}.pt``."""
    return Path(folder) / f"rank{rank}.pt"


def run_files(step_folder: str | os.PathLike) -> list[Path]:
    """What runs write into a step folder: rank files, the ``logical/`` part, partial writes."""
    folder = Path(step_folder)
    found = [*folder.glob("rank*.pt"), *folder.glob("rank*.pt.tmp")]
    logical = folder / "logical"
    if logical.exists():
        found.append(logical)
    return found


def remove_partial_writes(out: str | os.PathLike) -> list[Path]:
    """Delete what writes cut short left under ``OUT/checkpoints`` (:data:`PARTIAL_WRITES`); return them.

    Call it only while no worker of the run can be writing (at a resume, before training)."""
    root = checkpoint_root(out)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for step in root.iterdir():
        if STEP_DIR.match(step.name) and step.is_dir():
            for pattern in PARTIAL_WRITES:
                for path in step.glob(pattern):
                    path.unlink(missing_ok=True)
                    removed.append(path)
    return removed


def save_checkpoint(out: str | os.PathLike, step: int, rank: int, payload: dict[str, Any]) -> Path:
    """Write this worker's checkpoint for ``step`` atomically and return its path."""
    folder = step_folder(out, step)
    folder.mkdir(parents=True, exist_ok=True)
    path = rank_file(folder, rank)
    tmp = path.with_name(f"{path.name}.tmp")
    torch.save(payload, tmp)
    mid_write(tmp, step, rank)  # a test's fault: nothing without its environment variable
    os.replace(tmp, path)
    return path


FULL_BELOW = 16 << 20
"""Free bytes under which a failed checkpoint write is put down to a full disk (the writers' own errors, such as
torch's "unexpected pos", do not say so)."""


def out_of_space(out: str | os.PathLike, step: int, error: BaseException) -> str | None:
    """One line naming ``--out`` when ``error`` (a failed checkpoint write) came from a full file system: ENOSPC
    anywhere in its chain, or less than :data:`FULL_BELOW` free there now; else None."""
    nospace = any(getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e) for e in cause_chain(error))
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        free = None
    if not nospace and (free is None or free >= FULL_BELOW):
        return None
    left = f" ({free / 1e6:.0f} MB free)" if free is not None else ""
    return (f"--out {out}: no space left on its file system for the checkpoint of step {step}{left}: free some, or "
            "save less often (--save-every)")


def _complete(folder: Path, ranks: list[int]) -> bool:
    """A complete logical part and a file for each of the workers that wrote it (loadable on any number of
    workers); or, without a logical part (cdp, or an older quietsync), a file for each of ``ranks``."""
    from .logical_checkpoint import logical_world

    old = logical_world(folder)
    if old is not None:
        return all(rank_file(folder, q).is_file() for q in range(old))
    return all(rank_file(folder, r).is_file() for r in ranks)


def files_problem(folder: str | os.PathLike, world: int, nodes: int | None) -> str | None:
    """Why a resume of ``folder`` on ``world`` workers (``nodes`` nodes) would fail to read a file, naming it
    (None when every file it reads is whole): on the checkpoint's own layout each worker's rank file, else rank
    0's file and every file of the logical part. Rank files are opened memory-mapped (their index and pickle
    read, the tensors not), the logical part's data files checked against the sizes its metadata lists."""
    folder = Path(folder)
    try:
        first = load_checkpoint(folder, 0, mmap=True)
    except ValueError as e:
        return str(e)
    same = first.get("world_size") == world and first.get("nodes", nodes) == nodes  # no node count saved: any matches
    if same and all(rank_file(folder, r).is_file() for r in range(world)):
        for r in range(1, world):  # rank 0's was read above
            try:
                load_checkpoint(folder, r, mmap=True)
            except ValueError as e:
                return str(e)
        return None
    from .logical_checkpoint import check_logical_files, has_logical

    if not has_logical(folder):
        return None  # the world-size check says why it cannot be resumed here
    try:
        check_logical_files(folder)
    except (ValueError, OSError) as e:
        return str(e)
    return None


def complete_checkpoints(out: str | os.PathLike, ranks: Iterable[int]) -> list[Path]:
    """Step folders under ``OUT/checkpoints`` complete for ``ranks`` (see the module docstring), newest first."""
    root = checkpoint_root(out)
    if not root.is_dir():
        return []
    ranks = list(ranks)
    found = []
    for d in root.iterdir():
        m = STEP_DIR.match(d.name)
        if m and d.is_dir() and _complete(d, ranks):
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found, reverse=True)]


def latest_checkpoint(out: str | os.PathLike, ranks: Iterable[int]) -> Path | None:
    """Newest step folder under ``OUT/checkpoints`` complete for ``ranks`` (see the module docstring; None if
    none)."""
    found = complete_checkpoints(out, ranks)
    return found[0] if found else None


def step_folder(out: str | os.PathLike, step: int) -> Path:
    """``OUT/checkpoints/step-NNNNNNN``."""
    return checkpoint_root(out) / f"step-{step:07d}"


def set_aside_later(out: str | os.PathLike, resumed: str | os.PathLike) -> str | None:
    """Move the step folders of ``OUT/checkpoints`` after the one a run resumes from (``resumed``, under ``OUT``)
    into ``OUT/checkpoints/before-resume-from-step-N/``: they hold the run this resume abandons, whose metrics it cuts
    back, and a later bare ``--resume`` would otherwise take the newest of them. Returns the note to print, or None."""
    resumed = Path(resumed)
    root = checkpoint_root(out)
    m = STEP_DIR.match(resumed.name)
    if m is None or not root.is_dir() or resumed.resolve().parent != root.resolve():
        return None  # a checkpoint of another folder: this one's are not abandoned by it
    step = int(m.group(1))
    later = sorted(p for p in root.iterdir() if p.is_dir() and (n := STEP_DIR.match(p.name)) and int(n.group(1)) > step)
    if not later:
        return None
    aside = root / f"before-resume-from-step-{step}"
    aside.mkdir(exist_ok=True)
    for p in later:
        os.replace(p, aside / p.name)
    steps = ", ".join(str(int(STEP_DIR.match(p.name).group(1))) for p in later)
    return (f"--resume: the checkpoints of steps {steps} belong to the run this resume leaves: moved to {aside} "
            "(a bare --resume takes the newest checkpoint of this branch)")


def resolve_resume(resume: str, out: str | os.PathLike, ranks: Iterable[int]) -> Path:
    """The folder ``--resume`` names: ``latest`` (newest complete under OUT) or an explicit folder."""
    if resume == "latest":
        folder = latest_checkpoint(out, ranks)
        if folder is None:
            raise ValueError(f"resume found no complete checkpoint under {checkpoint_root(out)}")
        return folder
    folder = Path(resume)
    ranks = list(ranks)
    missing = [r for r in ranks if not rank_file(folder, r).is_file()]
    if missing and not _complete(folder, ranks):  # missing ones are fine when logical/ can reshard it
        raise ValueError(f"resume folder {folder} lacks rank files for ranks {missing} (and a complete "
                         "world-size-independent part, logical/, to reshard from)")
    return folder


def load_checkpoint(folder: str | os.PathLike, rank: int, *, mmap: bool = False) -> dict[str, Any]:
    """This worker's checkpoint payload from ``folder``, read safely.

    Loaded with ``weights_only=True``: a checkpoint may hold tensors and plain data (dicts, lists, numbers,
    strings) and nothing else, so a crafted file cannot run code. Raises ``ValueError`` naming the file when it
    holds anything else, is truncated or is not a checkpoint at all. ``mmap=True`` maps the tensors instead
    of reading them (to look at the config only).
    """
    path = rank_file(folder, rank)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"refusing to load checkpoint {path}: it holds objects other than tensors and plain data "
            f"(quietsync never writes such files; was it crafted or written by other code?): "
            f"{str(exc).splitlines()[-1] if str(exc) else exc}") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise ValueError(f"checkpoint {path} cannot be read (truncated or not a quietsync checkpoint): {exc}") from None
    if not isinstance(payload, dict) or "strategy" not in payload:
        raise ValueError(f"checkpoint {path} is not a quietsync checkpoint (no strategy state in it)")
    return payload
