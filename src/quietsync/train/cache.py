"""A disk cache that is safe when several workers start at once.

``build_once(path, build)`` returns ``path`` after making sure it exists. The first process to
create ``path + ".lock"`` (``O_CREAT | O_EXCL``) builds the file into a temporary name and renames
it into place atomically; the others wait for the final file to appear. The lock holds
``host:pid`` of its builder: a lock whose builder is gone from this host is taken over at once; one
from another host (a shared file system) after ``stale_s`` seconds. A process waiting on a live
builder says once, on stderr, whom it waits for. No rank numbers are needed, so this works the same
for local workers, torchrun workers and a user's own processes.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quietsync"
"""Default cache folder (``$XDG_CACHE_HOME/quietsync`` or ``~/.cache/quietsync``)."""


def build_once(
    path: str | os.PathLike,
    build: Callable[[Path], None],
    *,
    timeout_s: float = 600.0,
    stale_s: float = 300.0,
    poll_s: float = 0.05,
) -> Path:
    """Make ``path`` exist, building it with ``build(tmp_path)`` in at most one process.

    ``build`` must write its whole result to the temporary path it is given. Raises
    ``TimeoutError`` when another process holds the lock for longer than ``timeout_s``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".lock")
    deadline = time.monotonic() + timeout_s
    told = False
    while not path.exists():
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(lock)
            if holder is None:
                continue  # the holder just finished; look again
            if _is_stale(lock, holder, stale_s):
                lock.unlink(missing_ok=True)  # its builder died: take over
                continue
            if time.monotonic() > deadline:
                who = holder or "another process"
                raise TimeoutError(f"waited {timeout_s:.0f}s for {path} (lock {lock} held by {who})") from None
            if not told:
                print(f"quietsync: waiting for {path} to be built by {holder or 'another process'} (lock {lock})",
                      file=sys.stderr, flush=True)
                told = True
            time.sleep(poll_s)
            continue
        try:
            os.write(fd, f"{socket.gethostname()}:{os.getpid()}".encode())
            os.close(fd)
            if path.exists():  # built between our check and taking the lock
                break
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            try:
                build(tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        finally:
            lock.unlink(missing_ok=True)
    return path


def _holder(lock: Path) -> str | None:
    """``host:pid`` written in ``lock`` ("" while its creator has not written it yet); None if it is gone."""
    try:
        return lock.read_text().strip()
    except FileNotFoundError:
        return None


def _is_stale(lock: Path, holder: str, stale_s: float) -> bool:
    """Whether the builder that holds ``lock`` is gone: a dead PID on this host, or an old lock otherwise."""
    host, _, pid = holder.rpartition(":")
    if host in ("", socket.gethostname()) and pid.isdigit():  # a bare PID: an older lock, written here
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # alive, owned by someone else
        return False
    try:
        return time.time() - lock.stat().st_mtime > stale_s
    except FileNotFoundError:
        return False
