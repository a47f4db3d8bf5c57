"""The transport of one replica group under ``--fault-tolerance torchft``: the same door, with the ``replicate``
dimension made of whichever replicas are present.

A **replica group** is a node of the topology (``W`` workers, one torch.distributed world of its own, started on
its own: a torchrun job, or the local launcher's child). :class:`FaultTolerantTransport` is quietsync's
:class:`~quietsync.transport.Transport` for one of its workers, with the groups

* ``shard`` — the replica group's own workers (static: they live and die together);
* ``replicate`` — worker ``i`` of every replica group in the current quorum: torchft's reconfigurable group
  (:class:`~quietsync.faults.replica_group.ReplicaProcessGroup`), its size and ranks those of the quorum;
* ``world`` — with one worker per replica group, the same as ``replicate``; with several, only its broadcast is
  served (by ``shard``: replicas are made equal by healing), every other collective is refused (strategies that
  run under torchft with several workers per replica group use ``shard`` and ``replicate``).

Every collective on the replicate dimension is metered and link-emulated by the base class, and runs under the
quorum's commit protocol (:meth:`~quietsync.faults.quorum.ReplicaQuorum.run`): a failed collective (a replica
died) is retried with the same payload among the survivors, and the caller only ever sees a committed result.
Before the first quorum the replicate dimension is this replica alone for communication (no network), while
its ranks are the nominal ones (every replica group present), so per-replica seeds differ as without torchft.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from ..events import EventRecorder
from ..link import LinkModel
from ..topology import Topology
from ..transport import ProcessGroups, Transport, Work
from .inject import reached
from .replica_group import ReplicaProcessGroup


class Commits(Protocol):
    """What the transport needs of the quorum (:class:`~quietsync.faults.quorum.ReplicaQuorum`)."""

    def run(self, op: Callable[[], Any], restore: Sequence[torch.Tensor]) -> Any:
        """``op()`` committed by the quorum (retried among the survivors); ``restore`` put back before a retry."""

    contributing: int | None
    """Inside a unit: the replica groups contributing to it (the divisor of its averages); None outside one."""


class ReplicaLost(RuntimeError):
    """A collective over the replicas failed: one of them died, or left the quorum, while it ran."""


class FaultTolerantTransport(Transport):
    """The transport of worker ``LOCAL_RANK`` of replica group ``replica`` (module docstring).

    Args:
        replica: this replica group's index, in ``[0, replicas)``.
        replicas: the replica groups of the job (nominal: all of them present).
        links, recorder, timeout_s, backend: as :class:`~quietsync.transport.Transport`'s; the replica group's
            own world comes from the environment (``RANK``/``WORLD_SIZE`` of the replica group).
    """

    fault_tolerant = True

    def __init__(self, replica: int, replicas: int, links: Mapping[str, LinkModel] | None = None,
                 recorder: EventRecorder | None = None, timeout_s: float = 300.0, backend: str | None = None) -> None:
        local = Topology.from_env(nodes=1)
        if not 0 <= replica < replicas:
            raise ValueError(f"replica must be in [0, {replicas}), got {replica}")
        self.replica, self.replicas = int(replica), int(replicas)
        self.workers, self.local_rank = local.world_size, local.rank
        self.replica_group = ReplicaProcessGroup(timeout_s)
        """The replicate dimension's process group, reconfigured by torchft at every quorum change."""
        self.replica_group.on_release.append(self._forget_replica_group)
        self.quorum: Commits | None = None
        """The commit protocol, once attached (:class:`~quietsync.faults.quorum.ReplicaQuorum`)."""
        self._static: ProcessGroups | None = None
        nominal = Topology(self.replica * self.workers + self.local_rank, self.replicas * self.workers, self.replicas)
        super().__init__(nominal, links, recorder, timeout_s, backend)

    # ------------------------------------------------------------------ groups
    def _init_groups(self) -> None:
        """The replica group's own world (``shard``); the replicate dimension is connected by each quorum."""
        if self.workers > 1:
            self._static = ProcessGroups(Topology(self.local_rank, self.workers, 1), self.timeout_s, self.backend)
            self._groups["shard"] = self._static.process_group("world")

    def rendezvous_store(self) -> Any:
        """The replica group's own workers' shared store (:meth:`ProcessGroups.rendezvous_store` of their world)."""
        if self._static is None:
            raise RuntimeError("rendezvous_store: a replica group of one worker has no world of its own")
        return self._static.rendezvous_store()

    @property
    def connected(self) -> bool:
        """Whether a quorum has connected the replicate dimension (before: this replica alone, no network); its
        group may have been dropped since, after a failed collective, until the next quorum connects a new one."""
        return self.replica_group.generation > 0

    def _forget_replica_group(self) -> None:
        """Let go of the replicate dimension's group (:meth:`ReplicaProcessGroup.report`)."""
        self._groups.pop("replicate", None)
        if self.workers == 1:
            self._groups.pop("world", None)

    def members(self) -> list[int]:
        """Replica groups of the current quorum, in rank order (before the first quorum: all of them)."""
        return list(self.replica_group.members) if self.connected else list(range(self.replicas))

    def _ranks(self, group: str) -> tuple[int, ...]:
        w, me = self.workers, self.local_rank
        if group == "shard":
            return tuple(self.replica * w + i for i in range(w))
        if group == "replicate":
            return tuple(m * w + me for m in self.members())
        if group == "world":
            return tuple(m * w + i for m in self.members() for i in range(w))
        raise ValueError(f"group must be one of world, shard, replicate; got {group!r}")

    def _managed(self, group: str) -> bool:
        """Whether ``group`` is (or, with one worker per replica group, is the same as) the replicate dimension."""
        self._ranks(group)  # validates the name: raises on an unknown group
        return group == "replicate" or (group == "world" and self.workers == 1)

    def _refuse_world(self, kind: str, group: str) -> None:
        if group == "world" and self.workers > 1:
            raise RuntimeError(
                f"quietsync: a {kind} over group 'world' spans replica groups under --fault-tolerance torchft with "
                f"{self.workers} workers per replica group: run it over 'shard' inside the replica group and "
                "'replicate' across replica groups")

    def _sync_groups(self) -> None:
        """Point the replicate dimension at the current quorum's process group."""
        group = self.replica_group.group
        if group is None:
            raise ReplicaLost("quietsync: the replicas' process group was closed after a failed collective; the "
                              "next quorum connects a new one")
        self._groups["replicate"] = group
        if self.workers == 1:
            self._groups["world"] = group
        else:
            self._groups.pop("world", None)

    # ------------------------------------------------------------------ the protocol
    def _replicated(self, op: Callable[[], Any], restore: Sequence[torch.Tensor]) -> Any:
        """Run ``op`` (a blocking collective over the replicate dimension) under the commit protocol; before the
        first quorum it runs alone (``group_size`` 1 inside: no network)."""
        if not self.connected or self.quorum is None:
            with _Flag(self, "_solo"):
                return op()
        return self.quorum.run(self._guarded(op), restore)

    def across_replicas(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` committed as one unit by the quorum: re-run among the survivors when a replica dies during any
        of its collectives (see :meth:`Transport.across_replicas`)."""
        return self._replicated(fn, [])

    def _guarded(self, op: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            self._sync_groups()
            reached("exchange")
            try:
                return op()
            except ReplicaLost:  # ours already (a RuntimeError too): passed on unwrapped
                raise
            except RuntimeError as e:  # gloo: a closed connection, a timeout; torch: a broken group
                raise ReplicaLost(str(e)) from e
        return run

    def meet(self, patience_s: float, group: str | None = None) -> None:
        """Nothing: a unit whose collective times out on a slower replica waits for it in the quorum's store, as long
        as the unit's patience (:mod:`~quietsync.faults.meeting`; docs/faults.md, "Uneven replica groups"), and a
        replica group's own workers step together."""

    def ready_control(self, group: str | None = None) -> None:
        """Nothing to create (see :meth:`meet`)."""

    def vote(self, flags: torch.Tensor) -> None:
        """Sum ``flags`` over the replicas present, inside a unit the quorum runs (its non-finite vote,
        :meth:`~quietsync.faults.quorum.ReplicaQuorum.run`): metered and link-emulated like any collective, not a
        kill point of its own (``QUIETSYNC_FT_KILL=exchange`` counts the units' collectives)."""
        self._sync_groups()
        try:
            # the base class's: this class's own would count it as an 'exchange' kill point
            Transport.all_reduce(self, flags, "replicate", "sum", False, "nonfinite_vote")
        except ReplicaLost:
            raise
        except RuntimeError as e:
            raise ReplicaLost(str(e)) from e

    _solo = False
    """True while a collective runs before the first quorum: the replicate dimension is this replica alone."""

    def group_size(self, group: str) -> int:
        if self._solo and self._managed(group):
            return 1
        return super().group_size(group)

    def group_rank(self, group: str) -> int:
        if self._solo and self._managed(group):
            return 0
        return super().group_rank(group)

    def _wait_handle(self, handle: Any, work: Work) -> None:
        try:
            super()._wait_handle(handle, work)
        except RuntimeError as e:
            if self._managed(work.group):
                raise ReplicaLost(str(e)) from e
            raise

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, group: str = "world", op: str = "sum", async_op: bool = False,
                   name: str = "all_reduce") -> Work:
        self._refuse_world("all_reduce", group)
        if not self._managed(group):
            return super().all_reduce(tensor, group, op, async_op, name)
        base = super().all_reduce
        if op == "avg":
            def averaged() -> Work:
                # the sum over the replicas present, divided by those contributing to the unit (counted by its vote:
                # a replica abstaining from its first step after a heal adds zeros and is not counted). With every
                # replica contributing it is the base class's average exactly (its sum, then the same division).
                work = base(tensor, group, "sum", False, name)
                n = self._contributing(group)
                if n > 1:  # 0 contributors (a lone joiner) keeps the zero sum
                    tensor.div_(n)
                return work
            return self._replicated(averaged, [tensor])
        return self._replicated(lambda: base(tensor, group, op, False, name), [tensor])

    def _contributing(self, group: str) -> int:
        """The replica groups contributing to the unit running now (:data:`Commits.contributing`); outside a unit,
        every member of ``group``."""
        n = getattr(self.quorum, "contributing", None) if self.quorum is not None else None
        return self.group_size(group) if n is None or self._solo else n

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: str = "world", op: str = "sum",
                       async_op: bool = False, name: str = "reduce_scatter") -> Work:
        self._refuse_world("reduce_scatter", group)
        if not self._managed(group):
            return super().reduce_scatter(output, input, group, op, async_op, name)
        base = super().reduce_scatter
        # nothing to restore: the input is only read, and a retry rewrites the output
        return self._replicated(lambda: base(output, input, group, op, False, name), [])

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: str = "world", async_op: bool = False,
                   name: str = "all_gather") -> Work:
        self._refuse_world("all_gather", group)
        if not self._managed(group):
            return super().all_gather(output, input, group, async_op, name)
        base = super().all_gather
        return self._replicated(lambda: base(output, input, group, False, name), [])

    def broadcast(self, tensor: torch.Tensor, src: int = 0, group: str = "world", async_op: bool = False,
                  name: str = "broadcast") -> Work:
        """A broadcast over the replicas is the initial one (strategies' constructors) or a resume's: replicas
        are made equal by healing instead, so it only runs inside the replica group (``shard``)."""
        if group == "replicate" or (group == "world" and self.workers == 1):
            with _Flag(self, "_solo"):
                return super().broadcast(tensor, 0, group, async_op, name)
        if group == "world":
            return super().broadcast(tensor, 0, "shard", async_op, name)
        return super().broadcast(tensor, src, group, async_op, name)

    def send(self, tensor: torch.Tensor, dst: int, group: str = "world", async_op: bool = False,
             name: str = "send") -> Work:
        self._refuse_point_to_point(group)
        return super().send(tensor, dst, group, async_op, name)

    def recv(self, tensor: torch.Tensor, src: int, group: str = "world", async_op: bool = False,
             name: str = "recv") -> Work:
        self._refuse_point_to_point(group)
        return super().recv(tensor, src, group, async_op, name)

    def _refuse_point_to_point(self, group: str) -> None:
        if self._managed(group):
            raise RuntimeError("quietsync: point-to-point transfers between replicas go through the peer "
                               "checkpoint (faults/peer_checkpoint.py) under --fault-tolerance torchft")

    def heal_transfer(self, tensor: torch.Tensor, peer: int, sending: bool) -> None:
        """Send ``tensor`` to (or receive it from) replica rank ``peer`` of the quorum being formed: the peer
        checkpoint's transfer, on the torchft quorum thread while the main thread waits for the quorum (metered
        as ``send``/``recv`` on ``replicate``, link-emulated)."""
        self._sync_groups()
        kind = "send" if sending else "recv"
        # the base class's: this class refuses point-to-point between replicas, but for this one transfer
        base = super().send if sending else super().recv
        base(tensor, peer, "replicate", False, f"heal/{kind}")

    def agree(self, value: float, op: str = "max") -> float:
        """Inside the replica group only: decisions across replicas are the quorum's (torchft's)."""
        if self._static is None:
            return float(value)
        return self._static.agree(value, op)

    def agree_rows(self, row: Sequence[float]) -> list[list[float]]:
        """Inside the replica group only, by its ranks: decisions across replicas are the quorum's (torchft's)."""
        if self._static is None:
            return [[float(v) for v in row]]
        return self._static.agree_rows(row)

    def process_group(self, group: str) -> Any:
        if self._managed(group) or group == "world":
            raise RuntimeError(f"quietsync: group {group!r} has no fixed process group under --fault-tolerance "
                               "torchft (its members change with the quorum)")
        return super().process_group(group)

    def device_mesh(self, group: str) -> Any:
        if self._managed(group) or group == "world":
            raise RuntimeError(f"quietsync: group {group!r} has no device mesh under --fault-tolerance torchft "
                               "(its members change with the quorum)")
        return super().device_mesh(group)

    def close(self) -> None:
        """Local, idempotent: drop the replicate dimension's group, then the replica group's own world."""
        self._groups.pop("replicate", None)
        self._groups.pop("world", None)
        self.replica_group.shutdown()
        super().close()
        if self._static is not None:
            self._static.close()


class _Flag:
    """Set ``obj.<name>`` to True within the context."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name

    def __enter__(self) -> None:
        setattr(self.obj, self.name, True)

    def __exit__(self, *exc: Any) -> None:
        setattr(self.obj, self.name, False)


__all__ = ["FaultTolerantTransport", "ReplicaLost"]
