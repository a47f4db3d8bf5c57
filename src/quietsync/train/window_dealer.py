"""The data policy under torchft: every step deals one slot of windows per replica group of the job, and the
windows of a slot whose replica did not take part in the commit go back to the stream.

The training text is read as one sequence of windows: epoch after epoch, each epoch's seeded permutation of its
``seq_len`` windows (:class:`~quietsync.train.data.ShardedSequences`'s order with one reader), window ``g`` of
the sequence being window ``g mod N`` of epoch ``g div N``. :class:`WindowDealer` is the same on every replica
(it is part of the state a healing replica receives). At the start of every step it deals ``replicas`` slots of
``per_replica`` windows (``--accumulation`` × ``--micro-batch-size`` × the replica group's workers) -- first the
windows given back, round-robin from a slot that moves on every step, then fresh ones; replica group ``k`` trains
on slot ``k`` (inside it, worker ``i`` takes every
``W``-th window). The deal does not depend on who is present, so replicas agree on it even when their views of
the quorum differ for a moment (one retrying its round start while another already computes).

At every commit (:meth:`WindowDealer.commit`, called with the replica groups whose contribution the commit holds)
the windows dealt since the previous commit to those groups' slots are **committed**; the other slots' windows --
a replica that died, left the quorum, or was absent -- are **given back** and dealt first at the next step. So no
window is trained twice and none is skipped, whatever the failures -- except the windows a run still holds when it
ends.

The learning-rate schedule and ``--max-steps`` follow tokens: the schedule's position is the windows committed,
plus those dealt since to the replicas present, in units of the nominal step (every replica present), so it
advances by ``present / replicas`` per step while a replica is missing (the global batch shrinks; each replica's
step stays the same size).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .data import ShardedSequences, gather_windows

KEEP_POSITIONS = 64
"""Steps whose starting position the dealer remembers (the schedule asks for the current step's)."""


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
        self.deals = 0
        """Steps dealt so far (where the round-robin of given-back windows starts)."""
        self.open: dict[int, list[int]] = {}
        """Windows dealt since the last commit, per replica group."""
        self.committed = 0
        """Windows committed so far (every replica together)."""
        self.last_commit: dict[str, list[int]] = {"committed": [], "given_back": []}
        """The latest commit's committed and given-back windows."""
        self.unlogged: list[dict[str, list[int]]] = []
        """Commits not yet taken by :meth:`take_commits` (the data audit logs them: a step can hold several, e.g.
        streaming DiLoCo's fragment committed on the communication thread while the next step runs)."""
        self.present_dealt = 0
        """Windows dealt since the last commit to the slots of the replicas present when dealt."""
        self.positions: dict[int, float] = {}
        """Schedule position before each recent step, by the committed-step count at its start."""
        self._orders: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ dealing
    def deal(self, members: list[int], me: int, step: int) -> list[int]:
        """The windows of replica group ``me`` (its slot) for the step that starts after ``step`` committed steps;
        ``members``: the current quorum's replica groups (only for the schedule's provisional position).

        Windows given back are dealt first, round-robin over the slots from a slot that moves on by one every
        step (so a window given back from an absent replica's slot reaches a present one's within ``replicas``
        steps); fresh windows fill the rest."""
        with self._lock:
            self.positions[step] = self._position()
            for old in [k for k in self.positions if k < step - KEEP_POSITIONS]:
                del self.positions[old]
            slots: list[list[int]] = [[] for _ in range(self.replicas)]
            back, self.given_back = self.given_back, []
            for i, window in enumerate(back):
                slot = slots[(self.deals + i) % self.replicas]
                (slot if len(slot) < self.per_replica else self.given_back).append(window)
            for slot in slots:
                need = self.per_replica - len(slot)
                slot.extend(range(self.fresh, self.fresh + need))
                self.fresh += need
            for k, taken in enumerate(slots):
                self.open.setdefault(k, []).extend(taken)
            self.deals += 1
            self.present_dealt += self.per_replica * len(set(members))
            return slots[me]

    def commit(self, present: list[int]) -> None:
        """A commit holding the contributions of the replica groups ``present``: their slots' windows since the
        last commit are committed, the other slots' given back (dealt again first)."""
        with self._lock:
            committed, back = [], []
            for k, windows in sorted(self.open.items()):
                (committed if k in present else back).extend(windows)
            self.committed += len(committed)
            self.given_back = back + self.given_back
            self.open = {}
            self.present_dealt = 0
            self.last_commit = {"committed": committed, "given_back": back}
            self.unlogged.append(self.last_commit)

    def take_commits(self) -> dict[str, list[int]] | None:
        """The commits since the last call, merged in commit order (None: none)."""
        with self._lock:
            taken, self.unlogged = self.unlogged, []
        if not taken:
            return None
        return {k: [w for c in taken for w in c[k]] for k in ("committed", "given_back")}

    # ------------------------------------------------------------------ tokens and the schedule
    def position(self) -> float:
        """The schedule's position: windows committed, and dealt since to the replicas present, in nominal steps."""
        with self._lock:
            return self._position()

    def _position(self) -> float:
        return (self.committed + self.present_dealt) / (self.replicas * self.per_replica)

    def position_at(self, step: int) -> float:
        """The position before the step that started after ``step`` committed steps (the lr of that step); the
        current position for a step not dealt (yet)."""
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
        return gather_windows(self.reader.tokens, starts, self.reader.seq_len)

    # ------------------------------------------------------------------ heal state
    def state_dict(self) -> dict[str, Any]:
        return {"fresh": self.fresh, "given_back": list(self.given_back),
                "open": {int(k): list(v) for k, v in self.open.items()}, "committed": self.committed,
                "present_dealt": self.present_dealt, "deals": self.deals, "positions": dict(self.positions),
                "per_replica": self.per_replica, "replicas": self.replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["per_replica"], state["replicas"]) != (self.per_replica, self.replicas):
            raise ValueError(f"the peer deals {state['per_replica']} windows per replica of {state['replicas']}, this "
                             f"replica {self.per_replica} of {self.replicas} (the same flags on every replica group)")
        self.fresh, self.committed = int(state["fresh"]), int(state["committed"])
        self.present_dealt, self.deals = int(state["present_dealt"]), int(state["deals"])
        self.given_back = list(state["given_back"])
        self.open = {int(k): list(v) for k, v in state["open"].items()}
        self.positions = {int(k): float(v) for k, v in state["positions"].items()}


__all__ = ["WindowDealer"]
