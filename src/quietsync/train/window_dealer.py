"""The data policy under torchft: every step deals one slot of windows per replica group of the job, and the
windows of a slot whose replica did not take part in the commit go back to the stream.

The training text is read as one sequence of windows: epoch after epoch, each epoch's seeded permutation of its
``seq_len`` windows (:class:`~quietsync.data.sequences.ShardedSequences`'s order with one reader), window ``g`` of
the sequence being window ``g mod N`` of epoch ``g div N``. :class:`WindowDealer` is the same on every replica
(it is part of the state a healing replica receives). At the start of every step it deals ``replicas`` slots of
``per_replica`` windows (``--accumulation`` × ``--micro-batch-size`` × the replica group's workers) -- first the
windows given back, round-robin from a slot that moves on every step, then fresh ones; replica group ``k`` trains
on slot ``k`` (inside it, worker ``i`` takes every
``W``-th window). The deal does not depend on who is present, so replicas agree on it even when their views of
the quorum differ for a moment (one retrying its round start while another already computes).

At every commit (:meth:`WindowDealer.commit`, called with the replica groups whose contribution the commit holds)
the windows dealt to those groups' slots since the previous commit, **up to the step that launched the commit**,
are **committed**; the other slots' windows of those steps -- a replica that died, left the quorum, or was absent --
are **given back** and dealt first again. So no window is trained twice and none is skipped, whatever the failures
-- except the windows a run still holds when it ends.

A commit usually lands within the step that launched it. One launched on a communication thread (streaming
DiLoCo's fragment, ``overlap_delay`` τ > 0) lands while the next steps run, at a moment that differs between
replicas: what it holds must not depend on that moment. So the dealer notes, in the caller's
:mod:`contextvars` context, the step last dealt; the communication worker runs a job in its submitter's context
as of submit (:mod:`quietsync.comm_worker`), so a commit reads the step it was launched at (its **mark**) and
holds the windows dealt up to it; the windows dealt after it stay open for the next commit. The windows a commit
gives back are dealt again from the step ``lag + 1`` after its mark (``lag`` = τ, the most steps a commit lands
after its launch; 0: the next step), so every replica deals the same windows wherever its commit landed.

The learning-rate schedule and ``--max-steps`` follow tokens: the schedule's position is the windows committed,
plus those dealt since to the replicas present, in units of the nominal step (every replica present), so it
advances by ``present / replicas`` per step while a replica is missing (the global batch shrinks; each replica's
step stays the same size).
"""

from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..data.sequences import ShardedSequences, gather_windows

KEEP_POSITIONS = 64
"""Steps whose starting position the dealer remembers (the schedule asks for the current step's)."""

_LAUNCHED: contextvars.ContextVar[tuple[object, int] | None] = contextvars.ContextVar(
    "quietsync_window_dealer_launched", default=None)
"""``(dealer, deals)``: the step last dealt by that dealer in this context (a commit's mark, module docstring)."""


@dataclass
class Deal:
    """The windows of one step, dealt and not yet committed or given back."""

    number: int
    """The step's deal number (1 for the dealer's first deal)."""
    slots: list[list[int]]
    """Each replica group's windows (slot k: replica group k)."""
    present: int
    """Windows dealt to the slots of the replicas present when dealt (the schedule's provisional position)."""


class WindowDealer:
    """Deals the windows of the training text to the replicas present (module docstring).

    Args:
        reader: a one-reader stream of the training text (rank 0 of 1): its epochs' window orders are read.
        per_replica: windows each replica takes per step.
        replicas: the job's replica groups (the nominal step holds ``replicas × per_replica`` windows).
        lag: the most steps after its launch a commit lands (streaming DiLoCo's ``overlap_delay``; 0: within the
            step that launched it).
    """

    def __init__(self, reader: ShardedSequences, per_replica: int, replicas: int, lag: int = 0) -> None:
        if reader.world_size != 1:
            raise ValueError("the dealer reads the windows' order from a one-reader stream (world_size 1)")
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        self.reader = reader
        self.per_replica, self.replicas, self.lag = int(per_replica), int(replicas), int(lag)
        self.windows_per_epoch = reader.num_windows
        self.fresh = 0
        """Windows of the sequence dealt so far (the next fresh window's index)."""
        self.given_back: list[int] = []
        """Windows dealt to replicas that left before committing them; dealt again first."""
        self.waiting: list[tuple[int, list[int]]] = []
        """Windows given back by commits, with the deal number from which they are dealt again (``lag``)."""
        self.deals = 0
        """Steps dealt so far (where the round-robin of given-back windows starts)."""
        self.open: list[Deal] = []
        """The steps dealt since the last commit's mark, oldest first."""
        self.committed = 0
        """Windows committed so far (every replica together)."""
        self.last_commit: dict[str, Any] = {"committed": [], "given_back": []}
        """The latest commit's committed and given-back windows (and its ``id``, ``members``, ``mark``)."""
        self.unlogged: list[dict[str, Any]] = []
        """Commits not yet taken by :meth:`take_commits` (the data audit logs them: a step can hold several, or
        none, e.g. streaming DiLoCo's fragment committed on the communication thread while the next step runs)."""
        self.positions: dict[int, float] = {}
        """Schedule position before each recent step, by the committed-step count at its start."""
        self._orders: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._token = object()
        """Names this dealer (and its state since the last load) in the marks it notes."""

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
            number = self.deals + 1
            for _, windows in [w for w in self.waiting if w[0] <= number]:
                self.given_back = windows + self.given_back
            self.waiting = [w for w in self.waiting if w[0] > number]
            slots: list[list[int]] = [[] for _ in range(self.replicas)]
            back, self.given_back = self.given_back, []
            for i, window in enumerate(back):
                slot = slots[(self.deals + i) % self.replicas]
                # slot full: the window waits for the next deal
                (slot if len(slot) < self.per_replica else self.given_back).append(window)
            for slot in slots:
                need = self.per_replica - len(slot)
                slot.extend(range(self.fresh, self.fresh + need))
                self.fresh += need
            self.open.append(Deal(number, slots, self.per_replica * len(set(members))))
            self.deals = number
            _LAUNCHED.set((self._token, number))
            return slots[me]

    def commit(self, present: list[int], commit_id: int | None = None) -> None:
        """A commit holding the contributions of the replica groups ``present``: their slots' windows dealt
        since the last commit, up to the commit's mark (module docstring), are committed, the other slots' given
        back (dealt again first, from ``lag + 1`` steps after the mark). ``commit_id``: the quorum's number for
        the commit (the same on every replica), kept for the audit."""
        launched = _LAUNCHED.get()
        with self._lock:
            mark = launched[1] if launched is not None and launched[0] is self._token else self.deals
            taken = [d for d in self.open if d.number <= mark]
            self.open = [d for d in self.open if d.number > mark]
            committed, back = [], []
            for k in range(self.replicas):
                for d in taken:
                    (committed if k in present else back).extend(d.slots[k])
            self.committed += len(committed)
            if back:
                self.waiting.append((mark + self.lag + 1, back))
            self.last_commit = {"id": commit_id, "members": sorted(present), "mark": mark, "committed": committed,
                                "given_back": back}
            self.unlogged.append(self.last_commit)

    def drop(self) -> list[int]:
        """A round dropped on every replica (``--on-nonfinite skip``: nothing committed): the windows dealt since the
        last commit go back, the rule for a slot whose replica did not take part in a commit, applied to every
        slot -- dealt again first from the next step, and the schedule's position is back where the last commit
        left it. Returns the windows given back (the data audit logs them)."""
        with self._lock:
            back = [w for d in self.open for s in d.slots for w in s]
            self.open = []
            if back:
                self.waiting.append((self.deals + self.lag + 1, back))
            return back

    def take_commits(self) -> list[dict[str, Any]]:
        """The commits since the last call, in commit order."""
        with self._lock:
            taken, self.unlogged = self.unlogged, []
        return taken

    def held(self) -> list[int]:
        """The windows dealt and neither committed nor given back yet, and those given back and not dealt again."""
        with self._lock:
            return sorted([w for d in self.open for s in d.slots for w in s] + self.given_back
                          + [w for _, ws in self.waiting for w in ws])

    # ------------------------------------------------------------------ tokens and the schedule
    def position(self) -> float:
        """The schedule's position: windows committed, and dealt since to the replicas present, in nominal steps."""
        with self._lock:
            return self._position()

    def _position(self) -> float:
        return (self.committed + sum(d.present for d in self.open)) / (self.replicas * self.per_replica)
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
                # the one reader's order of that epoch: the permutation ShardedSequences draws
                self.reader.continue_from(epoch, 0)
                order = self._orders[epoch] = self.reader.window_starts().clone()
                if len(self._orders) > 2:  # bounded: an evicted order is drawn again
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
        with self._lock:
            return {"fresh": self.fresh, "given_back": list(self.given_back),
                    "waiting": [[u, list(ws)] for u, ws in self.waiting],
                    "open": [[d.number, [list(s) for s in d.slots], d.present] for d in self.open],
                    "committed": self.committed, "deals": self.deals, "positions": dict(self.positions),
                    "per_replica": self.per_replica, "replicas": self.replicas, "lag": self.lag}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = (self.per_replica, self.replicas, self.lag)
        if (state["per_replica"], state["replicas"], state["lag"]) != mine:
            raise ValueError(f"the peer deals {state['per_replica']} windows per replica of {state['replicas']} "
                             f"(lag {state['lag']}), this replica {mine[0]} of {mine[1]} (lag {mine[2]}) (the same "
                             "flags on every replica group)")
        with self._lock:
            self.fresh, self.committed, self.deals = int(state["fresh"]), int(state["committed"]), int(state["deals"])
            self.given_back = list(state["given_back"])
            self.waiting = [(int(u), list(ws)) for u, ws in state["waiting"]]
            self.open = [Deal(int(n), [list(s) for s in slots], int(p)) for n, slots, p in state["open"]]
            self.positions = {int(k): float(v) for k, v in state["positions"].items()}
            self._token = object()  # marks noted before (any thread's context) no longer apply


__all__ = ["Deal", "WindowDealer"]
