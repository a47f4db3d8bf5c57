"""A disk cache that is safe when several workers start at once.

``build_once(path, build)`` returns ``path`` after making sure it exists. The first process to
create ``path + ".lock"`` (``O_CREAT | O_EXCL``) builds the file into a temporary name and renames
it into place atomically; the others wait for the final file to appear. The lock holds
``host:pid`` of its builder: a lock whose builder is gone from this host is taken over at once; one
from another host (a shared file system) once it is ``stale_s`` seconds old — a builder refreshes its lock's
modification time every few seconds, so a long build (preparing a large corpus) is never taken for a dead one, and
a waiter gives up only after ``timeout_s`` seconds without a sign of life. A process waiting on a live
builder says once, on stderr, whom it waits for. No rank numbers are needed, so this works the same
for local workers, torchrun workers and a user's own processes.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

    def build_and_rename() -> None:
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        try:
            build(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # a failed build leaves no partial file (after the rename there is none)

    build_in_place(path, path.with_name(path.name + ".lock"), build_and_rename,
                   timeout_s=timeout_s, stale_s=stale_s, poll_s=poll_s)
    return path


def build_in_place(
    done: str | os.PathLike,
    lock: str | os.PathLike,
    build: Callable[[], None],
    *,
    timeout_s: float = 600.0,
    stale_s: float = 300.0,
    poll_s: float = 0.05,
) -> None:
    """Run ``build()`` in at most one process at a time, holding ``lock``, until ``done`` exists.

    ``build`` must make ``done`` exist last (an atomic rename): a builder that dies leaves its lock, which the
    next process takes over (see the module doc) and builds again, resuming what it can. Raises ``TimeoutError``
    when another process holds the lock for longer than ``timeout_s``.
    """
    done, lock = Path(done), Path(lock)
    lock.parent.mkdir(parents=True, exist_ok=True)
    told = False
    seen: tuple[str, float] | None = None  # (holder, lock mtime) when it last showed life
    alive_at = time.monotonic()
    while not done.exists():
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(lock)
            if holder is None:
                continue  # the holder just finished; look again
            if _is_stale(lock, holder, stale_s):
                lock.unlink(missing_ok=True)  # its builder died: take over
                continue
            # a new holder or a refreshed mtime is a sign of life: it restarts the timeout clock
            beat = (holder, _mtime(lock))
            if beat != seen:
                seen, alive_at = beat, time.monotonic()
            elif time.monotonic() - alive_at > timeout_s:
                who = holder or "another process"
                raise TimeoutError(f"waited {timeout_s:.0f}s for {done} without a sign of life from its builder "
                                   f"(lock {lock} held by {who})") from None
            if not told:
                print(f"quietsync: waiting for {done} to be built by {holder or 'another process'} (lock {lock})",
                      file=sys.stderr, flush=True)
                told = True
            time.sleep(poll_s)
            continue
        try:
            os.write(fd, f"{socket.gethostname()}:{os.getpid()}".encode())
            os.close(fd)
            if done.exists():  # built between our check and taking the lock
                break
            with _heartbeat(lock):
                build()
        finally:
            lock.unlink(missing_ok=True)  # also when build() raises: a waiter takes over without waiting out stale_s


HEARTBEAT_S = 5.0
"""While a build runs, its lock's modification time is refreshed this often (a sign of life for waiters and for
other hosts, which judge a lock by its age)."""


@contextmanager
def _heartbeat(lock: Path) -> Iterator[None]:
    """Touch ``lock`` every :data:`HEARTBEAT_S` seconds from a thread while the block runs."""
    stop = threading.Event()

    def beat() -> None:
        # Event.wait rather than sleep: the join below never waits out a whole beat
        while not stop.wait(HEARTBEAT_S):
            try:
                os.utime(lock)
            except OSError:
                return  # the lock is gone (released or taken over): nothing left to refresh

    thread = threading.Thread(target=beat, name="quietsync-lock-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


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
        # another host's PID (or a holder not yet written) cannot be probed: judge by age (the heartbeat keeps it young)
        return time.time() - lock.stat().st_mtime > stale_s
    except FileNotFoundError:
        return False  # released meanwhile: the next O_EXCL try decides
