"""What a resumed run may change: the checkpoint's config against this run's flags, in one place.

Every checkpoint holds the job config (``config``), the strategy's config (``strategy.config``), the world
size and the node count. On ``--resume`` each job field falls in one of three classes:

* :data:`INCOMPATIBLE` — the run would not be a continuation of the checkpointed one (the data, the model,
  the optimizer's own hyper-parameters, which the checkpoint restores and would silently keep). Changing
  any of these, any strategy flag or the strategy is refused with one line listing all of them.
* :data:`NOTED` — allowed; a note says what changes (e.g. a new ``--max-steps`` changes the cosine
  learning-rate schedule after the resumed step).
* :data:`SAFE` — allowed silently: they change where things are written, when, and how they are shown.

Another world size is allowed (with a note) when the strategy can reshard and the checkpoint has its
world-size-independent part (``logical/``, see :mod:`~quietsync.train.logical_checkpoint`); it is then loaded
from that part, and the node count may change with it. Otherwise another world size, or another node count,
is refused in one line naming the strategy and why.

A field in no class (say, one added later) counts as incompatible. The same ``--dataset`` may hold other data by
now (prepared again at the same path, or a raw input edited): each checkpoint records what its ids were
(``data_identity``: :func:`~quietsync.data.shards.data_identity`), and :func:`data_change` refuses a resume on other
ones. The launcher runs :func:`check_resume` before any worker starts; every worker runs :func:`check_checkpoint`
and :func:`data_change` again on the payload it loads (under torchrun there is no launcher).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..cli.flags import FlagError, flag_name
from .checkpoint import (
    checkpoint_root,
    files_problem,
    latest_checkpoint,
    load_checkpoint,
    rank_file,
    resolve_resume,
    set_aside_later,
)
from .config import TrainConfig

__all__ = ["INCOMPATIBLE", "NOTED", "SAFE", "TOPOLOGY", "ResumeMismatch", "check_checkpoint", "check_resume",
           "data_change"]

INCOMPATIBLE: dict[str, str] = {
    "strategy": "the checkpoint holds that strategy's state",
    "micro_batch_size": "the data position counts windows of the old micro-batch size",
    "seq_len": "the data stream is cut into windows of the old length",
    "lr": "the checkpoint's optimizer keeps its own learning rate",
    "weight_decay": "the checkpoint's optimizer keeps its own weight decay",
    "dataset": "other text",
    "text_column": "other text",
    "token_dtype": "other token ids",
    "eval_fraction": "another train/held-out split",
    "seed": "another data order",
    "model": "another model",
    "vocab_size": "another tokenizer",
    "tokenizer": "another tokenizer",
    "precision": "the checkpoint's state (with fp16: its loss scale) belongs to that precision",
}
"""Job fields a resumed run may not change, with why."""

NOTED: dict[str, str] = {
    "max_steps": "the run now ends at step {new}; the cosine learning-rate schedule after step {step} is that "
                 "of a {new}-step run",
    "warmup_steps": "the learning-rate schedule after step {step} has the new warm-up",
    "min_lr_ratio": "the learning-rate schedule after step {step} decays to the new final ratio",
    "eval_windows": "held-out losses after step {step} average another number of windows (not comparable "
                    "with earlier ones)",
    "threads": "kernels may sum in another order, so the continuation need not be bit-identical",
    "link": "only the emulated link timing changes",
    "slow_worker": "only the slowed worker's timing changes",
    "max_grad_norm": "gradients after step {step} are clipped to the new norm ({old} -> {new})",
    "batch_policy": "steps after {step} on another number of workers than the run started on hold what the new "
                    "policy says",
}
"""Job fields a resumed run may change, with a note of what it changes (``{step}``, ``{old}``, ``{new}``)."""

SAFE = frozenset({
    "out", "overwrite", "eval_every", "save_every", "resume", "cache_dir", "timeout_s", "progress", "plot",
    "trace", "profile_steps", "export", "on_nonfinite", "nonfinite_skip_limit", "log_with",
    "check_replicas_every", "on_replicas_differ",  # checks of the parameters, which they do not change
    "max_tokens", "max_time_s", "target_loss",  # only when the run stops (tokens and time count from step 0)
    "elastic",  # how restarts find the checkpoint, not what it holds
    "activation_checkpointing", "compile",  # the same computation, other memory and speed
    "fault_tolerance", "lighthouse", "replica_group", "replica_restarts",  # torchft runs do not resume (refused)
    "standby", "async_join",
    "strategy_module",  # where the strategy's code is imported from; the strategy and its config are compared
})
"""Job fields a resumed run may change without a word."""

TOPOLOGY = frozenset({"nproc", "nodes"})
"""Job fields compared through what they resolve to: the world size and the node count."""


class ResumeMismatch(FlagError):
    """The checkpoint cannot be continued with this run's flags (one line)."""

    def __init__(self, message: str) -> None:
        super().__init__("--resume", message)


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _value(value: Any) -> str:
    if value is None or value == []:
        return "(unset)"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _show(flag: str, value: Any) -> str:
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {_value(value)}"


PATHS = frozenset({"dataset", "model", "tokenizer"})
"""Job fields that may name a file or folder: the same one spelled another way (``prep``, ``./prep``, its absolute
path from here) is the same value."""


def _same(name: str, old: Any, new: Any) -> bool:
    if old == new:
        return True
    if name not in PATHS or not isinstance(old, str) or not isinstance(new, str):
        return False
    a, b = Path(old).expanduser(), Path(new).expanduser()
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def _strategy_flags(strategy: str) -> dict[str, str]:
    from .args import train_parser

    return train_parser(strategy)[2]


def _warmup(max_steps: int, warmup_steps: int | None) -> int:
    # TrainConfig.warmup's rule, applied to the checkpoint's flags too
    return warmup_steps if warmup_steps is not None else max(1, max_steps // 20)


def _strategy_state(payload: dict[str, Any]) -> dict[str, Any]:
    state = payload.get("strategy")
    if not isinstance(state, dict):
        raise ResumeMismatch("--resume: the checkpoint is not a quietsync checkpoint "
                             "(its strategy state is not a dict)")
    return state


def _reshard_refusal(payload: dict[str, Any], where: str, nodes: int | None) -> str | None:
    """Why the checkpoint at ``where`` cannot be loaded on another number of workers or on ``nodes`` nodes (None if
    it can)."""
    from ..strategies import get
    from .logical_checkpoint import has_logical

    config = payload.get("config")
    name = (config.get("strategy") if isinstance(config, dict) else None) or _strategy_state(payload).get("strategy")
    try:
        refusal = get(str(name))[0].reshard_problem(payload.get("nodes"), nodes)
    except ValueError:
        return f"its strategy {name!r} is unknown here"
    if refusal is not None:
        return f"strategy {name} cannot be resharded: {refusal}"
    if not where or not has_logical(where):
        return ("it has no world-size-independent part (logical/), which quietsync writes beside the rank files "
                "for every strategy that can reshard (all but cdp; older versions: only ddp, zero1, fsdp, flexdemo)")
    return None


def reshard_note(saved_world: int, world: int, policy: str = "worker", strategy_config: Any = None,
                 nominal: dict[str, int] | None = None) -> str:
    """What a resume on another number of workers restores, and what a step now holds under ``--batch-policy``
    ``policy`` (``nominal``: the checkpoint's first world and micro-batches per worker, :class:`Nominal`)."""
    from .elastic import Nominal, accumulation_field, rescaled

    # a checkpoint without one: its own world at the flags' accumulation, as train/loop.py resumes it
    start = (Nominal(**nominal) if nominal else Nominal(saved_world, Nominal.of(strategy_config, 1).accumulation))
    config, ratio = rescaled(strategy_config, policy, start, world)
    field = accumulation_field(config)
    if policy == "global" and field is not None:
        per = getattr(config, field)
        held = ("the same tokens per step as the run's first steps" if ratio == 1.0 else
                f"{ratio:g} x the run's first tokens per step (rounded up to whole micro-batches)")
        batch = (f"each worker now feeds {per} micro-batch(es) per step (--batch-policy global), so a step holds "
                 f"{held}")
    else:
        why = "--batch-policy worker" if policy == "worker" else "its micro-batches per step adapt to the link"
        batch = (f"each worker feeds as many micro-batches per step as before ({why}), so a step holds {ratio:g} x "
                 "the run's first tokens per step")
    return (f"--resume: resharding a checkpoint of {saved_world} workers onto {world}: the model, the state the "
            "workers share, the step and the learning-rate schedule continue exactly (a worker's own state -- a "
            "decoupled momentum, a local drift and its inner moments -- goes on for the workers that stay and is lost "
            f"for those that leave: docs/train.md, logical checkpoints); the data stream continues where the "
            f"{saved_world} workers stopped, dealt over {world}; {batch}; the learning-rate schedule and --max-steps "
            "follow tokens")


def _topology_problem(payload: dict[str, Any], world: int, nodes: int | None, where: str) -> str | None:
    saved_world = payload.get("world_size", _strategy_state(payload).get("world_size"))
    saved_nodes = payload.get("nodes")
    world_changed = saved_world is not None and saved_world != world
    nodes_changed = saved_nodes is not None and nodes is not None and saved_nodes != nodes
    if not (world_changed or nodes_changed):
        return None
    why = _reshard_refusal(payload, where, nodes)
    if why is None:
        return None  # the logical part is loaded
    if world_changed:
        return (f"--resume: the checkpoint {where} was written by {saved_world} workers; this run has {world}; "
                f"resume it with {saved_world} workers (--nproc {saved_world}): {why}")
    return (f"--resume: the checkpoint {where} was written on {saved_nodes} nodes; this run has {nodes} "
            f"(--nodes {nodes}); resume with --nodes {saved_nodes}: {why}")


def check_checkpoint(
    payload: dict[str, Any], cfg: TrainConfig, strategy_config: Any, world: int, nodes: int | None,
    where: str | Path = "",
) -> list[str]:
    """Compare a loaded checkpoint ``payload`` with this run; return the notes of allowed changes.

    Raises :class:`ResumeMismatch` (one line) for another world size or node count (unless the checkpoint
    can be resharded: then a note says so), for incompatible changes (listing all of them) and for a
    ``--max-steps`` the checkpoint has already reached.
    """
    problem = _topology_problem(payload, world, nodes, str(where))
    if problem:
        raise ResumeMismatch(problem)
    saved_world = payload.get("world_size", _strategy_state(payload).get("world_size"))
    saved_nodes = payload.get("nodes")
    topology_notes = []
    if saved_world is not None and saved_world != world:
        nominal = payload.get("nominal")
        topology_notes.append(reshard_note(saved_world, world, cfg.batch_policy, strategy_config,
                                           nominal if isinstance(nominal, dict) else None))
    elif saved_nodes is not None and nodes is not None and saved_nodes != nodes:
        topology_notes.append(f"--resume: moving a checkpoint of {saved_nodes} nodes onto {nodes} ({world} workers "
                              "either way): model, optimizer state, step, schedule and data stream continue exactly "
                              "from its world-size-independent part")
    saved = payload.get("config")
    if not isinstance(saved, dict):
        return ["the checkpoint holds no config (written by an older quietsync); its flags were not compared"]
    now = _plain(dataclasses.asdict(cfg))
    saved = _plain(saved)
    step = int(_strategy_state(payload).get("steps", 0))
    was, has, notes = [], [], []
    for name in now:
        # a field the checkpoint's config lacks has nothing to be compared with
        if name not in saved or name in SAFE or name in TOPOLOGY or _same(name, saved[name], now[name]):
            continue
        flag = flag_name(name)
        if name in NOTED:
            effect = NOTED[name].format(step=step, old=saved[name], new=now[name])
            if name == "max_steps" and now.get("warmup_steps") is None:
                w_old, w_new = _warmup(saved[name], saved.get("warmup_steps")), _warmup(now[name], None)
                if w_old != w_new:
                    effect += f" (its default warm-up is {w_new} steps instead of {w_old})"
            notes.append(f"--resume: {_show(flag, saved[name])} -> {_value(now[name])}: {effect}")
        else:
            was.append(_show(flag, saved[name]))
            has.append(_show(flag, now[name]))
    # the strategy's flags as given (the batch policy may have rescaled the config the strategy ran with)
    saved_strategy = payload.get("strategy_flags", _strategy_state(payload).get("config"))
    if saved.get("strategy") == now["strategy"] and isinstance(saved_strategy, dict) and strategy_config:
        flags = _strategy_flags(cfg.strategy)
        current = _plain(dataclasses.asdict(strategy_config))
        saved_strategy = _plain(saved_strategy)
        for name, value in current.items():
            if name in saved_strategy and saved_strategy[name] != value:
                flag = flags.get(name, flag_name(name))
                was.append(_show(flag, saved_strategy[name]))
                has.append(_show(flag, value))
    if was:
        raise ResumeMismatch(
            f"--resume: the checkpoint was written with {', '.join(was)}; this run has {', '.join(has)} "
            "(these cannot change on resume: use the checkpoint's values, or start a new run)")
    position = float(payload.get("schedule_position", step))  # in steps of the run's first world (elastic.py)
    if cfg.max_steps <= position:
        at = f"step {step}" if position == step else f"step {step} (schedule position {position:g})"
        raise ResumeMismatch(f"--max-steps must be > the checkpoint's {at} to resume it, got {cfg.max_steps}")
    return topology_notes + notes


def _data_about(identity: dict[str, Any]) -> str:
    return (f"{identity['train_tokens']:,} training and {identity['eval_tokens']:,} held-out tokens, tokenizer "
            f"{identity['tokenizer'][:12]}, ids digest {identity['digest'][:12]}")


def data_change(payload: dict[str, Any], cfg: TrainConfig, identity: dict[str, Any],
                where: str | Path = "") -> str | None:
    """Why the checkpoint ``payload`` cannot go on with the data ``--dataset`` holds now, whose
    :func:`~quietsync.data.shards.data_identity` is ``identity`` (one line naming both), or None: the same data, or
    a checkpoint that does not record it (an older quietsync's)."""
    saved = payload.get("data_identity")
    if not isinstance(saved, dict) or saved.get("digest") == identity["digest"]:
        return None
    return (f"--resume: the checkpoint {where} was trained on other data than --dataset {cfg.dataset} holds now "
            f"(then: {_data_about(saved)}; now: {_data_about(identity)}), so its data position would point into "
            "other text: resume with the data it was trained on, or train on this data as a new run (a new --out)")


def _resume_folder(cfg: TrainConfig, world: int) -> Path:
    """The checkpoint folder ``--resume`` names, for a world of ``world`` (another world's is found too)."""
    if cfg.resume == "latest":
        folder = latest_checkpoint(cfg.out, range(world)) or latest_checkpoint(cfg.out, [0])
        if folder is None:
            raise ResumeMismatch(f"--resume found no complete checkpoint under {checkpoint_root(cfg.out)} "
                                 "(a run saves them with --save-every N)")
        return folder
    folder = Path(str(cfg.resume))
    if not rank_file(folder, 0).is_file():
        raise ResumeMismatch(f"--resume: {folder} is not a checkpoint folder (no {rank_file(folder, 0).name})")
    return folder


def check_resume(cfg: TrainConfig, strategy_config: Any, world: int, nodes: int | None,
                 data: Callable[[], dict[str, Any]] | None = None) -> list[str]:
    """The launcher's check of ``--resume``, before any worker starts: reads rank 0's file of the checkpoint
    (tensors memory-mapped, not read) and compares it with this run, and, when ``data`` is given, with the
    :func:`~quietsync.data.shards.data_identity` it returns (called once the flags passed: it may prepare the data);
    once it passes, sets aside the checkpoints of the branch a resume from an earlier checkpoint leaves
    (:func:`~quietsync.train.checkpoint.set_aside_later`); returns the notes to print.

    Raises :class:`ResumeMismatch` (one line) when there is nothing to resume or it cannot be continued.
    """
    folder = _resume_folder(cfg, world)
    try:
        payload = load_checkpoint(folder, 0, mmap=True)
    except ValueError as e:
        raise ResumeMismatch(f"--resume: {e}") from None
    notes = check_checkpoint(payload, cfg, strategy_config, world, nodes, folder)
    try:
        resolve_resume(str(folder), cfg.out, range(world))
    except ValueError as e:
        raise ResumeMismatch(f"--resume: {e}") from None
    problem = files_problem(folder, world, nodes)
    if problem is not None:
        raise ResumeMismatch(f"--resume: {problem}")
    if data is not None:
        problem = data_change(payload, cfg, data(), folder)
        if problem is not None:
            raise ResumeMismatch(problem)
        if not isinstance(payload.get("data_identity"), dict):
            notes.append(f"--resume: the checkpoint {folder} does not record which data it was trained on (an older "
                         f"quietsync wrote it): --dataset {cfg.dataset} is taken to hold the same")
    moved = set_aside_later(cfg.out, folder)
    return notes + ([moved] if moved else [])
