"""The flags of ``--fault-tolerance torchft``, checked before any worker starts: each bad combination is one line
naming the flag and what is allowed.

A torchft job is ``--nodes`` replica groups (at least 2) of ``W`` workers each: ``--nproc`` workers on this machine
split into ``--nodes`` groups by the local launcher, or, with ``--replica-group K --lighthouse HOST:PORT``, this
machine's one replica group (``--nproc`` workers, or torchrun's ``WORLD_SIZE``) of a job whose other groups run
elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from ..strategies.declaration import ReplicaPolicy
from ..strategies.registry import declaration
from .support import refusal, skip_problem

QUORUM_TIMEOUT_S = 120.0
"""The longest a round start waits for the Lighthouse and the other replicas, unless ``--timeout-s`` or
:data:`QUORUM_TIMEOUT_ENV` says more (a replica that restarts after the run ended waits this long, then stops)."""

QUORUM_TIMEOUT_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"
"""torchft's own variable for the quorum timeout, which takes precedence in its Manager: quietsync's waits follow it
too, so the two agree."""


def quorum_timeout_problem() -> str | None:
    """Why :data:`QUORUM_TIMEOUT_ENV` is not a usable number of seconds, or None (unset or fine)."""
    raw = os.environ.get(QUORUM_TIMEOUT_ENV)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        return f"--fault-tolerance torchft: {QUORUM_TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}"
    return None


def quorum_timeout_s(timeout_s: float) -> float:
    """How long a quorum waits for the Lighthouse and the other replicas: :data:`QUORUM_TIMEOUT_ENV` where set, else
    the larger of :data:`QUORUM_TIMEOUT_S` and ``timeout_s`` (``--timeout-s``)."""
    why = quorum_timeout_problem()
    if why:
        raise ValueError(why)
    raw = os.environ.get(QUORUM_TIMEOUT_ENV)
    return float(raw) if raw is not None else max(QUORUM_TIMEOUT_S, timeout_s)


UNSUPPORTED = {
    "elastic": "--elastic and --fault-tolerance torchft are two ways to survive lost nodes: choose one (torchft: no "
               "restarts, for the strategies whose replicas meet only at commits; --elastic: any strategy, torchrun "
               "restarts every worker from a checkpoint)",
    "resume": "--resume is not supported with --fault-tolerance torchft: a returning replica heals from a live peer "
              "instead of a checkpoint (torchft runs write no checkpoints yet)",
    "save_every": "--save-every is not supported with --fault-tolerance torchft: a returning replica heals from a "
                  "live peer instead of a checkpoint (torchft runs write no checkpoints yet)",
    "max_tokens": "--max-tokens is not supported with --fault-tolerance torchft: the run ends at --max-steps, "
                  "counted in tokens (the schedule's position), which every replica knows from the quorum",
    "max_time_s": "--max-time-s is not supported with --fault-tolerance torchft: the run ends at --max-steps, "
                  "counted in tokens, which every replica knows from the quorum (a clock is not agreed on)",
    "target_loss": "--target-loss is not supported with --fault-tolerance torchft: the run ends at --max-steps, "
                   "counted in tokens, which every replica knows from the quorum (evaluations are not agreed on)",
    "trace": "--trace is not supported with --fault-tolerance torchft (the merged trace gathers every worker's "
             "spans over a world whose members change)",
}
"""Job flags refused with ``--fault-tolerance torchft``, when set."""


def ft_problem(cfg: Any, strategy_config: Any, given: set[str], world: int, under_torchrun: bool) -> str | None:
    """Why this torchft job cannot run (one line naming the flag), or None; ``given``: the job fields set on the
    command line or in the config file; ``world``: workers on this machine (``--nproc``, or torchrun's)."""
    if cfg.fault_tolerance != "torchft":
        for name in ("lighthouse", "replica_group", "standby"):
            if getattr(cfg, name) is not None:
                flag = "--" + name.replace("_", "-")
                return f"{flag} needs --fault-tolerance torchft"
        if "async_join" in given and not cfg.async_join:  # the default (True) is what a replay's config file holds
            return "--no-async-join needs --fault-tolerance torchft"
        if "replica_restarts" in given:
            return "--replica-restarts needs --fault-tolerance torchft (it restarts torchft's replica groups)"
        if cfg.on_replicas_differ == "heal":
            return ("--on-replicas-differ heal needs --fault-tolerance torchft (a replica group that differs leaves "
                    "and heals from a live peer); without it, stop or warn")
        return None
    if importlib.util.find_spec("torchft") is None:
        return "--fault-tolerance torchft needs the torchft package: pip install 'quietsync[ft]'"
    why = quorum_timeout_problem()
    if why:
        return why
    facts = declaration(cfg.strategy).faults  # what the strategy declares for torchft: its one look-up here
    why = refusal(cfg.strategy, facts)
    if why or not isinstance(facts, ReplicaPolicy):
        return why
    for name, text in UNSUPPORTED.items():
        value = getattr(cfg, name)
        # None, False and 0 are these fields' defaults: only a flag that was set is refused
        if value not in (None, False, 0):
            return text
    if cfg.on_replicas_differ == "heal" and not cfg.check_replicas_every:
        return ("--on-replicas-differ heal needs --check-replicas-every N: the run's end is too late to heal (its "
                "check there says which replica groups differ)")
    if cfg.on_replicas_differ == "stop":
        return ("--on-replicas-differ stop is not supported with --fault-tolerance torchft: its replicas are compared "
                "at the run's end, after the last commit, and a group that differs mid-run can heal from a live peer "
                "instead (--on-replicas-differ heal)")
    if cfg.on_nonfinite == "skip" and skip_problem(cfg.strategy, facts):
        return skip_problem(cfg.strategy, facts)
    if cfg.precision == "fp16":
        return ("--precision fp16 is not supported with --fault-tolerance torchft (the loss scale's skip decision "
                "needs every replica's verdict outside the quorum's commits); use bf16 or fp32")
    # global is the default: refused only when asked for (command line or config file)
    if "batch_policy" in given and cfg.batch_policy == "global":
        return ("--batch-policy global is not supported with --fault-tolerance torchft: each replica's step keeps "
                "its micro-batches (the global batch shrinks while a replica is missing) and the learning-rate "
                "schedule follows tokens; leave --batch-policy out")
    hook = getattr(strategy_config, "comm_hook", "allreduce")
    if hook != "allreduce":
        return (f"--comm-hook {hook} is not supported with --fault-tolerance torchft: torch DDP's hook runs inside a "
                "replica group; the replicas average the gradient through the quorum (uncompressed)")
    if cfg.replica_group is not None:
        if cfg.lighthouse is None:
            return ("--replica-group needs --lighthouse HOST:PORT: a replica group started on its own meets the "
                    "others through the job's Lighthouse (quietsync lighthouse)")
        if cfg.nodes is None:
            return "--replica-group needs --nodes N: the number of replica groups of the job (at least 2)"
        replicas, workers = cfg.nodes, world
        if cfg.replica_group >= replicas:
            return f"--replica-group must be in [0, {replicas}) (--nodes {replicas}), got {cfg.replica_group}"
    else:
        if under_torchrun:
            return ("--fault-tolerance torchft under torchrun needs --replica-group K and --lighthouse HOST:PORT: "
                    "each torchrun job is one replica group of the job")
        replicas = cfg.nodes if cfg.nodes is not None else world
        if world % replicas:
            return f"--nodes must be a positive divisor of --nproc {world}, got {replicas}"
        workers = world // replicas
    if getattr(cfg, "standby", None) is not None and (cfg.replica_group is None or workers != 1):
        return ("--standby needs --replica-group K and one worker (--nproc 1): it stands by for one replica group's "
                f"single worker, got {'no --replica-group' if cfg.replica_group is None else f'{workers} workers'}")
    standby = getattr(cfg, "standby", None)
    if standby is not None:
        # the activation file must be one that can be created: else the standby would wait for it forever
        folder = Path(standby).expanduser().parent
        if not standby.strip() or Path(standby).is_dir():
            return f"--standby must name a file whose creation activates the standby, got {standby!r}"
        if not folder.is_dir():
            return f"--standby {standby}: its folder {folder} does not exist, so the file could never be created"
    if replicas < 2:
        return (f"--fault-tolerance torchft needs at least 2 replica groups (--nodes, default one per worker), got "
                f"{replicas}")
    if workers > 1 and facts.runs_one_worker(strategy_config):
        qualifier, hint = facts.one_worker_hint
        return (f"--strategy {cfg.strategy}{qualifier} keeps its state per worker, so under --fault-tolerance torchft "
                f"it runs with one worker per replica group; got {workers} (--nproc / --nodes){hint}")
    return None


def lighthouse_problem(address: str, timeout_s: float = 10.0) -> str | None:
    """Why the Lighthouse at ``address`` cannot be reached (one line naming --lighthouse), or None."""
    import time

    from .lighthouse import reachable

    t0 = time.monotonic()
    problem = reachable(address, timeout_s)
    if problem is None:
        return None
    # the time it took, beside the limit: a refused connection answers at once, a silent host at the limit
    return (f"--lighthouse {address}: no Lighthouse answered ({problem}, after {time.monotonic() - t0:.1f} s; the "
            f"check waits up to {timeout_s:g} s); start one with `quietsync lighthouse` (or torchft_lighthouse) and "
            "give its address")


__all__ = ["UNSUPPORTED", "ft_problem", "lighthouse_problem"]
