"""The per-step quorum of one replica group: torchft's Manager, and the protocol quietsync runs on it.

Each replica group runs torchft's :class:`~torchft.manager.Manager` (synchronous quorum: a replica that heals
does so before it computes anything) against the job's Lighthouse. :class:`ReplicaQuorum` drives it:

* **rounds** — :meth:`start_round` asks for a quorum at a round boundary: before the first micro-batch
  (:meth:`join`), and after every commit, before the next micro-batch. Replicas that (re)start join here; a
  replica behind the others (a fresh process) **heals**: it receives the state of a live peer — the strategy's
  (θ, optimizer and outer state, counters), the data position and the schedule's — through the peer checkpoint
  (:mod:`~quietsync.faults.peer_checkpoint`), and continues from there with everyone. A round start that fails
  (a peer died while connecting or while sending the checkpoint) is asked again.
* **commits** — every collective over the replicate dimension runs in :meth:`run`: the collective, then
  ``should_commit`` (every worker of the replica group agrees; an error anywhere means no). A failed collective
  (a replica died: gloo sees its connections close) is retried with the same payload among the survivors:
  a quorum restricted to the previous members (``shrink_only``; nobody joins or heals mid-step) forms once the
  dead replica's heartbeats stop (the Lighthouse's ``--heartbeat-timeout-ms``), and the collective runs again.
  The caller only ever sees a committed result; a replica that finds itself behind the others (a commit they
  made failed here) stops with :class:`FellBehind`, one whose heal source died mid-transfer with
  :class:`HealFailed`; restarted (the local launcher does it; on a cluster, the scheduler), each heals from a live
  peer.

* **the non-finite vote** — every unit :meth:`run` commits begins with one small all-reduce over the replicas
  present: each replica group's verdict on its own round (:mod:`~quietsync.train.replica_nonfinite`; 0 when finite).
  When any is not 0, no replica runs the unit's collectives: each reports the error to torchft
  (``report_error``), so ``should_commit`` is False in every replica group and nothing commits (torchft's step
  does not advance), and :class:`RoundDropped` tells the caller who saw what, the same on every replica. torchft's
  own vote only agrees inside a replica group ("different replica groups may return different values"); the
  all-reduce is what makes the verdict the same across them. A replica whose round is not finite does not step:
  it runs :meth:`vote` at once, which meets the others' next unit. The same all-reduce says which replica groups
  contribute to the unit (all of them, but for one abstaining from its first step after a heal:
  :mod:`~quietsync.faults.async_join`): the unit's averages divide by their number (:attr:`contributing`), and the
  commit holds their data only. It also carries each worker's fingerprint of its committed parameters when a replica
  check is due (:attr:`ReplicaQuorum.marks`, ``--check-replicas-every``), so that check adds no collective.

  A unit whose collective timed out (a member is late, or frozen) does not ask for the next quorum at once: its
  replicas first meet in the failed quorum's store (:mod:`~quietsync.faults.meeting`), each waiting for the others to
  reach the unit, as long as the unit's patience (:meth:`ReplicaQuorum.patience_s`: the quorum timeout, or 9 of this
  replica's rounds where longer) -- a quorum request now would be answered without a slower, heartbeating minority
  once the Lighthouse's join timeout passed. A member whose attempt failed on a closed connection says it arrived
  and does not wait (a death is the Lighthouse's to see). Members still missing when the patience has passed
  (more than 10x slower while making progress) are **left behind**: the replicas that met ask for a quorum without
  them for up to :data:`LEAVE_S` more -- the Lighthouse forms one once more than half of the live replica groups
  ask and its join timeout has passed -- and go on; only where they are not such a majority do they stop
  (:class:`NoQuorum`). A member hung with its heartbeats going leaves by itself before that, at half the quorum
  timeout (:mod:`~quietsync.faults.stall`): it is restarted and heals, and the others go on even where they are
  not a majority. A replica whose attempt failed and whom the Lighthouse's last quorum no longer holds
  (the others went on without it) stops with :class:`FellBehind` before it asks for anything: a quorum of its own
  would commit a unit the others never see.

* **a lost Lighthouse** — the replicas go on: a quorum request the Lighthouse does not answer within
  :data:`LIGHTHOUSE_ATTEMPT_S` is asked again (torchft 0.2.0's manager never answers a request whose Lighthouse
  call failed -- its own "resulting in a hang" -- until the request's timeout; asked again, the request reaches a
  Lighthouse started again at the same address, which forms the quorum afresh from the replicas that ask). The
  collectives and commits do not involve the Lighthouse, so only round starts wait for it. A Lighthouse that stays
  away for ``quorum_timeout_s`` stops every replica waiting on it with one line naming it (:class:`NoQuorum`).
  A Lighthouse started again numbers its quorums from 1 again, and torchft reconnects a replica's group only when
  the number changes, at a store prefix named by it: a repeated number would keep a group whose members changed,
  or meet the stale keys of the earlier quorum of that number. :class:`_Renumbered` numbers each quorum by its
  Lighthouse number *and its members' incarnations* (torchft's replica ids, a fresh uuid per process), and the
  group's prefix adds the quorum's step.

Every commit is counted (``commits``) and announced to the listeners (:meth:`on_commit`) with the replicas that
took part and its number (torchft's step after it: the same on every replica that made it), so the data policy
(:mod:`~quietsync.train.window_dealer`) knows whose micro-batches entered the model.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch

from ..errors import cause_chain
from ..strategies.local.arrival import SYNC_PATIENCE, sync_patience
from .flags import QUORUM_TIMEOUT_ENV
from .meeting import ARRIVED, meet, missing
from .peer_checkpoint import PeerCheckpoint
from .replica_group import replica_id
from .stall import StallWatch, stall_limit_s
from .transport import FaultTolerantTransport, ReplicaLost

LIGHTHOUSE_ATTEMPT_S = 20.0
"""A quorum request the Lighthouse has not answered within this long is asked again (module docstring). Longer than
any wait a live Lighthouse makes a request do (its join timeout, 10 s by default, then a tick): keep the
Lighthouse's ``--join-timeout-ms`` under it."""

LEAVE_S = LIGHTHOUSE_ATTEMPT_S
"""How long replicas that waited a unit's patience for late members ask for a quorum without them (module docstring):
one request of this length, longer than the Lighthouse's join timeout, which a shorter request asked again would
start afresh."""

HEAL_KEY = "quietsync"
"""The key under which a replica's heal state travels (torchft's ``register_state_dict_fn``)."""


class FellBehind(RuntimeError):
    """This replica missed a commit its peers made; restarted, it heals from one of them."""


class HealFailed(RuntimeError):
    """The peer this replica was healing from died mid-transfer; restarted, it heals from another live peer."""


class RoundDropped(RuntimeError):
    """The unit's vote found a non-finite round on some replica group: nothing was committed (every replica raises
    it at the same unit). ``verdicts``: replica group → ``(code, step)`` for each group that reported one."""

    def __init__(self, verdicts: dict[int, tuple[int, int]]) -> None:
        self.verdicts = verdicts
        super().__init__(f"a non-finite round on replica group(s) {sorted(verdicts)}: nothing committed")


class NoQuorum(RuntimeError):
    """No quorum could commit a collective, or form, within the time allowed."""


def quorum_number(lighthouse_number: int, replica_ids: Sequence[str]) -> int:
    """A quorum's number as this replica's torchft Manager sees it: the Lighthouse's number and the members'
    incarnations (module docstring), hashed to 48 bits. The same on every member of the quorum; it changes whenever
    the Lighthouse's does (one Lighthouse gives a number to one set of members)."""
    # sorted: every member must hash the same text, whatever order the answer lists the ids in
    key = f"{lighthouse_number}|{','.join(sorted(replica_ids))}".encode()
    return int.from_bytes(hashlib.sha1(key).digest()[:6], "big")


class _Renumbered:
    """torchft's ``ManagerClient``, whose quorum answers carry :func:`quorum_number` as ``quorum_id`` and hand the
    quorum's step to the replica group (its store prefix: :meth:`ReplicaProcessGroup.configure`)."""

    def __init__(self, client: Any, group: Any) -> None:
        self._client, self._group = client, group

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self._group.quorum_step = int(result.max_step)
        self._group.member_ids = list(result.replica_ids)
        return _Answer(result, quorum_number(result.quorum_id, result.replica_ids))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class _Answer:
    """A quorum answer with another ``quorum_id``."""

    def __init__(self, answer: Any, quorum_id: int) -> None:
        self._answer, self.quorum_id = answer, quorum_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._answer, name)


class ReplicaQuorum:
    """torchft's Manager for one worker of a replica group, and the round/commit protocol (module docstring).

    Args:
        transport: this worker's :class:`~quietsync.faults.transport.FaultTolerantTransport`.
        lighthouse: the Lighthouse's address (``http://host:port``, or ``host:port``).
        store: ``(host, port)`` of the replica group's TCPStore (its server must be running).
        timeout_s: collectives, commits and the peer checkpoint wait at most this long.
        quorum_timeout_s: a quorum waits at most this long for the Lighthouse (and the other replicas).
        hostname: the address other replicas reach this replica group's manager at.
        attempt_s: a quorum request unanswered this long is asked again (:data:`LIGHTHOUSE_ATTEMPT_S`).
    """

    def __init__(self, transport: FaultTolerantTransport, lighthouse: str, store: tuple[str, int], *,
                 timeout_s: float, quorum_timeout_s: float, hostname: str = "127.0.0.1",
                 attempt_s: float = LIGHTHOUSE_ATTEMPT_S) -> None:
        from torchft.manager import Manager

        # only errors: torchft logs every quorum and commit, and a replica's loop stays quiet (docs/faults.md)
        for name in ("torchft", "torchft.manager", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.ERROR)
        self.transport = transport
        self.timeout_s, self.quorum_timeout_s = float(timeout_s), float(quorum_timeout_s)
        self.attempt_s = min(float(attempt_s), self.quorum_timeout_s)  # one attempt never outlasts the whole wait
        self.lighthouse = lighthouse
        self.lighthouse_lost = 0
        """How many times this replica found the Lighthouse not answering a quorum request."""
        self._saves: dict[str, Callable[[], Any]] = {}
        self._loads: dict[str, Callable[[Any], None]] = {}
        self._listeners: list[Callable[[list[int], int], None]] = []
        self._running = False
        self.since = time.monotonic()
        """When this replica last committed a unit or started a round: a unit's patience is timed from there."""
        self.round_due = True
        """Whether a round boundary is due (a commit happened since the last quorum; or nothing yet)."""
        self.joined = False
        self.healed = 0
        """How many times this replica took a peer's state."""
        self.commits = 0
        """Collectives committed over the replicate dimension."""
        self.verdict: tuple[int, int] = (0, 0)
        """This replica group's verdict on its open round, ``(code, step)``, sent with the next unit's vote (0: the
        round is finite; set by :class:`~quietsync.train.replica_nonfinite.ReplicaNonFinite`)."""
        self.retries = 0
        """Attempts of a collective that failed and were run again among the survivors."""
        self.async_join = False
        """Whether a heal makes this replica abstain from its first step (:mod:`~quietsync.faults.async_join`; set
        by the loop where the strategy allows it)."""
        self.abstains = False
        """Whether this replica's next commit carries no contribution of its own (an asynchronous join's first
        step: set by a heal under :attr:`async_join`, cleared by the commit)."""
        self.marks: tuple[int, int, int] | None = None
        """``(step, first, second)``: this worker's fingerprint of its committed parameters after ``step``
        (``--check-replicas-every``: :mod:`quietsync.train.replicas`), sent with the next unit's vote; cleared once
        sent."""
        self.received_marks: dict[int, tuple[int, int, int]] = {}
        """What the last vote that carried any brought: replica group -> its counterpart worker's :attr:`marks`
        (each worker meets the workers of its own place in the other groups); taken by the loop."""
        self.contributing: int | None = None
        """Inside a unit: how many replica groups contribute to it (its vote counts them; an abstaining one does
        not), the divisor of its averages; None outside a unit."""
        self._contributors: list[int] = []
        self.rounds: list[dict[str, Any]] = []
        """Phases of the round starts that changed the quorum or moved state since :meth:`take_rounds` (see
        :meth:`_phases`)."""
        self._marks: dict[str, float] = {}
        self.watch: StallWatch | None = None
        """The stall watch (:mod:`~quietsync.faults.stall`), from the first quorum until :meth:`unwatch`."""
        address = lighthouse if "://" in lighthouse else f"http://{lighthouse}"
        self.checkpoint = PeerCheckpoint(transport, timeout_s)
        """How this replica sends its state to a healing peer, and receives one's."""
        self.manager = Manager(
            # min 1: a lone survivor commits on its own; the heal state is registered below, by key
            pg=transport.replica_group, load_state_dict=None, state_dict=None, min_replica_size=1,
            use_async_quorum=False, init_sync=False,
            timeout=timedelta(seconds=timeout_s), quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timedelta(seconds=min(timeout_s, 30.0)), rank=transport.local_rank,
            world_size=transport.workers, store_addr=store[0], store_port=store[1], lighthouse_addr=address,
            replica_id=replica_id(transport.replica), hostname=hostname,
            heartbeat_interval=timedelta(milliseconds=100),
            checkpoint_transport=self.checkpoint)
        self.manager.register_state_dict_fn(HEAL_KEY, self._load, self._save)
        self.manager._client = _Renumbered(self.manager._client, transport.replica_group)  # a Lighthouse restart
        transport.quorum = self

    # ------------------------------------------------------------------ what a healing replica receives
    def register(self, key: str, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """Send ``save()`` to a replica that heals from this one; ``load(state)`` on the one that heals."""
        if key in self._saves:
            raise ValueError(f"heal state {key!r} is registered twice")
        self._saves[key], self._loads[key] = save, load

    def on_commit(self, listener: Callable[[list[int], int], None]) -> None:
        """Call ``listener(members, number)`` after every commit (``members``: the replica groups whose contribution
        it holds -- those that took part, less one abstaining in an asynchronous join; ``number``: torchft's step
        after the commit, the same on every replica that made it)."""
        self._listeners.append(listener)

    def _save(self) -> dict[str, Any]:
        self._marks["snapshot"] = time.time()
        return {key: save() for key, save in self._saves.items()}

    def _load(self, state: dict[str, Any]) -> None:
        for key, load in self._loads.items():
            load(state[key])
        self.healed += 1
        self.abstains = self.async_join
        self._marks["applied"] = time.time()

    # ------------------------------------------------------------------ rounds
    def join(self) -> bool:
        """The first round: connect to the other replicas (healing if they are ahead). Returns whether this
        replica healed.

        A replica that finds no commit made yet (step 0) and not every replica group of the job in its quorum
        asks again until they all are: a fresh job starts with all its replica groups, so a replica that comes
        up while the others are busy -- or after they finished -- never starts a job of its own (it would train
        from scratch beside them: split brain). It waits at most ``quorum_timeout_s`` (:class:`NoQuorum`)."""
        deadline = time.monotonic() + self.quorum_timeout_s
        while True:
            healed = self.start_round()
            members = self.members
            if healed or self.manager.current_step() > 0 or len(members) == self.transport.replicas:
                break
            if time.monotonic() > deadline:
                raise NoQuorum(f"quietsync: replica group {self.transport.replica} found no commit made and only "
                               f"replica group(s) {members} of {self.transport.replicas} within "
                               f"{self.quorum_timeout_s:g}s: a fresh job starts with all of them (or the job had "
                               "already finished)")
            time.sleep(0.1)
        self.joined = True
        self.watch = StallWatch(stall_limit_s(self.quorum_timeout_s), self._waiting_for_this, self._stall_line,
                                label=f"replica group {self.transport.replica}, worker {self.transport.local_rank}")
        return healed

    def start_round(self) -> bool:
        """A quorum at a round boundary (new replicas join; one behind heals here). Returns whether this replica
        healed. Asked again while a member fails during it, until ``quorum_timeout_s``."""
        with self._waits():
            return self._start_round()

    def _start_round(self) -> bool:
        deadline = time.monotonic() + self.quorum_timeout_s
        before = self.healed
        generation, sent = self.transport.replica_group.generation, self.checkpoint.sent_bytes
        self._marks = {"asked": time.time()}
        while True:
            self._ask(allow_heal=True)
            if self.manager.errored() is None and self.manager.participating_rank() is not None:
                break
            if self.checkpoint.receiving:  # it stays a member of that quorum: the survivors' retries would wait on it
                raise HealFailed("quietsync: the replica this one was healing from died during the transfer; it "
                                 "stops, and once restarted it heals from another live peer")
            if time.monotonic() > deadline:
                raise NoQuorum(f"no quorum formed within {self.quorum_timeout_s:g}s "
                               f"({self.manager.errored() or 'not a participant'})")
        self.round_due = False
        self.since = time.monotonic()
        self._marks["returned"] = time.time()
        if (self.transport.replica_group.generation != generation or self.checkpoint.sent_bytes != sent
                or self.healed != before):
            self.rounds.append(self._phases(sent_bytes=self.checkpoint.sent_bytes - sent))
        return self.healed > before

    def patience_s(self) -> float:
        """How long a unit waits for the other replica groups in all: ``quorum_timeout_s``, or ``SYNC_PATIENCE``
        times this replica's seconds since its last commit or round start where that is longer -- a slower replica
        group, still heartbeating, reaches a local strategy's outer sync up to that many of this one's rounds later
        (the rule of :mod:`~quietsync.strategies.local.arrival`)."""
        return sync_patience(self.quorum_timeout_s, time.monotonic() - self.since)

    def _ask(self, allow_heal: bool, shrink_only: bool = False, patience_s: float | None = None,
             deadline: float | None = None, attempt_s: float | None = None) -> None:
        """torchft's ``start_quorum``, asked again while the Lighthouse does not answer (module docstring), until
        ``deadline`` (``time.monotonic()``; default ``patience_s`` from now, itself ``quorum_timeout_s`` by default:
        :class:`NoQuorum`, naming the Lighthouse, or the replica groups that did not come); each request waits at
        most ``attempt_s`` (default :attr:`attempt_s`)."""
        from .lighthouse import reachable

        patience = self.quorum_timeout_s if patience_s is None else patience_s
        if deadline is None:
            deadline = time.monotonic() + patience
        lost = False
        while True:
            # floored: near the deadline the time left may be zero or negative
            attempt = max(0.5, min(attempt_s or self.attempt_s, deadline - time.monotonic()))
            try:
                self.manager.start_quorum(allow_heal=allow_heal, shrink_only=shrink_only,
                                          timeout=timedelta(seconds=attempt))
            except TimeoutError:
                # torchft keeps the failed request's future and raises its error again at the next start_quorum
                self.manager._quorum_future = None
                why = reachable(self.lighthouse, 2.0)
                if time.monotonic() >= deadline:
                    others = [k for k in self.members if k != self.transport.replica]
                    if why is None and shrink_only and others:  # inside a unit: a live member has not reached it
                        raise NoQuorum(
                            f"quietsync: replica group {self.transport.replica}: no quorum for {patience:g}s inside "
                            f"a collective: the Lighthouse at {self.lighthouse} is up, and replica group(s) {others} "
                            f"of the last quorum, alive, have not reached this collective {_PATIENCE}; the replica "
                            f"stops. To wait longer for slower replica groups, {_longer(patience)}") from None
                    raise NoQuorum(f"quietsync: replica group {self.transport.replica}: the Lighthouse at "
                                   f"{self.lighthouse} answered no quorum request for {patience:g}s ("
                                   f"{why or 'it is up, but formed no quorum'}); the replica stops") from None
                if why is None and shrink_only and any(k != self.transport.replica for k in self.members):
                    if self._left_out():
                        raise FellBehind(_LEFT_OUT.format(self.transport.replica)) from None
                    continue  # the Lighthouse is up and waits for a slower member of the last quorum: no outage
                if not lost:  # said once per outage, not at every attempt
                    lost = True
                    self.lighthouse_lost += 1
                    print(f"quietsync: replica group {self.transport.replica}: the Lighthouse at {self.lighthouse} did "
                          f"not answer a quorum request within {attempt:g}s ({why or 'it is up'}); asking again, for "
                          f"at most {patience:g}s", file=sys.stderr, flush=True)
                continue
            if lost:
                print(f"quietsync: replica group {self.transport.replica}: the Lighthouse at {self.lighthouse} "
                      "answered again; training goes on", file=sys.stderr, flush=True)
            return

    def _meet(self, deadline: float, wait: bool) -> str | None:
        """After a failed attempt, before the regroup: say this replica reached the unit in the failed quorum's store
        and, with ``wait`` (the attempt timed out: a member is late or frozen), wait there for the others until
        ``deadline`` (:mod:`~quietsync.faults.meeting`) -- they ask for the next quorum together; a meeting that ends
        without them leaves it to the regroup. Returns :func:`~quietsync.faults.meeting.meet`'s answer (None: all
        came, or there was nothing to wait for; ``"late"``: the deadline passed without them)."""
        group = self.transport.replica_group
        others = [k for k in group.members if k != self.transport.replica]
        if group.store is None or not others:
            return None
        return meet(group.store, self.manager.current_step(), self.transport.replica, others if wait else [],
                    deadline, self._others_alive)

    def _leave_behind(self, patience_s: float) -> None:
        """The unit's patience passed with members missing: ask for a quorum without them for up to :data:`LEAVE_S`
        (module docstring), or stop (:class:`NoQuorum`) where the Lighthouse forms none -- these replicas are not more
        than half of the live ones."""
        others = [k for k in self.members if k != self.transport.replica]
        # all came in the meantime: the request below includes them, and a give-up would name the others
        late = missing(self.transport.replica_group.store, self.manager.current_step(), others) or others
        try:
            self._regroup(patience_s, time.monotonic() + LEAVE_S, attempt_s=LEAVE_S)
        except NoQuorum:
            from .lighthouse import reachable

            if reachable(self.lighthouse, 2.0) is not None:  # the Lighthouse is gone: its own message says so
                raise
            raise NoQuorum(
                f"quietsync: replica group {self.transport.replica}: replica group(s) {late}, alive, did not reach "
                f"this collective within {patience_s:g}s {_PATIENCE}, and the Lighthouse formed no quorum without "
                f"them within {LEAVE_S:g}s (it does once more than half of the live replica groups ask); the replica "
                f"stops. To wait longer for slower replica groups, {_longer(patience_s)}") from None
        gone = [k for k in late if k not in self.members]
        if gone:
            print(f"quietsync: replica group {self.transport.replica}: replica group(s) {gone} did not reach this "
                  f"collective within {patience_s:g}s (more than {SYNC_PATIENCE + 1:g}x slower, or hung): going on "
                  "without them; each heals from the others when it returns", file=sys.stderr, flush=True)

    def _others_alive(self) -> bool:
        """Whether every other member of the current quorum still sends heartbeats, as far as the Lighthouse says (a
        Lighthouse that does not answer says nothing: True): a replica waiting for a frozen one learns it here."""
        from .lighthouse import stale_heartbeats

        stale = stale_heartbeats(self.lighthouse, 2.0)
        mine = replica_id(self.transport.replica) + ":"
        return stale is None or not any(m in stale for m in self.transport.replica_group.member_ids
                                        if not m.startswith(mine))

    def _left_out(self) -> bool:
        """Whether the Lighthouse's last quorum holds no incarnation of this replica group: the others went on
        without it while it was still in a unit of theirs."""
        from .lighthouse import latest_members

        members = latest_members(self.lighthouse, 2.0)
        mine = replica_id(self.transport.replica) + ":"
        return members is not None and not any(m.startswith(mine) for m in members)

    def _phases(self, sent_bytes: int) -> dict[str, Any]:
        """A round start that changed the quorum, as seconds from the request (``asked``, wall clock ``unix_s``):
        ``quorum`` the Lighthouse's answer (the group's reconnection starts), ``connected`` the new group ready;
        on a heal source ``snapshot`` (its state taken), ``send_start``, ``serialized``, ``sent`` (``sent_bytes``);
        on a replica that heals ``recv_start`` (its receive posted), ``received``, ``deserialized``, ``applied``
        (loaded into the strategy); ``returned``: training goes on. A phase that did not happen in this round is
        absent (a quorum asked again after a failure reports its last attempt's)."""
        asked = self._marks["asked"]
        marks = dict(self._marks)
        start, end = self.transport.replica_group.connecting
        if start >= asked:  # a connection made before this request belongs to an earlier round
            marks["quorum"], marks["connected"] = start, end
        marks.update((k, v) for k, v in self.checkpoint.marks.items() if v >= asked)
        phases = {k: round(v - asked, 4) for k, v in sorted(marks.items(), key=lambda kv: kv[1]) if k != "asked"}
        return {"unix_s": asked, **phases, "members": self.members, **({"sent_bytes": sent_bytes} if sent_bytes
                                                                       else {})}

    def take_rounds(self) -> list[dict[str, Any]]:
        """The round records gathered since the last call (:attr:`rounds`), emptied."""
        rounds, self.rounds = self.rounds, []
        return rounds

    def _regroup(self, patience_s: float | None = None, deadline: float | None = None,
                 attempt_s: float | None = None) -> None:
        """A quorum inside a round: the previous members still alive, no join, no heal (asked until ``deadline``, a
        unit's :meth:`patience_s` from its start; see :meth:`_ask`)."""
        self._ask(allow_heal=False, shrink_only=True, patience_s=patience_s, deadline=deadline, attempt_s=attempt_s)
        if self.manager.participating_rank() is None:
            raise FellBehind("quietsync: this replica missed a commit the other replicas made (its collective failed "
                             "where theirs succeeded); it stops, and once restarted it heals from a live peer")
        self.round_due = False

    def run(self, op: Callable[[], Any], restore: Sequence[torch.Tensor]) -> Any:
        """``op()`` (collectives over the replicate dimension) committed by the quorum: retried with the same
        inputs (``restore`` are put back first: tensors ``op`` changes in place) among the survivors until a
        quorum commits it, or :meth:`patience_s` has passed (:class:`NoQuorum`): a slower replica group is waited
        for, not taken for a dead one (the Lighthouse keeps it in the quorum while it sends heartbeats)."""
        if self._running:  # inside a unit already run here (Transport.across_replicas): its failure is the unit's
            return op()
        with self._waits():
            return self._run(op, restore)

    def _run(self, op: Callable[[], Any], restore: Sequence[torch.Tensor]) -> Any:
        patience = self.patience_s()
        deadline = time.monotonic() + patience
        if self.round_due:  # a commit since the last quorum: this unit asks for its own (mid-round: no joins)
            self._regroup(patience, deadline)
        # cloned before the first attempt: a failed collective may leave them half-reduced
        saved = [t.detach().clone() for t in restore]
        while True:
            dropped, late = None, False
            attempt = time.perf_counter()
            try:
                self._running = True
                self.contributing = None
                dropped = self._vote()
                self.contributing = len(self._contributors)
                out = op() if dropped is None else None
            except ReplicaLost as e:
                out = None
                # gloo's words for a wait that ran out (a slower or frozen member), not a closed connection (a death)
                late = "timed out" in str(e).lower()
                # waiting on the others (a collective timed out on a slower replica): idle, as a collective's wait
                self._waited(time.perf_counter() - attempt)
                for t, s in zip(restore, saved):
                    t.copy_(s)
                _clear_frames(e)  # they hold the failed group: report() must drop the last reference
                self.transport.replica_group.report(e)
                self.manager.report_error(e)
            finally:
                self._running = False
                self.contributing = None
            if dropped is not None:  # the same verdicts on every replica: none commits, every one raises
                self.manager.report_error(dropped)
                self.manager.should_commit(timeout=timedelta(seconds=self.timeout_s))
                self.verdict = (0, 0)
                self.round_due = True  # a fresh quorum clears torchft's error before the next unit
                raise dropped
            if self.manager.should_commit(timeout=timedelta(seconds=self.timeout_s)):
                self._committed()
                return out
            self.retries += 1
            if self._left_out():  # the others went on without this replica: a quorum of its own would split the run
                raise FellBehind(_LEFT_OUT.format(self.transport.replica))
            if time.monotonic() > deadline:
                raise NoQuorum(f"quietsync: no quorum of replicas committed a collective within {patience:g}s")
            regroup = time.perf_counter()
            try:
                # before any quorum request: a slower member is not left out
                if self._meet(deadline, wait=late) == "late":
                    self._leave_behind(patience)
                else:
                    self._regroup(patience, deadline)
            finally:
                self._waited(time.perf_counter() - regroup)

    def _waited(self, seconds: float) -> None:
        """Meter ``seconds`` this replica waited on the others inside a unit (a failed attempt, a quorum asked again)
        as the replicate dimension's: a strategy counts its collectives' metered time as idle, not compute."""
        self.transport.meter.add_seconds("replicate", seconds)

    def _vote(self) -> RoundDropped | None:
        """The unit's first collective: every present replica group's verdict (module docstring), and whether it
        contributes to the unit (:attr:`abstains`; the contributors are kept for the unit's averages and commit)."""
        me = self.transport.replica
        if self.transport.group_size("replicate") == 1 and not self.verdict[0]:
            self._contributors = [] if self.abstains else [me]
            self.marks = None  # alone: no one to compare the fingerprint with
            return None  # alone and finite: nothing to agree on
        n = self.transport.replicas
        # rows of n slots (codes, steps, contributes), each replica setting only its own: the vote's sum gathers them;
        # then 3 slots a replica for its fingerprint, if one is due (the step + 1 first: 0 says none was sent)
        flags = torch.zeros(6 * n, dtype=torch.int64, device=self.transport.device)
        flags[me], flags[n + me] = self.verdict
        flags[2 * n + me] = 0 if self.abstains else 1
        if self.marks is not None:
            step, first, second = self.marks
            flags[3 * n + 3 * me: 3 * n + 3 * me + 3] = torch.tensor([step + 1, first, second])
        self.transport.vote(flags)
        v = flags.tolist()  # one copy to the host (on a GPU, one sync), not one per slot read
        marks = {k: (v[3 * n + 3 * k] - 1, v[3 * n + 3 * k + 1], v[3 * n + 3 * k + 2]) for k in range(n)
                 if v[3 * n + 3 * k]}
        if marks:
            self.received_marks, self.marks = marks, None
        self._contributors = [k for k in range(n) if v[2 * n + k]]
        verdicts = {k: (v[k], v[n + k]) for k in range(n) if v[k]}
        return RoundDropped(verdicts) if verdicts else None

    def vote(self) -> None:
        """A unit of the vote alone (the replica whose round is not finite, instead of stepping): it meets the
        others' next unit and raises :class:`RoundDropped` on every replica."""
        self.run(lambda: None, [])

    def _committed(self) -> None:
        self.commits += 1
        self.since = time.monotonic()
        self.round_due = True
        self.abstains = False
        # the replica groups whose contribution the commit holds (an abstaining one's windows go back)
        members = [k for k in self.transport.replica_group.members if k in self._contributors]
        number = self.manager.current_step()
        for listener in self._listeners:
            listener(members, number)

    # ------------------------------------------------------------------ the stall watch
    def progress(self) -> None:
        """The training loop's main thread made progress (a step began, a micro-batch was fed, a commit was asked):
        the stall watch (:mod:`~quietsync.faults.stall`) counts from here."""
        if self.watch is not None:
            self.watch.progress()

    def _waits(self) -> AbstractContextManager[None]:
        """A wait of the protocol's own (a quorum, a unit's collectives and their retries): not a stall."""
        return self.watch.inside() if self.watch is not None else nullcontext()

    def _waiting_for_this(self) -> str | None:
        """Who waits for this replica group now (asked by the stall watch once the main thread has stalled): the
        other members of the quorum that reached this replica's next unit (their key is in the quorum's store), or
        the Lighthouse's pending quorum requests; None when nobody does. A replica group alone in its quorum holds the
        run's only state: nobody is said to wait for it."""
        from .lighthouse import pending_requests

        me = self.transport.replica
        others = [k for k in self.members if k != me]
        if not others:
            return None
        store, unit = self.transport.replica_group.store, self.manager.current_step()
        if store is not None:
            arrived = [k for k in others if k not in missing(store, unit, others)]
            if arrived and not store.check([f"{ARRIVED}/{unit}/{me}"]):
                return f"replica group(s) {arrived}, at the next collective,"
        asking = pending_requests(self.lighthouse, 2.0)
        if asking:
            return f"{asking} replica group(s) asking the Lighthouse for the next quorum"
        return None

    def _stall_line(self, stalled_s: float, who: str) -> str:
        limit = stall_limit_s(self.quorum_timeout_s)
        return (f"quietsync: replica group {self.transport.replica}: its main thread made no progress for "
                f"{stalled_s:.0f}s while {who} waited for it (a replica group stalled for half the quorum timeout, "
                f"{limit:g}s, holds the others up); it exits so that it is started again, and it heals from them")

    def unwatch(self) -> None:
        """Stop the stall watch (the run is over: what follows, the export, is nobody's wait)."""
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    @property
    def members(self) -> list[int]:
        """The replica groups of the current quorum, in rank order."""
        return list(self.transport.replica_group.members)

    def shutdown(self) -> None:
        """Stop the stall watch, this replica's manager server and the peer checkpoint (local; the others see it
        leave)."""
        self.unwatch()
        self.manager.shutdown(wait=False)


_PATIENCE = (f"(the longer of the quorum timeout and {SYNC_PATIENCE:g} of this replica's rounds: more than "
             f"{SYNC_PATIENCE + 1:g}x slower, or hung)")
"""Why a unit gave up on a member: the patience it waited, in the words of every message that says so."""

_LEFT_OUT = ("quietsync: replica group {} reached this collective after the other replica groups had gone on "
             "without it (the Lighthouse forms a quorum without a heartbeating replica group once more than half of "
             "them ask and its --join-timeout-ms has passed); it stops, and once restarted it heals from them")


def _longer(patience_s: float) -> str:
    """What makes a unit wait longer than ``patience_s``: the quorum timeout where the user set it, else
    ``--timeout-s``."""
    if os.environ.get(QUORUM_TIMEOUT_ENV) is not None:
        return f"set {QUORUM_TIMEOUT_ENV} above {patience_s:g}"
    return f"give --timeout-s above {patience_s:g}"


def _clear_frames(error: BaseException) -> None:
    """Clear the local variables of the finished frames in ``error``'s traceback and in those of its causes."""
    for e in cause_chain(error):
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)


__all__ = ["FellBehind", "HEAL_KEY", "HealFailed", "LEAVE_S", "LIGHTHOUSE_ATTEMPT_S", "NoQuorum", "ReplicaQuorum",
           "RoundDropped", "quorum_number"]
