"""Running one parsed ``quietsync train`` job: in place under torchrun, else on ``--nproc`` local workers.

Both ``quietsync train`` (:mod:`quietsync.train.cli`) and ``quietsync compare`` (one job per strategy,
:mod:`quietsync.train.compare`) come here after :func:`~quietsync.train.args.parse_train_args`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .args import PROG
from .config import TrainConfig

__all__ = ["run_job"]


def run_job(cfg: TrainConfig, strategy_config: Any, nodes: int | None, *, nproc_given: bool = False) -> int:
    """Run the job (see :mod:`quietsync.train.launch`); return the exit status: 0, 1 (a worker failed,
    its traceback printed) or 130 (interrupted). ``nproc_given``: ``--nproc`` was on the command line
    (under torchrun rank 0 then says it is ignored)."""
    from .launch import WorkerFailed, launch, under_torchrun
    from .loop import run

    if under_torchrun() and nproc_given and int(os.environ.get("RANK", "0")) == 0:
        print(f"{PROG} train: under torchrun, --nproc is ignored (WORLD_SIZE={os.environ['WORLD_SIZE']})",
              file=sys.stderr)
    try:
        launch(run, (cfg, strategy_config, nodes), nproc=cfg.nproc)
    except WorkerFailed as e:
        print(e.details, file=sys.stderr)
        print(f"{PROG} train: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} train: interrupted", file=sys.stderr)
        return 130
    return 0
