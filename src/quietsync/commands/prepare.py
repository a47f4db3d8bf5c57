"""``quietsync prepare --dataset INPUT --out DIR``: the command line of :func:`quietsync.data.prepare.prepare`.

Flags are the fields of :class:`~quietsync.data.prepare.PrepareConfig`; a bad value, or input that cannot be
prepared as asked, is one line on stderr and exit status 2, with nothing left half-written; an interrupted prepare
exits 130 and the same command resumes it. The last line says how to train on the result.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..cli.flags import FlagError, OneLineParser, add_dataclass_flags, build_config, given_values
from ..data.prepare import PrepareConfig, Refused, prepare
from ..train.args import PROG

__all__ = ["prepare_main", "prepare_parser"]


def prepare_parser() -> tuple[OneLineParser, dict[str, str]]:
    """The ``quietsync prepare`` parser and its ``{field: flag}``."""
    parser = OneLineParser(
        prog=f"{PROG} prepare",
        description="Tokenize a corpus once, on every core, into uint16/uint32 token shards and an index that "
                    "`quietsync train --dataset DIR` memory-maps in every worker.",
        epilog="Formats, the index and resuming: docs/train.md ('Data at scale').",
    )
    return parser, add_dataclass_flags(parser, PrepareConfig)


def prepare_main(argv: list[str]) -> int:
    """Parse, prepare, report; return the exit status (0, 2 refused, 130 interrupted)."""
    parser, fields = prepare_parser()
    args = parser.parse_args(argv)
    values = given_values(args, fields)
    if "out" not in values:
        parser.error("--out is required: the folder to write the token shards and index.json to")
    try:
        cfg = build_config(PrepareConfig, values)
    except FlagError as e:
        parser.error(str(e))
    if "progress" not in values:
        # not given: a progress bar on a terminal only, none in a log file
        cfg.progress = sys.stderr.isatty()
    out = Path(cfg.out)
    blocked = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        parser.error(f"--out {cfg.out}: {blocked} is a file, not a folder")
    try:
        result = prepare(cfg)
    except Refused as e:
        print(f"{PROG} prepare: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # from a reader (a hub name not reachable, a file it cannot parse): one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not first.startswith("--"):  # ours name their flag already
            first = f"--dataset {cfg.dataset}: {first}"
        print(f"{PROG} prepare: error: {first}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} prepare: interrupted; the same command resumes where it stopped", file=sys.stderr)
        return 130
    if result.already:
        print(f"{PROG} prepare: {result.folder} already holds this dataset, prepared", flush=True)
    splits = result.index["splits"]
    print(f"{PROG} prepare: {splits['train']['tokens']:,} training and {splits['eval']['tokens']:,} held-out tokens "
          f"({result.index['dtype']}) in {result.folder}; train on it: {PROG} train --dataset {result.folder}",
          flush=True)
    return 0
