"""Results computed once per test session and shared by every test process, pytest-xdist workers included.

``shared_folder(tmp_path_factory, name, build)`` returns ``ROOT/name``, where ``ROOT`` belongs to this test
session (all xdist workers of one ``pytest`` run see the same one; the next run starts empty, so a result never
outlives the code that computed it). The first process to ask calls ``build(folder)`` while holding a lock on
it; the others wait for it and reuse the folder — the result is never computed twice, even concurrently. A
build that raises is not retried: every later caller fails with its error.

Tests that read a shared folder must not change it (copy it first: :func:`copy_of`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

DONE = ".complete"
FAILED = ".failed"


def session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of this test session shared by all its processes."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(parents=True, exist_ok=True)
    return root


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """``ROOT/name`` after ``build(ROOT/name)`` ran once in this session (see the module doc)."""
    root = session_root(tmp_path_factory)
    folder = root / name
    with open(root / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (root / f"{name}{FAILED}").exists():
            raise RuntimeError(f"the shared result {name!r} failed to build in another test process:\n"
                               + (root / f"{name}{FAILED}").read_text())
        if not (folder / DONE).exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build cut short by a killed process
            folder.mkdir()
            try:
                build(folder)
            except BaseException:
                (root / f"{name}{FAILED}").write_text(traceback.format_exc())
                raise
            (folder / DONE).write_text("")
    return folder


def copy_of(folder: Path, to: Path) -> Path:
    """A private copy of a shared folder (without its completion mark), for a test that changes it."""
    shutil.copytree(folder, to, ignore=shutil.ignore_patterns(DONE))
    return to
