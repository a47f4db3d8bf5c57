"""Module-level worker functions for the launcher tests (spawned processes must be able to import them)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def fail_on_rank_one(marker_dir: str) -> None:
    rank = int(os.environ["RANK"])
    Path(marker_dir, f"started-{rank}").write_text(os.environ["MASTER_PORT"])
    if rank == 1:
        raise ValueError("rank one broke on purpose")
    time.sleep(120)  # would hang the test if the launcher did not terminate it


def record_env(marker_dir: str) -> None:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    Path(marker_dir, f"env-{os.environ['RANK']}").write_text(" ".join(os.environ[k] for k in keys))


def root_cause_on_rank_one_then_slow_cleanup(marker_dir: str) -> None:
    """Rank 1 fails first but lingers in its clean-up; rank 0 fails later with a peer's symptom and exits first.
    The order is fixed by events, not by timing: rank 0 fails only once rank 1 has noted its failure (a marker
    file), however late either process started, and rank 1 never ends on its own (a clean-up that blocks) — the
    launcher stops it once rank 0 has exited, so rank 0 always exits first, whatever the machine's load."""
    from quietsync.cli.launch import note_failure

    marker = Path(marker_dir, "rank1-failed")
    if int(os.environ["RANK"]) == 1:
        try:
            raise ValueError("the real cause on rank one")
        except ValueError:
            note_failure()
            marker.touch()
            raise
        finally:
            # a clean-up that blocks (e.g. tearing down a process group whose peer is gone) until the launcher
            # stops this worker; the bound only keeps a broken launcher from hanging the test for ever
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                time.sleep(0.05)
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    raise RuntimeError("Connection closed by peer")


def sleep_forever(marker_dir: str) -> None:
    tmp = Path(marker_dir, f".pid-{os.environ['RANK']}")
    tmp.write_text(str(os.getpid()))
    tmp.rename(tmp.with_name(tmp.name[1:]))  # whole: the test reads it as soon as it appears
    time.sleep(600)


def listening_addresses() -> list[str]:
    """Local addresses this worker listens on after setting up its transport (``ss -ltnp``)."""
    import subprocess

    from quietsync.transport import Transport

    transport = Transport()
    transport.barrier()
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    mine = [line.split()[3] for line in out.splitlines() if f"pid={os.getpid()}," in line]
    transport.barrier()
    transport.close()
    Path(os.environ["QUIETSYNC_TEST_OUT"], f"listen-{os.environ['RANK']}").write_text("\n".join(mine))
    return mine


def train_with_one_nan(argv: list[str], bad_rank: int, bad_call: int, rank: int | None = None) -> dict | None:
    """``quietsync train ARGV`` as one worker (rank ``rank``, default ``$RANK``), whose ``bad_call``-th micro-batch
    loss on ``bad_rank`` is NaN (the loss function is patched here; nothing in quietsync knows)."""
    from quietsync.train import loop
    from quietsync.train.args import parse_train_args

    rank = int(os.environ["RANK"]) if rank is None else rank
    real, calls = loop.lm_loss, [0]

    def lm_loss(model, batch):
        calls[0] += 1
        loss = real(model, batch)
        return loss * float("nan") if rank == bad_rank and calls[0] == bad_call else loss

    loop.lm_loss = lm_loss
    cfg, scfg, nodes = parse_train_args(argv)
    return loop.run(cfg, scfg, nodes)
