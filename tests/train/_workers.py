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
