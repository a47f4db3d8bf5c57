"""The process-group side of the transport: which backend, the default group's lifecycle, and one process group
per transport group (``world``, ``shard``, ``replicate``), with the queries the rest of quietsync asks of them.

:class:`ProcessGroups` is what :class:`~quietsync.transport.Transport` builds its operations on. With more than one
worker it initialises ``torch.distributed`` from the environment (``env://``, torchrun's, or the launcher's
``file://`` store) unless it is initialised already, and creates its own process group per transport group, so
operations issued from the communication worker thread never interleave with another thread's on one group. Its
:meth:`~ProcessGroups.close` is local and safe after a peer died.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..topology import GROUPS, Topology
from .agent_store import uses_agent_store, worker_group_store


class _DefaultGroupRecord:
    """Process-wide record of a default process group initialised by a transport.

    ``generation`` counts the default groups transports have initialised in this process; ``users`` the open
    transports on the current one. The last of them to close destroys it, so closing one transport never
    pulls the default group from under another one still open.

    The rendezvous store outlives the default groups, and each generation rendezvouses under its own key
    prefix: a worker that closes and re-initialises before a slower peer has closed then waits for that peer
    on the same live store, instead of joining the peer's old store just before it is torn down (with
    ``env://`` re-run each time, the store server lives on rank 0 and dies with rank 0's default group).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.generation = 0
        self.owned = False
        self.users = 0
        self.store: Any = None
        """The ``env://`` rendezvous store, kept for the life of the process (see :meth:`Transport._init_groups`)."""


_DEFAULT_GROUP = _DefaultGroupRecord()

RENDEZVOUS_ENV = "QUIETSYNC_RENDEZVOUS"
"""Environment variable naming the rendezvous URL (default ``env://``, torchrun's); the local launcher sets a
``file://`` URL, so a run on one machine listens on no network interface for its rendezvous."""


BACKEND_ENV = "QUIETSYNC_BACKEND"
"""Environment variable that overrides :func:`default_backend` (``gloo`` or ``nccl``)."""


def _processes_here(topology: Topology) -> int:
    """Worker processes on this machine: torchrun's ``LOCAL_WORLD_SIZE`` (else the whole world)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", topology.world_size))


def default_backend(topology: Topology) -> str:
    """``nccl`` when every worker process on this machine can have a CUDA device of its own, else ``gloo``.

    NCCL refuses two ranks on one GPU, so a 4-process run on a 1-GPU machine falls back to gloo on CPU
    rather than failing inside NCCL's setup. The environment variable ``QUIETSYNC_BACKEND`` (``gloo`` or
    ``nccl``) overrides the choice, e.g. for gloo tests on a GPU machine.
    """
    forced = os.environ.get(BACKEND_ENV, "")
    if forced:
        if forced not in ("gloo", "nccl"):
            raise ValueError(f"{BACKEND_ENV} must be 'gloo' or 'nccl', got {forced!r}")
        return forced
    if not torch.cuda.is_available():
        return "gloo"
    return "nccl" if topology.world_size == 1 or torch.cuda.device_count() >= _processes_here(topology) else "gloo"


class ProcessGroups:
    """torch.distributed's groups behind the transport groups ``world``, ``shard`` and ``replicate``.

    Args:
        topology: who is where; by default :meth:`Topology.from_env`.
        timeout_s: how long any collective may wait for its peers before failing.
        backend: ``gloo`` or ``nccl``; default :func:`default_backend`.
    """

    def __init__(self, topology: Topology | None = None, timeout_s: float = 300.0,
                 backend: str | None = None) -> None:
        self.topology = topology if topology is not None else Topology.from_env()
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        if backend is None:
            backend = default_backend(self.topology)
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and self.topology.world_size > 1 and torch.cuda.device_count() < _processes_here(
                self.topology):
            raise ValueError(
                f"backend 'nccl' needs one CUDA device per worker process on this machine: "
                f"{_processes_here(self.topology)} processes, {torch.cuda.device_count()} devices "
                "(use backend 'gloo', or fewer processes per machine)")
        self.backend = backend
        self.device = (
            torch.device("cuda", self.topology.local_rank % max(1, torch.cuda.device_count()))
            if backend == "nccl"
            else torch.device("cpu")
        )
        self._groups: dict[str, Any] = {}
        self._control: Any = None  # the gloo group of agree(), created on first use
        self._clock_groups: dict[str, Any] | None = None  # gloo twins of _groups, for latest_in (see there)
        self._meshes: dict[str, Any] = {}
        self._global_ranks: dict[str, tuple[int, ...]] = {g: self.topology.ranks(g) for g in GROUPS}
        self.initialized_default_group = False
        """Whether this transport initialised torch.distributed's default process group."""
        self._default_generation: int | None = None  # the default group this transport counts as a user of
        self._closed = False
        if self.topology.world_size > 1:
            self._init_groups()

    # ------------------------------------------------------------------ setup
    def _init_groups(self) -> None:
        topo = self.topology
        with _DEFAULT_GROUP.lock:
            if not dist.is_initialized():
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                if self.backend == "nccl":
                    torch.cuda.set_device(self.device)  # NCCL uses the current device for this rank's communicator
                if _DEFAULT_GROUP.store is None:
                    url = os.environ.get(RENDEZVOUS_ENV, "env://")
                    _DEFAULT_GROUP.store, _, _ = next(
                        dist.rendezvous(url, rank=topo.rank, world_size=topo.world_size, timeout=self._timeout)
                    )
                    if uses_agent_store():  # torchrun's store, shared across restarts
                        _DEFAULT_GROUP.store = worker_group_store(_DEFAULT_GROUP.store, topo, self.timeout_s)
                _DEFAULT_GROUP.generation += 1
                store = dist.PrefixStore(f"quietsync/default{_DEFAULT_GROUP.generation}/", _DEFAULT_GROUP.store)
                dist.init_process_group(
                    self.backend, store=store, rank=topo.rank, world_size=topo.world_size, timeout=self._timeout
                )
                self.initialized_default_group = True
                _DEFAULT_GROUP.owned = True
                _DEFAULT_GROUP.users = 0
            if _DEFAULT_GROUP.owned:
                _DEFAULT_GROUP.users += 1
                self._default_generation = _DEFAULT_GROUP.generation
        if dist.get_world_size() != topo.world_size or dist.get_rank() != topo.rank:
            raise RuntimeError(
                f"torch.distributed has rank {dist.get_rank()}/{dist.get_world_size()} but the topology says "
                f"{topo.rank}/{topo.world_size}"
            )
        # Every rank creates every group in the same order (a torch.distributed requirement).
        self._groups["world"] = dist.new_group(list(range(topo.world_size)), timeout=self._timeout)
        for name, all_groups in (("shard", topo.all_shard_groups()), ("replicate", topo.all_replicate_groups())):
            for ranks in all_groups:
                # a group of one never communicates: no process group (skipped on every rank alike)
                pg = dist.new_group(list(ranks), timeout=self._timeout) if len(ranks) > 1 else None
                if topo.rank in ranks:
                    self._groups[name] = pg

    def close(self) -> None:
        """Tear down what this transport created; idempotent, local (no collective), safe after a peer died.

        Destroys the process groups this transport created, then torch.distributed's default process group
        if a transport initialised it and no other open transport of this process still uses it (so the
        transport that set torch.distributed up also takes it down, deferred to the last of its users).
        A default group initialised by someone else (a launcher, the user) is left alone.
        """
        if self._closed:
            return
        self._closed = True
        groups = [*self._groups.values(), *(self._clock_groups or {}).values(), self._control]
        self._clock_groups = None
        self._control = None
        for pg in {id(g): g for g in groups if g is not None}.values():
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 - best effort at shutdown (a dead peer, an already destroyed group)
                pass
        self._groups.clear()
        self._meshes.clear()
        with _DEFAULT_GROUP.lock:
            if self._default_generation is None or self._default_generation != _DEFAULT_GROUP.generation:
                return
            self._default_generation = None
            _DEFAULT_GROUP.users -= 1
            if _DEFAULT_GROUP.users > 0 or not _DEFAULT_GROUP.owned:
                return
            _DEFAULT_GROUP.owned = False
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass

    # ------------------------------------------------------------------ queries
    def agree(self, value: float, op: str = "max") -> float:
        """``op`` (``max``, ``min`` or ``sum``) of one number over every worker: a collective every worker makes at
        the same point, for a decision the workers must share (e.g. how far the most advanced of them got).

        It runs on a gloo control group of its own (created on the first call), never on the groups the
        collectives above use, so it can neither queue behind nor interleave with a job a communication worker
        is running on them. Control traffic: not metered, not link-emulated.
        """
        ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}
        if op not in ops:
            raise ValueError(f"op must be one of {', '.join(ops)}, got {op!r}")
        if self.topology.world_size == 1:
            return float(value)
        if self._closed:
            raise RuntimeError("the transport is closed")
        t = torch.tensor([float(value)], dtype=torch.float64)  # a Python float's precision: nothing rounds in transit
        dist.all_reduce(t, op=ops[op], group=self._control_group())
        return float(t)

    def meet(self, patience_s: float, group: str | None = None) -> None:
        """Return once every worker (of ``group``) has called ``meet``, waiting at most ``patience_s`` -- which may be
        longer than ``timeout_s``: before an outer sync a worker slower than this one is late by a round's worth of
        its slowness, not dead (:mod:`~quietsync.strategies.local.arrival`). With ``group`` None on the control group
        of :meth:`agree` (the main thread's), else on the gloo twin of ``group`` (:meth:`make_clock_groups`; from the
        thread that issues that group's collectives); create it with :meth:`ready_control` while the workers are
        together. The wait is that one collective's own timeout; not metered, not link-emulated. Raises
        ``RuntimeError`` naming the wait when a peer does not come."""
        if self.topology.world_size == 1:
            return
        if self._closed:
            raise RuntimeError("the transport is closed")
        if patience_s <= 0:
            raise ValueError(f"patience_s must be > 0, got {patience_s}")
        if group is None:
            pg = self._control_group()
        elif self._clock_groups is None:
            raise RuntimeError("meet on a group needs ready_control(group) first (a collective every worker makes)")
        else:
            pg = self._clock_groups.get(group)
            if pg is None:  # a group of one: nobody to wait for
                return
        opts = dist.AllreduceOptions()
        opts.timeout = datetime.timedelta(seconds=patience_s)  # gloo honours a collective's own timeout
        try:
            pg.allreduce([torch.zeros(1)], opts).wait(opts.timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised with what was waited for
            raise RuntimeError(f"quietsync: rank {self.topology.rank} waited {patience_s:g}s at an outer sync for the "
                               f"other workers, and one did not come (it died, raised, or is slower than that): "
                               f"{exc}") from exc

    def ready_control(self, group: str | None = None) -> None:
        """Create the control group of :meth:`agree` and :meth:`meet` now (and with ``group`` the gloo twins of
        :meth:`meet` on a group), a collective of every worker, so that a later first use does not wait for the
        others with the default timeout."""
        if self.topology.world_size > 1 and not self._closed:
            self._control_group()
            if group is not None:
                self.make_clock_groups()

    def agree_rows(self, row: Sequence[float]) -> list[list[float]]:
        """Every worker's ``row`` (the same length on each), by rank: one collective every worker makes at the same
        point, on the control group of :meth:`agree` -- the one place the trainer's agreements (its budgets, its
        non-finite policy) cross between workers. NaN travels as NaN."""
        world, me = self.topology.world_size, self.topology.rank
        table = torch.zeros(world, len(row), dtype=torch.float64)
        table[me] = torch.tensor([float(v) for v in row], dtype=torch.float64)
        if world > 1:
            if self._closed:
                raise RuntimeError("the transport is closed")
            # every other row is 0 on this worker, so the sum is each worker's row (NaN + 0 stays NaN)
            dist.all_reduce(table, group=self._control_group())
        return table.tolist()

    def latest_in(self, group: str, value: float) -> float:
        """The largest ``value`` over the workers of ``group``: a collective of that group, made by each of its
        workers at the same point as the group's own collectives (from the thread that issues those).

        On a gloo twin of the group (under NCCL too: the value is a CPU number), so it never interleaves with
        the group's data; not metered, not link-emulated. The twins are made by :meth:`make_clock_groups`."""
        if self._clock_groups is None:
            raise RuntimeError("latest_in needs make_clock_groups() first (a collective every worker makes)")
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._clock_groups[group])
        return float(t)

    def make_clock_groups(self) -> None:
        """Create the gloo twins of ``world``, ``shard`` and ``replicate`` used by :meth:`latest_in`, once: every
        worker calls it at the same point (creating a group is a collective of the whole world)."""
        if self._clock_groups is not None or self.topology.world_size == 1:
            return
        topo, twins = self.topology, {}
        twins["world"] = dist.new_group(list(range(topo.world_size)), backend="gloo", timeout=self._timeout)
        for name, all_groups in (("shard", topo.all_shard_groups()), ("replicate", topo.all_replicate_groups())):
            for ranks in all_groups:
                pg = dist.new_group(list(ranks), backend="gloo", timeout=self._timeout) if len(ranks) > 1 else None
                if topo.rank in ranks:
                    twins[name] = pg
        self._clock_groups = twins

    def _control_group(self) -> Any:
        """The gloo group of the agreements, created on first use (every worker calls at the same point)."""
        if self._control is None:
            # gloo even under NCCL: the agreements are CPU tensors
            self._control = dist.new_group(list(range(self.topology.world_size)), backend="gloo",
                                           timeout=self._timeout)
        return self._control

    @staticmethod
    def distributed() -> bool:
        """Whether torch.distributed's default process group exists in this process (set up by a transport, a
        launcher or the user): what torch components that fall back on it (DCP) will use."""
        return dist.is_available() and dist.is_initialized()

    def group_size(self, group: str) -> int:
        return len(self._ranks(group))

    def group_rank(self, group: str) -> int:
        return self._ranks(group).index(self.topology.rank)

    def global_rank(self, group: str, group_rank: int) -> int:
        return self._ranks(group)[group_rank]

    def rendezvous_store(self) -> Any:
        """A key-value store every worker of this transport shares, fresh for this generation of them (their
        rendezvous store under a prefix of its own): where one rank publishes what the others read before any
        collective, such as the address of a server it just bound to a free port. Raises ``RuntimeError`` where
        this transport did not set torch.distributed up (a default group of someone else's, or a world of one)."""
        if self._default_generation is None or _DEFAULT_GROUP.store is None:
            raise RuntimeError("rendezvous_store: this transport did not initialise torch.distributed's default group")
        return dist.PrefixStore(f"quietsync/shared{self._default_generation}/", _DEFAULT_GROUP.store)

    def process_group(self, group: str) -> Any:
        """The torch ProcessGroup behind ``group`` (for torch DDP/FSDP construction only), None if size 1."""
        self._ranks(group)
        return self._groups.get(group)

    def device_mesh(self, group: str) -> Any:
        """A 1-D ``DeviceMesh`` over ``group`` (dimension named after it), None for a group of one; built once.

        For torch components that take a mesh (FSDP2, DTensors of checkpoints). What they run on it bypasses
        the meter unless routed back through this transport (FSDP2's collectives are; DCP's few small planning
        collectives are not)."""
        pg = self.process_group(group)
        if pg is None:
            return None
        if group not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh

            self._meshes[group] = DeviceMesh.from_group(pg, self.device.type, mesh_dim_names=(group,))
        return self._meshes[group]

    def _ranks(self, group: str) -> tuple[int, ...]:
        try:
            return self._global_ranks[group]
        except KeyError:
            raise ValueError(f"group must be one of {GROUPS}, got {group!r}") from None
