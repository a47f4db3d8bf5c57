"""Running one parsed ``quietsync train`` job: in place under torchrun, else on ``--nproc`` local workers.

Both ``quietsync train`` (:mod:`quietsync.commands.main`) and ``quietsync compare`` (one job per strategy,
:mod:`quietsync.commands.compare`) come here after :func:`~quietsync.train.args.parse_train_args`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..cli.flags import FlagError
from .args import PROG
from .config import TrainConfig

__all__ = ["before_workers", "run_job"]


def before_workers(cfg: TrainConfig, strategy_config: Any, nodes: int | None) -> list[str]:
    """The checks that need the file system, before any worker starts; then ``--overwrite``'s clean-up.

    Returns the notes to print; raises :class:`FlagError` (one line). Under torchrun every process runs
    this, and the checkpoint and data checks are left to the workers (files may be on other nodes).
    """
    from ..cli.launch import under_torchrun
    from .model_check import model_problem
    from .outputs import out_problem, remove_outputs
    from .preflight import check_data, job_data_identity
    from .resume_check import check_resume

    torchrun = under_torchrun()
    # an elastic run continues the run in --out; a torchft replica group shares --out with the job's others
    problem = None if cfg.elastic or cfg.replica_group is not None else out_problem(cfg)
    if problem is not None:
        raise FlagError("--out", problem)
    world = int(os.environ["WORLD_SIZE"]) if torchrun else cfg.nproc
    problem = model_problem(cfg, strategy_config, world)
    if problem is not None:
        raise FlagError(problem.split()[0], problem)
    notes: list[str] = []
    if cfg.resume is not None and not torchrun:
        notes += check_resume(cfg, strategy_config, cfg.nproc, nodes, data=lambda: job_data_identity(cfg))
    if not torchrun:
        check_data(cfg, cfg.nproc)
    sync_every = getattr(strategy_config, "sync_every", None)
    if isinstance(sync_every, int) and cfg.max_steps < sync_every:
        notes.append(f"--max-steps {cfg.max_steps} is below --sync-every {sync_every}: the workers never "
                     "synchronise in this run (with diloco the evaluated outer model stays where it started)")
    if cfg.lighthouse is not None:
        from ..faults.flags import lighthouse_problem

        problem = lighthouse_problem(cfg.lighthouse)
        if problem is not None:
            raise FlagError("--lighthouse", problem)
    # once per node (under torchrun every process runs this); a replica group shares --out with the others
    if cfg.overwrite and os.environ.get("LOCAL_RANK", "0") == "0" and cfg.replica_group is None:
        removed = remove_outputs(cfg.out)
        if removed:
            notes.append(f"--overwrite: removed {', '.join(removed)} from {cfg.out}")
    return notes


def run_job(cfg: TrainConfig, strategy_config: Any, nodes: int | None, *, nproc_given: bool = False) -> int:
    """Run the job (see :mod:`quietsync.cli.launch`); return the exit status: 0, 1 (a worker failed,
    its traceback printed), 2 (refused before any worker started: one line), 130 (interrupted) or, under
    ``--fault-tolerance torchft``, 3 (stopped by ``--on-nonfinite``: :mod:`quietsync.train.replica_nonfinite`).
    ``nproc_given``: ``--nproc`` was on the command line (under torchrun rank 0 then says it is ignored)."""
    from ..cli.launch import WorkerFailed, launch, under_torchrun
    from .job_model import worker_preload
    from .loop import run

    if under_torchrun() and nproc_given and int(os.environ.get("RANK", "0")) == 0:
        print(f"{PROG} train: under torchrun, --nproc is ignored (WORLD_SIZE={os.environ['WORLD_SIZE']})",
              file=sys.stderr)
    try:
        notes = before_workers(cfg, strategy_config, nodes)
    except FlagError as e:
        print(f"{PROG} train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # e.g. while a raw --dataset is prepared: its journal lets the same command resume
        print(f"{PROG} train: interrupted before training started; the same command resumes the data's "
              "preparation where it stopped", file=sys.stderr)
        return 130
    if int(os.environ.get("RANK", "0")) == 0:
        for note in notes:
            print(f"{PROG} train: {note}", flush=True)
    if cfg.fault_tolerance == "torchft":
        from .replica_launch import run_local_replicas, run_one_replica_group

        if cfg.replica_group is None:
            return run_local_replicas(cfg, strategy_config, nodes or cfg.nproc)
        workers = int(os.environ["WORLD_SIZE"]) if under_torchrun() else cfg.nproc
        return run_one_replica_group(cfg, strategy_config, cfg.replica_group, cfg.nodes, cfg.lighthouse, workers)
    try:
        launch(run, (cfg, strategy_config, nodes), nproc=cfg.nproc, preload=worker_preload(cfg.model))
    except WorkerFailed as e:
        print(e.details, file=sys.stderr)
        print(f"{PROG} train: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} train: interrupted", file=sys.stderr)
        return 130
    return 0
