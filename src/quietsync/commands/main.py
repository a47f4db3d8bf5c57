"""The ``quietsync`` command line (``quietsync``, ``python -m quietsync``): ``quietsync prepare`` (token shards),
``quietsync train`` (the main job), ``quietsync compare``, ``quietsync plan``, ``quietsync --version``.

The entry points live here, above the applications they dispatch to: parsing a job is in
:mod:`quietsync.train.args` (flags, one-line errors) and running it in :mod:`quietsync.train.run_job` (in place under
torchrun, else on ``--nproc`` local workers, see :mod:`quietsync.cli.launch`), so that ``compare`` shares both
without importing this module; ``plan`` is :mod:`quietsync.plan.cli`, ``prepare``
:mod:`quietsync.commands.prepare`. Each is imported when its command runs, so ``quietsync --help`` and
``--version`` answer without importing torch.
"""

from __future__ import annotations

import sys
from typing import NoReturn

from ..cli.exit import exit_now
from ..cli.flags import PROG


def prepare_main(argv: list[str]) -> int:
    """``quietsync prepare``: see :mod:`quietsync.commands.prepare`."""
    from .prepare import prepare_main as main_

    return main_(argv)


def plan_main(argv: list[str]) -> int:
    """``quietsync plan``: see :mod:`quietsync.plan.cli`."""
    from ..plan.cli import plan_main as main_

    return main_(argv)


def compare_main(argv: list[str]) -> int:
    """``quietsync compare``: see :mod:`quietsync.commands.compare`."""
    from .compare import compare_main as main_

    return main_(argv)


def lighthouse_main(argv: list[str]) -> int:
    """``quietsync lighthouse``: see :mod:`quietsync.faults.lighthouse`."""
    from ..faults.lighthouse import lighthouse_main as main_

    return main_(argv)


__all__ = ["main", "run", "train_main", "compare_main", "COMMANDS"]


def train_main(argv: list[str]) -> int:
    """``quietsync train``: parse (exit 2 on a bad value), then run the job; return its exit status."""
    from ..train.args import parse_train_args
    from ..train.run_job import run_job

    cfg, strategy_config, nodes = parse_train_args(argv)
    return run_job(cfg, strategy_config, nodes, nproc_given="--nproc" in argv)


COMMANDS = {
    "prepare": (prepare_main, "tokenize a corpus once, in parallel, into token shards every worker memory-maps"),
    "train": (train_main, "train a model with a strategy (the main job)"),
    "compare": (compare_main, "run several strategies on the same job; loss-vs-time, bytes and busy-time plots"),
    "plan": (plan_main, "predict every strategy's step time, bytes and memory here or on a described cluster; "
                        "recommend one"),
    "lighthouse": (lighthouse_main, "run the quorum server of a --fault-tolerance torchft job (torchft's Lighthouse)"),
}
"""Sub-commands: name -> (function(argv) -> exit status, one-line description)."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``quietsync`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--version", "-V"):
        from .._versions import __version__

        print(f"{PROG} {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"usage: {PROG} COMMAND [flags]", "", "commands:"]
        lines += [f"  {name:<10} {desc}" for name, (_, desc) in COMMANDS.items()]
        lines += ["", f"`{PROG} COMMAND --help` lists a command's flags; `{PROG} --version` prints the version."]
        if argv and argv[0] not in ("-h", "--help"):
            print(f"{PROG}: error: unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})",
                  file=sys.stderr)
            return 2
        print("\n".join(lines))
        return 0 if argv else 2  # help asked for: 0; no command at all: a usage error
    return COMMANDS[argv[0]][0](argv[1:])


def run() -> NoReturn:
    """The ``quietsync`` console script and ``python -m quietsync``: :func:`main`, then the process ends without the
    interpreter's teardown (:func:`quietsync.cli.exit.exit_now`: about a CPU-second once torch is loaded)."""
    try:
        code: int | str | None = main()
    except SystemExit as e:  # argparse's usage errors and --help
        code = e.code
    exit_now(code)


if __name__ == "__main__":  # pragma: no cover
    run()
