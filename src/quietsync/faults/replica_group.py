"""The process group of the ``replicate`` dimension under torchft: the replicas present in the current quorum.

torchft's :class:`~torchft.manager.Manager` reconfigures the group it is given at every quorum change
(``configure(store address, replica id, rank, size, quorum id, group rank, group size, global ranks)``) and asks
it whether an asynchronous error happened (``errored()``). :class:`ReplicaProcessGroup` is that group for
quietsync: on each ``configure`` it connects a fresh gloo group of the quorum's members through the quorum's
rendezvous store (one TCPStore per replica group; torchft hands out the primary's, prefixed by the quorum id and
the group rank, so worker ``i`` of every replica group meets worker ``i`` of the others). quietsync's
:class:`~quietsync.faults.transport.FaultTolerantTransport` issues the collectives on :attr:`group`, so they are
metered and link-emulated like every other; nothing here talks to the network besides the connection.

A replica is named ``quietsync_replica_<k>`` (``k``: its replica group); torchft derives the members' "global
ranks" ``k * group_world_size + group_rank`` from the trailing digits, so :attr:`members` is the sorted list of
replica group indices present, in the quorum's rank order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroup as TorchftProcessGroup

REPLICA_PREFIX = "quietsync_replica_"
"""A replica group's torchft replica id is this prefix and its index."""


CONNECT_TIMEOUT_S = 10.0
"""How long connecting a new quorum's group waits for its members. The members that are alive call it within a
moment of each other (they all act on the Lighthouse's answer) and connect in well under a second; a member that
died between that answer and its connection (a returning replica killed while joining) would otherwise hold the
others for the whole collective timeout (``--timeout-s``, 300 s by default: longer than a round start waits, so the
survivors would stop). Failed, the connection is asked for again with the next quorum, without the dead member."""


def replica_id(replica: int) -> str:
    """The torchft replica id of replica group ``replica``."""
    return f"{REPLICA_PREFIX}{replica}"


def _store_client(address: str, timeout: timedelta) -> Any:
    """``PrefixStore(prefix, TCPStore client)`` of an address ``host:port/prefix`` (IPv6 hosts in brackets)."""
    where, _, prefix = address.partition("/")
    host, _, port = where.rpartition(":")
    store = dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False, timeout=timeout)
    return dist.PrefixStore(prefix, store)


def connect_gloo(store: Any, rank: int, size: int, timeout: timedelta, connect_timeout: timedelta | None = None
                 ) -> Any:
    """A c10d process group of ``size`` ranks on ``store`` with a gloo backend for CPU (and CUDA) tensors; not
    registered with ``torch.distributed`` (quietsync's transport addresses it by object, by group ranks). Its
    collectives wait at most ``timeout``; connecting waits at most ``connect_timeout`` (default: ``timeout``)."""
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = dist.ProcessGroupGloo(store, rank, size, connect_timeout or timeout)  # gloo connects here
    # connected under the short timeout; its collectives keep the long one
    if connect_timeout is not None:
        backend._set_default_timeout(timeout)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():
        group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


class ReplicaProcessGroup(TorchftProcessGroup):
    """The replicas present, as one process group that torchft's Manager reconfigures (module docstring).

    Args:
        timeout_s: how long each collective may wait for a member.
        connect_timeout_s: how long connecting a new quorum's group may wait for its members (at most
            ``timeout_s``; default :data:`CONNECT_TIMEOUT_S`).
    """

    def __init__(self, timeout_s: float, connect_timeout_s: float | None = None) -> None:
        super().__init__(0, 1)  # rank 0 of 1 until the first quorum configures it
        self.timeout = timedelta(seconds=float(timeout_s))
        self.connect_timeout = timedelta(seconds=min(float(timeout_s), float(
            CONNECT_TIMEOUT_S if connect_timeout_s is None else connect_timeout_s)))
        self.group: Any = None
        """The c10d group of the current quorum (None before the first quorum)."""
        self.store: Any = None
        """The current quorum's store, under this group's prefix (None before the first quorum): the replicas meet in
        it before a unit (:mod:`~quietsync.faults.meeting`)."""
        self.rank = 0
        """This replica's rank in the current quorum."""
        self.world = 1
        """Replicas in the current quorum."""
        self.members: list[int] = []
        """Replica group indices of the current quorum's members, in rank order."""
        self.quorum_id: int | None = None
        self.member_ids: list[str] = []
        """torchft's replica ids (``<replica group's id>:<incarnation>``) of the last quorum's members (set by its
        answer)."""
        self.quorum_step = 0
        """The step of the quorum being configured (set by the quorum's answer): part of the store prefix, so a
        Lighthouse started again, whose quorum numbers repeat, never meets an earlier quorum's keys."""
        self.generation = 0
        """How many times the group was (re)connected."""
        self.connecting: tuple[float, float] = (0.0, 0.0)
        """Wall-clock start and end of the latest (re)connection (the quorum's answer arrived at the start)."""
        self._error: Exception | None = None
        self._lock = threading.Lock()
        self.on_release: list[Callable[[], None]] = []
        """Called when the group is dropped: whoever keeps a reference to :attr:`group` lets it go here."""

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int | None = None, group_rank: int | None = None, group_world_size: int | None = None,
                  global_ranks: list[int] | None = None) -> None:
        """Connect the members of a new quorum (called by the Manager on its quorum thread; blocks until every
        member has connected, or raises after the timeout)."""
        started = time.time()
        with self._lock:
            self._release()  # the old group's connections close with it (a dead member's already are)
            self._error = None
            width = max(1, int(group_world_size or 1))
            self.members = [int(g) // width for g in (global_ranks or [])] or [0]
            store = _store_client(f"{store_addr}/{self.quorum_step}", self.connect_timeout)
            self.group = connect_gloo(store, rank, world_size, self.timeout, self.connect_timeout)
            self.store = store
            self.rank, self.world, self.quorum_id = int(rank), int(world_size), quorum_id
            self.generation += 1
            self.connecting = (started, time.time())

    def report(self, error: Exception) -> None:
        """Record that a collective on this group failed (the Manager reads it in ``should_commit``) and drop the
        group at once, so that its connections close: a member still waiting in a collective on this replica then
        fails too and asks for the next quorum together with it. Kept open, that member waits for this replica
        (alive, gone on to its next quorum) until the collective's timeout; the quorum forms without it after the
        Lighthouse's join timeout, and, asking only for a quorum of the previous members, it cannot join again
        (seen with 3 replicas, a replica killed during DiLoCo's outer sync). The next quorum connects a new group
        (torchft reconfigures after a failed commit). The caller clears the error's traceback first: its frames
        hold the group too."""
        self._error = error
        self._release()

    def _release(self) -> None:
        """Drop this object's and the listeners' references to the group: the last one gone closes its
        connections (gloo's ``abort``/``shutdown`` leave them open)."""
        self.group = None  # the store stays: the replicas meet in it after a failed collective (faults/meeting.py)
        for release in self.on_release:
            release()

    def errored(self) -> Exception | None:
        return self._error

    def size(self) -> int:
        return self.world

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "quietsync-replicas"

    def shutdown(self) -> None:
        self._release()

    def abort(self) -> None:
        self._release()


__all__ = ["CONNECT_TIMEOUT_S", "REPLICA_PREFIX", "ReplicaProcessGroup", "connect_gloo", "replica_id"]
