"""A disk cache that is safe when several workers start at once.

``build_once(path, build)`` returns ``path`` after making sure it exists. The first process to
create ``path + ".lock"`` (``O_CREAT | O_EXCL``) builds the file into a temporary name and renames
it into place atomically; the others wait for the final file to appear. A lock left by a process
that died is taken over after ``stale_s`` seconds. No rank numbers are needed, so this works the
same for local workers, torchrun workers and a user's own processes.
"""

from __future__ import annotations

import os
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
    while not path.exists():
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                continue  # the holder just finished; look again
            if age > stale_s:
                lock.unlink(missing_ok=True)  # its builder died: take over
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f}s for {path} (lock {lock} held by another process)") from None
            time.sleep(poll_s)
            continue
        try:
            os.write(fd, str(os.getpid()).encode())
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
