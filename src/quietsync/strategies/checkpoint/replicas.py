"""Per-replica state in a logical checkpoint, and what each replica gets when their number changes.

A **replica** is the unit that owns state no other unit shares: a worker (``localsgd``, ``diloco`` with local
inner steps, ``demo``: each worker's inner optimizer moments, drifting parameters, decoupled momentum, error
feedback) or a node (``flexdemo``, hierarchical ``diloco``: each node's decoupled momentum or inner model). The
world-size-independent rest (θ_global, the outer optimizer, counters) is written once; each replica writes its
own state under ``replica.<i>.`` (sharded over its node's workers where the strategy shards it).

The policy when a job resumes on ``R'`` replicas from a checkpoint written by ``R`` — the same for every
strategy, so a new per-replica slot only declares its :data:`JoinRule`:

* replica ``i < min(R, R')``, a **survivor**, takes replica ``i``'s saved state unchanged: exact, it continues
  that replica's trajectory (at an unchanged count every replica is a survivor, so the logical path is exact);
* replica ``i >= R``, a **joiner**, builds each key by its rule:

  - ``mean`` — the mean over the ``R`` saved replicas (their common value, bit for bit, when they agree:
    optimizer moments averaged at a sync, step counts); integer tensors (counters) take replica 0's value;
  - ``zero`` — nothing accumulated yet: what a worker owes the others (error-feedback residuals, decoupled
    momentum) starts empty, as at the start of a run — a joiner has computed nothing it has not sent;
  - ``skip`` — not read: the strategy fills it from the world-independent state (its parameters from θ_global);

* replica ``i >= R'``, a **leaver**, is dropped: its drift since the last sync, its residual and its momentum
  are lost (the approximation a shrinking job makes; the docs table says per strategy what that is).

Which old replica a new one continues is decided by index, not by machine: under torchrun ranks are assigned
anew at every restart, and any saved replica's state is a valid trajectory for any worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import torch

from .logical import ReshardError, SavedTensors, local_part

JoinRule = Literal["mean", "zero", "skip"]
"""What a joining replica gets for one key (see the module docstring)."""

JOIN_RULES = ("mean", "zero", "skip")

REPLICA = "replica."


def prefix(replica: int) -> str:
    """``replica.<i>.``: where replica ``i`` keeps its state."""
    return f"{REPLICA}{replica}."


def own(replica: int, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under replica ``replica``'s prefix (what it writes)."""
    head = prefix(replica)
    return {head + k: v for k, v in state.items()}


def saved_replicas(saved: SavedTensors) -> list[int]:
    """The replicas a checkpoint holds state of, in order."""
    found = set()
    for key in saved:
        if key.startswith(REPLICA):
            index = key[len(REPLICA):].split(".", 1)[0]
            if index.isdigit():
                found.add(int(index))
    return sorted(found)


def view(saved: SavedTensors, replica: int) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Replica ``replica``'s saved keys without their prefix."""
    head = prefix(replica)
    return {k[len(head):]: v for k, v in saved.items() if k.startswith(head)}


def _zero(t: torch.Tensor) -> torch.Tensor:
    local_part(t).zero_()
    return t


class ReplicaLoad:
    """How one replica reads its state from a logical checkpoint of any number of replicas.

    ``build(keys)`` gives targets in this worker's layout (plain tensors or DTensors) for one replica's saved
    ``keys`` (unprefixed ``{key: (shape, dtype)}``); ``rule(key)`` is the key's :data:`JoinRule`. After
    :attr:`targets` (merged into the strategy's targets) were filled by the checkpoint's reader,
    :meth:`merged` returns this replica's state by unprefixed key. :attr:`joined` says whether this replica is
    new (then ``skip`` keys hold zeros for the strategy to overwrite).
    """

    def __init__(self, saved: SavedTensors, replica: int,
                 build: Callable[[Mapping[str, tuple[torch.Size, torch.dtype]]], dict[str, torch.Tensor]],
                 rule: Callable[[str], JoinRule]) -> None:
        self.old = saved_replicas(saved)
        if not self.old:
            raise ReshardError("the checkpoint holds no per-replica state (replica.<i>.*): was it written by "
                               "this strategy?")
        self.replica = replica
        self.joined = replica not in self.old
        self.rule = rule
        self.targets: dict[str, torch.Tensor] = {}
        """What to read (keys with their ``replica.<q>.`` prefix)."""
        self._mine: dict[str, torch.Tensor] = {}
        if not self.joined:
            self.targets = own(replica, build(view(saved, replica)))
            return
        first = build(view(saved, self.old[0]))
        for key, t in first.items():
            how = rule(key)
            if how not in JOIN_RULES:
                raise ValueError(f"join rule of {key} must be one of {', '.join(JOIN_RULES)}, got {how!r}")
            # zero and skip keys are read from no replica: they start as zeros here
            if how != "mean":
                self._mine[key] = _zero(t)
        for q in self.old:
            built = first if q == self.old[0] else build(view(saved, q))
            for key, t in built.items():
                if key not in self._mine:
                    self.targets[prefix(q) + key] = t

    def merged(self, filled: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This replica's state by unprefixed key: its own saved values, or (a joiner) each key by its rule."""
        if not self.joined:
            head = prefix(self.replica)
            return {k[len(head):]: v for k, v in filled.items() if k.startswith(head)}
        out = dict(self._mine)
        head0 = prefix(self.old[0])
        for key0, first in filled.items():
            if not key0.startswith(head0):
                continue
            key = key0[len(head0):]
            if key in out:
                continue
            values = [local_part(filled[prefix(q) + key]) for q in self.old]
            base = local_part(first)
            if not base.is_floating_point() or all(torch.equal(values[0], v) for v in values[1:]):
                out[key] = first  # counters, and state the replicas agree on: exactly theirs
                continue
            # a float64 sum, rounded once into the state's own dtype
            total = values[0].to(torch.float64, copy=True)
            for v in values[1:]:
                total += v
            # in place into replica 0's target, so a DTensor keeps its layout
            base.copy_(total.div_(len(values)).to(base.dtype))
            out[key] = first
        return out


__all__ = ["JOIN_RULES", "JoinRule", "ReplicaLoad", "own", "prefix", "saved_replicas", "view"]
