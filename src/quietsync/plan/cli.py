"""``quietsync plan``: the planner on the command line (flags are the fields of
:class:`~quietsync.plan.config.PlanConfig`).

Prints the table and the advice; with ``--out`` also writes ``plan.md``, ``plan.json`` and ``plan.png``. A bad
value is one line on stderr and exit status 2, before any worker starts; a failed worker, or a plan that cannot be
made from what it measured (no setting left to rank, a pilot too short for a loss curve), exits 1 with one line.
"""

from __future__ import annotations

import sys

PROG = "quietsync plan"


def plan_main(argv: list[str]) -> int:
    """``quietsync plan [flags]``; returns the exit status."""
    from ..cli.flags import FlagError, OneLineParser, add_dataclass_flags, build_config, given_values
    from ..cli.launch import WorkerFailed
    from .config import PlanConfig, PlanError
    from .planner import plan

    parser = OneLineParser(
        prog=PROG,
        description="Predict every strategy's step time, bytes and memory for a model on a cluster, and recommend "
                    "a strategy and its knobs. Measures the model on this device and the links between the launched "
                    "workers (a short probe), or describes a cluster with --what-if.",
        epilog="Example: quietsync plan --model tiny --nproc 4 --nodes 2 --link inter=1gbit,20ms --out runs/plan",
    )
    fields = add_dataclass_flags(parser, PlanConfig)
    args = parser.parse_args(argv)
    try:
        cfg = build_config(PlanConfig, given_values(args, fields))
    except FlagError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        result = plan(cfg)
    except WorkerFailed as e:
        print(e.details, file=sys.stderr)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except PlanError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports an interrupted command
    if result is None:  # another rank under torchrun
        return 0
    print(result.markdown(), end="")
    if cfg.out:
        paths = result.save(cfg.out, cfg.plot)
        print(f"results in {', '.join(str(p) for p in paths)}")
    return 0
