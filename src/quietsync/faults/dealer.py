"""The data policy under torchft: windows are dealt per step to the replicas present, and a missing replica's
windows go back to the stream.

The training text is read as one sequence of windows: epoch after epoch, each epoch's seeded permutation of its
``seq_len`` windows (:class:`~quietsync.train.data.ShardedSequences`'s order with one reader), window ``g`` of
the sequence being window ``g mod N`` of epoch ``g div N``. :class:`WindowDealer` is the same on every replica
(it is part of the state a healing replica receives) and, at the start of every step, deals each member of the
current quorum, in rank order, its ``per_replica`` windows (``--accumulation`` × ``--micro-batch-size`` × the
replica group's workers): first the windows given back, then fresh ones. Inside a replica group worker ``i``
takes every ``W``-th of them.

At every commit (:meth:`WindowDealer.commit`, called with the replicas whose contribution the commit holds) the
windows dealt since the previous commit to the replicas present are **committed**; those dealt to a replica that
is not (it died, or left the quorum) are **given back** and dealt first at the next step. So no window is
trained twice and none is skipped, whatever the failures -- except the windows a run still holds when it ends.

The learning-rate schedule and ``--max-steps`` follow tokens: the schedule's position is the windows committed
and dealt since, in units of the nominal step (every replica present), so it advances by ``present / replicas``
per step while a replica is missing (the global batch shrinks; each replica's step stays the same size).
"""

from __future__ import annotations

from typing import Any

import torch

from ..train.data import ShardedSequences


class WindowDealer:
    """Deals the windows of the training text to the replicas present (module docstring).

    Args:
        reader: a one-reader stream of the training text (rank 0 of 1): its epochs' window orders are read.
        per_replica: windows each replica takes per step.
        replicas: the job's replica groups (the nominal step holds ``replicas × per_replica`` windows).
    """

    def __init__(self, reader: ShardedSequences, per_replica: int, replicas: int) -> None:
        if reader.world_size != 1:
            raise ValueError("the dealer reads the windows' order from a one-reader stream (world_size 1)")
        self.reader = reader
        self.per_replica, self.replicas = int(per_replica), int(replicas)
        self.windows_per_epoch = reader.num_windows
        self.fresh = 0
        """Windows of the sequence dealt so far (the next fresh window's index)."""
        self.given_back: list[int] = []
        """Windows dealt to replicas that left before committing them; dealt again first."""
        self.open: dict[int, list[int]] = {}
        """Windows dealt since the last commit, per replica group."""
        self.committed = 0
        """Windows committed so far (every replica together)."""
        self.last_commit: dict[str, list[int]] = {"committed": [], "given_back": []}
        """The latest commit's committed and given-back windows (the data audit logs them)."""
        self.positions: dict[int, float] = {}
        """Schedule position before each step of the open round, by committed-step count at its start."""
        self._orders: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ dealing
    def _take(self, count: int) -> list[int]:
        taken = self.given_back[:count]
        self.given_back = self.given_back[count:]
        need = count - len(taken)
        taken += list(range(self.fresh, self.fresh + need))
        self.fresh += need
        return taken

    def deal(self, members: list[int], me: int, step: int) -> list[int]:
        """The windows of replica group ``me`` for the step that starts after ``step`` committed steps, dealt to
        every one of ``members`` (the quorum, in rank order) alike on every replica."""
        if me not in members:
            raise ValueError(f"replica {me} is not among the members {members}")
        self.positions[step] = self.position()
        mine: list[int] = []
        for member in members:
            taken = self._take(self.per_replica)
            self.open.setdefault(member, []).extend(taken)
            if member == me:
                mine = taken
        return mine

    def commit(self, present: list[int]) -> None:
        """A commit holding the contributions of ``present``: their open windows are committed, the others'
        given back (dealt again first)."""
        committed, back = [], []
        for member, windows in sorted(self.open.items()):
            (committed if member in present else back).extend(windows)
        self.committed += len(committed)
        self.given_back = back + self.given_back
        self.open = {}
        self.last_commit = {"committed": committed, "given_back": back}
        self.positions = {}

    # ------------------------------------------------------------------ tokens and the schedule
    def position(self) -> float:
        """The schedule's position: windows committed and dealt since, in nominal steps."""
        dealt = self.committed + sum(len(w) for w in self.open.values())
        return dealt / (self.replicas * self.per_replica)

    def position_at(self, step: int) -> float:
        """The position before the step that started after ``step`` committed steps (the lr of that step); the
        current position for a step not dealt in the open round."""
        return self.positions.get(step, self.position())

    # ------------------------------------------------------------------ the windows themselves
    def starts(self, windows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(epochs, token offsets)`` of ``windows`` (indices into the sequence)."""
        index = torch.tensor(windows, dtype=torch.long)
        epochs = index // self.windows_per_epoch
        starts = torch.empty_like(index)
        for epoch in epochs.unique().tolist():
            order = self._orders.get(epoch)
            if order is None:
                self.reader.continue_from(epoch, 0)
                order = self._orders[epoch] = self.reader.window_starts().clone()
                if len(self._orders) > 2:
                    self._orders.pop(min(self._orders))
            mask = epochs == epoch
            starts[mask] = order[index[mask] % self.windows_per_epoch]
        return epochs, starts

    def batch(self, windows: list[int]) -> torch.Tensor:
        """The token ids of ``windows``, ``[len(windows), seq_len]``."""
        _, starts = self.starts(windows)
        seq = self.reader.seq_len
        return self.reader.tokens[starts[:, None] + torch.arange(seq)[None, :]]

    # ------------------------------------------------------------------ heal state
    def state_dict(self) -> dict[str, Any]:
        return {"fresh": self.fresh, "given_back": list(self.given_back),
                "open": {int(k): list(v) for k, v in self.open.items()}, "committed": self.committed,
                "positions": dict(self.positions), "per_replica": self.per_replica, "replicas": self.replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["per_replica"], state["replicas"]) != (self.per_replica, self.replicas):
            raise ValueError(f"the peer deals {state['per_replica']} windows per replica of {state['replicas']}, this "
                             f"replica {self.per_replica} of {self.replicas} (the same flags on every replica group)")
        self.fresh, self.committed = int(state["fresh"]), int(state["committed"])
        self.given_back = list(state["given_back"])
        self.open = {int(k): list(v) for k, v in state["open"].items()}
        self.positions = {int(k): float(v) for k, v in state["positions"].items()}


__all__ = ["WindowDealer"]
