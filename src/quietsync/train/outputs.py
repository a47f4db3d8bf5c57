"""Runs never overwrite each other: who may write into an ``--out`` folder.

* A **new run** (no ``--resume``) needs an empty or missing ``--out``. A non-empty one is refused before any
  worker starts, unless ``--overwrite`` is given: then the files a run writes (:data:`RUN_OUTPUTS`:
  metrics, summary, plots, traces, the exported model, and under ``checkpoints/`` the step folders' rank files,
  their ``logical/`` parts and what an interrupted write left, :func:`remove_checkpoints`) are removed first.
  Anything else in the folder is left alone — ``--overwrite`` never empties a folder it did not fill, and a
  file of the user's own inside ``checkpoints/`` (or a step folder) keeps that folder.
* A **resumed run** continues the run in ``--out`` when its checkpoint lies under ``OUT/checkpoints``
  (bare ``--resume`` always does); ``--overwrite`` would delete that checkpoint and is refused. A checkpoint
  from elsewhere starts a new ``--out``, under the new-run rule.
* ``quietsync compare`` refuses a non-empty ``--out`` unless ``--overwrite``, which removes its
  :data:`COMPARE_OUTPUTS` and makes every run replace its own sub-folder's outputs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .config import TrainConfig

__all__ = ["RUN_OUTPUTS", "COMPARE_OUTPUTS", "out_problem", "compare_out_problem", "remove_outputs"]

RUN_OUTPUTS = (
    # summary.json.tmp: what a write of the summary cut short leaves
    "metrics-rank*.jsonl", "summary.json", "summary.json.tmp", "loss.png", "trace.json", "trace-rank*.json",
    "timeline.png", "profile-rank*.json",
    "model", "metrics-rank*.csv", "tensorboard", "wandb",
)
"""Glob patterns of what ``quietsync train`` writes under ``--out`` (what ``--overwrite`` removes, with
:func:`remove_checkpoints` for ``checkpoints/``)."""

COMPARE_OUTPUTS = ("compare.json", "compare.md", "compare.png", "timelines.png")
"""What ``quietsync compare`` writes under its ``--out`` besides one sub-folder per run."""


def _listing(folder: Path, limit: int = 3) -> str:
    names = sorted(p.name for p in folder.iterdir())
    return ", ".join(names[:limit]) + (f", ... ({len(names)} entries)" if len(names) > limit else "")


def _is_empty(folder: Path) -> bool:
    return not folder.is_dir() or next(folder.iterdir(), None) is None


def _inside(path: Path, folder: Path) -> bool:
    try:
        return path.resolve().is_relative_to(folder.resolve())  # through links and relative paths
    except OSError:
        return False


def out_problem(cfg: TrainConfig) -> str | None:
    """Why this run may not write into ``cfg.out`` (one line naming the flags), or None."""
    out = Path(cfg.out)
    continues = cfg.resume == "latest" or (cfg.resume is not None and _inside(Path(cfg.resume), out))
    if continues:
        if cfg.overwrite:
            return (f"--overwrite would delete the checkpoint that --resume continues from (under {out}); "
                    "drop one of them")
        return None
    if _is_empty(out) or cfg.overwrite:
        return None
    return (f"--out {out} is not empty ({_listing(out)}): a new run does not overwrite another; pass "
            "--overwrite to replace that run's outputs, --resume to continue it, or choose another --out")


def compare_out_problem(out: str | os.PathLike, overwrite: bool) -> str | None:
    """Why ``quietsync compare`` may not write into ``out``, or None."""
    out = Path(out)
    if _is_empty(out) or overwrite:
        return None
    return (f"--out {out} is not empty ({_listing(out)}): pass --overwrite to replace the runs it holds, "
            "or choose another --out")


def remove_checkpoints(out: str | os.PathLike) -> bool:
    """Delete what runs wrote under ``OUT/checkpoints``: in each ``step-N`` folder the rank files, the
    ``logical/`` part and what an interrupted write left (``*.tmp``); then each folder left empty, and
    ``checkpoints/`` itself when it is empty. Returns whether anything was removed."""
    from .checkpoint import STEP_DIR, checkpoint_root, run_files

    root = checkpoint_root(out)
    if not root.is_dir() or root.is_symlink():  # never delete through a link into another folder
        return False
    removed = False
    for step in root.iterdir():
        if not (STEP_DIR.match(step.name) and step.is_dir() and not step.is_symlink()):
            continue
        for path in run_files(step):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed = True
        removed = _remove_if_empty(step) or removed
    return _remove_if_empty(root) or removed


def _remove_if_empty(folder: Path) -> bool:
    try:
        folder.rmdir()
    except OSError:  # not empty (a file of the user's own), or already gone
        return False
    return True


def remove_outputs(out: str | os.PathLike, patterns: tuple[str, ...] = RUN_OUTPUTS) -> list[str]:
    """Delete what a run (``patterns``, and for ``quietsync train`` its checkpoints) wrote under ``out``;
    return the names removed (sorted).

    Safe when several processes do it at once (something already gone is skipped).
    """
    out = Path(out)
    if not out.is_dir():
        return []
    removed = []
    if patterns is RUN_OUTPUTS and remove_checkpoints(out):  # train's own call only (compare passes its own)
        removed.append("checkpoints")
    for pattern in patterns:
        for path in out.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path.name)
    return sorted(removed)
