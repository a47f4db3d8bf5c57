"""The one door to ``torch.distributed``: every collective and point-to-point transfer quietsync runs goes
through :class:`Transport`.

Because there is one door, three things hold for every algorithm, baselines included:

* **metering** — bytes sent and received are counted per group and per direction from the collective's
  algorithm (:func:`quietsync.link.traffic`), together with the seconds each group's operations took;
  point-to-point traffic (``send``, ``recv``, ``exchange``) is also counted per peer
  (:meth:`~quietsync.events.ByteMeter.peer_snapshot`);
* **timelines** — every operation becomes one ``comm`` span in the :class:`~quietsync.events.EventRecorder`;
* **link emulation** — with a :class:`~quietsync.link.LinkModel` for the ``inter`` and ``intra`` links, each
  operation is stretched to at least its modeled time, so a laptop behaves like two nodes on a 100 Mbit/s
  network. A collective uses ``inter`` iff its group spans nodes and books both directions of the link; a
  point-to-point operation uses the link of its peer's node (``inter`` iff the peer is on another node) and
  books the transmit queue (send) or the receive queue (recv) — links are full duplex, so an ``exchange``
  that sends and receives B bytes takes B/β. The stretch happens in :meth:`Work.wait`, i.e. on whichever
  thread waits: the communication worker's in overlapped strategies, the main thread otherwise.

Groups are named ``world``, ``shard`` (inside a node) and ``replicate`` (across nodes); the transport
creates its own process group for each (all ranks, same order), so operations issued from the
communication worker thread never interleave with another thread's on the same group. A group of one
never touches the network. Failures do not hang: operations wait at most ``timeout_s`` and a dead peer
surfaces as an error on the others. :meth:`Transport.close` tears down what the transport created,
torch.distributed's default process group included when a transport initialised it.

Optimizers and replicators depend only on :class:`Collectives`, the part of the transport they use.
"""

from __future__ import annotations

import datetime
import functools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from .events import ByteMeter, EventRecorder, label
from .link import LINK_NAMES, LinkModel, traffic
from .topology import GROUPS, Topology

OPS = ("sum", "avg", "max", "min")

# torch 2.13 renamed the flat collectives; keep older releases working.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _labeled(text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a transport method under a ``torch.profiler`` label (``text``), only while a profiler runs."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def labeled(*args: Any, **kwargs: Any) -> Any:
            if not torch.autograd._profiler_enabled():
                return fn(*args, **kwargs)
            with torch.profiler.record_function(text):
                return fn(*args, **kwargs)

        return labeled

    return wrap



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


AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""Set to ``True`` by torchrun when its workers share the agent's rendezvous store (the default since torch
2.4): see :func:`worker_group_store`."""

_ROUND_KEY = "quietsync/worker_group_store"


def worker_group_store(shared: Any, topology: Topology, timeout_s: float) -> Any:
    """A store of this worker group's own, hosted by its rank 0, for a job under torchrun's shared agent store.

    torchrun (c10d rendezvous, store sharing on) hands every generation of workers — after each restart or
    membership change — the same TCPStore, which keeps the previous generation's keys: a new worker may read an
    old peer's address from it and fail to connect (torch issue 135712, "Connection refused" in gloo's
    connectFullMesh). So rank 0 starts a TCPStore server of its own and publishes ``host|port|nonce`` in the
    shared store; the others read that entry — possibly a previous generation's — and accept it only once the
    server it names answers with the same nonce (a previous generation's server is gone, and a server of this
    generation on a reused port holds another nonce), else read it again. Every key of the job then lives in
    a store that starts empty.
    """
    import secrets

    world = topology.world_size
    timeout = datetime.timedelta(seconds=timeout_s)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if topology.rank == 0:
        server = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = secrets.token_hex(8)
        server.set("quietsync/nonce", nonce)
        shared.set(_ROUND_KEY, f"{host}|{server.port}|{nonce}")
        return server
    deadline = time.monotonic() + timeout_s
    probe = datetime.timedelta(seconds=2)
    while True:
        entry = shared.get(_ROUND_KEY).decode()
        addr, port, nonce = entry.rsplit("|", 2)
        try:
            client = dist.TCPStore(addr, int(port), world, is_master=False, timeout=probe, wait_for_workers=False)
            if client.get("quietsync/nonce").decode() == nonce:
                client.set_timeout(timeout)
                return client
        except (RuntimeError, ValueError):  # DistStoreError / DistNetworkError: a previous generation's entry
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank {topology.rank}: no store of this worker group answered within "
                               f"{timeout_s:g} s (last entry {entry!r} in torchrun's shared store)")
        time.sleep(0.2)


class PendingWork(Protocol):
    """What a caller may do with the handle of an asynchronous operation."""

    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


@runtime_checkable
class Collectives(Protocol):
    """What optimizers and replicators need of a transport: group queries and blocking or async collectives.

    :class:`Transport` implements it; a test double or another backend only has to provide these.
    """

    device: torch.device
    """Where communication buffers live (``cuda`` with NCCL, ``cpu`` with gloo)."""

    def group_size(self, group: str) -> int: ...

    def group_rank(self, group: str) -> int: ...

    def all_reduce(self, tensor: torch.Tensor, group: str = "world", op: str = "sum", async_op: bool = False,
                   name: str = "all_reduce") -> PendingWork: ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group: str = "world", async_op: bool = False,
                   name: str = "all_gather") -> PendingWork: ...

    def all_gather_uneven(self, tensor: torch.Tensor, group: str = "world",
                          name: str = "all_gather_uneven") -> list[torch.Tensor]: ...


@dataclass(eq=False)
class Work:
    """Handle of a (possibly asynchronous) transport operation. :meth:`wait` is idempotent.

    Every field is fixed when the operation is issued; the transport fills them in.
    """

    transport: Transport = field(repr=False)
    """The transport that issued the operation (it meters and records it on completion)."""
    handles: tuple[Any, ...]
    """The torch.distributed request handles; empty when nothing goes on the network (a group of one)."""
    kind: str
    """``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``, ``send``, ``recv`` or ``exchange``."""
    group: str
    """Transport group name."""
    nbytes: int
    """``B`` of the traffic table in :mod:`quietsync.link` (for ``exchange``: the bytes sent)."""
    name: str
    """Label of the ``comm`` span."""
    sent: int
    """Bytes this worker sends, as metered."""
    recv: int
    """Bytes this worker receives, as metered."""
    src: int | None = None
    """Group rank of the broadcast root, or of the peer received from (``recv``, ``exchange``)."""
    dst: int | None = None
    """Group rank of the peer sent to (``send``, ``exchange``)."""
    modeled_s: float = 0.0
    """Modeled wire seconds on idle links (0 without link emulation)."""
    t_issue: float = field(default_factory=time.perf_counter)
    """``perf_counter`` time the operation was issued."""
    deadline: float = 0.0
    """``perf_counter`` time its emulated wire time ends (queueing behind earlier transfers included)."""
    t_wire: float | None = None
    """``perf_counter`` time its transfer starts being served on the emulated link, after what was queued
    before it (for a point-to-point operation booking two queues: the earlier start); None without link
    emulation."""
    cuda_events: tuple[Any, Any] | None = field(default=None, repr=False)
    """On CUDA: an event recorded on the issuing stream after the issue, and one at completion (device time
    of the ``comm`` span); None on CPU."""
    finish: Callable[[], None] | None = field(default=None, repr=False)
    """Run once the data has arrived (e.g. the division of an ``avg`` all-reduce)."""
    _done: bool = field(default=False, init=False, repr=False)

    def wait(self) -> None:
        """Block until the operation (and its emulated wire time) is over; re-raise its error."""
        if self._done:
            return
        with label("quietsync/comm/wait"):
            for handle in self.handles:
                self.transport._wait_handle(handle, self)
            self._complete()

    def _complete(self) -> None:
        if self._done:
            return
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)  # the link emulation
        if self.finish is not None:
            self.finish()
        if self.cuda_events is not None:
            self.cuda_events[1].record()
        t1 = time.perf_counter()
        self._done = True
        self.transport._account(self, t1)

    def is_completed(self) -> bool:
        """Whether :meth:`wait` has completed the operation (metered and recorded)."""
        return self._done

    def ready(self) -> bool:
        """Whether the data has moved, so :meth:`wait` would only sit out emulated wire time; never blocks."""
        return self._done or all(h.is_completed() for h in self.handles)

    def get_future(self) -> torch.futures.Future:
        """A future that resolves after the emulated wire time, for DDP communication hooks."""
        if not self.handles:
            self._complete()
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(None)
            return fut
        if len(self.handles) == 1:
            inner = self.handles[0].get_future()

            def then(_f: torch.futures.Future) -> None:
                _f.value()  # re-raise a failure
                self._complete()
        else:
            inner = torch.futures.collect_all([h.get_future() for h in self.handles])

            def then(_f: torch.futures.Future) -> None:
                for f in _f.value():
                    f.value()  # re-raise a failure of any part
                self._complete()

        return inner.then(then)


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


class Transport:
    """Metered, link-emulating collectives over the ``world``, ``shard`` and ``replicate`` groups.

    Args:
        topology: who is where; by default :meth:`Topology.from_env`.
        links: ``{"inter": LinkModel, "intra": LinkModel}``; missing links are not emulated.
        recorder: where ``comm`` spans go (a new one by default).
        timeout_s: how long any collective may wait for its peers before failing.
        backend: ``gloo`` or ``nccl``; default :func:`default_backend` (nccl when each worker process here has
            a CUDA device of its own, else gloo).

    ``torch.distributed`` is initialised from the environment (``env://``, as torchrun sets it) when the
    world has more than one worker and it is not initialised yet; :meth:`close` then takes it down again
    (see :attr:`initialized_default_group`).
    """

    def __init__(
        self,
        topology: Topology | None = None,
        links: Mapping[str, LinkModel] | None = None,
        recorder: EventRecorder | None = None,
        timeout_s: float = 300.0,
        backend: str | None = None,
    ) -> None:
        self.topology = topology if topology is not None else Topology.from_env()
        links = dict(links or {})
        for key in links:
            if key not in LINK_NAMES:
                raise ValueError(f"links keys must be in {LINK_NAMES}, got {key!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.links: dict[str, LinkModel] = links
        self.recorder = recorder if recorder is not None else EventRecorder()
        self.meter = ByteMeter()
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
                    torch.cuda.set_device(self.device)
                if _DEFAULT_GROUP.store is None:
                    url = os.environ.get(RENDEZVOUS_ENV, "env://")
                    _DEFAULT_GROUP.store, _, _ = next(
                        dist.rendezvous(url, rank=topo.rank, world_size=topo.world_size, timeout=self._timeout)
                    )
                    if os.environ.get(AGENT_STORE_ENV) == "True":  # torchrun's store, shared across restarts
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
        for pg in {id(g): g for g in self._groups.values() if g is not None}.values():
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
    def group_size(self, group: str) -> int:
        return len(self._ranks(group))

    def group_rank(self, group: str) -> int:
        return self._ranks(group).index(self.topology.rank)

    def global_rank(self, group: str, group_rank: int) -> int:
        return self._ranks(group)[group_rank]

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

    def link_for(self, group: str) -> LinkModel | None:
        """The link a collective over ``group`` uses: ``inter`` iff the group spans nodes, else ``intra``."""
        self._ranks(group)
        return self.links.get("inter" if self.topology.spans_nodes(group) else "intra")

    def link_to(self, peer: int) -> LinkModel | None:
        """The link point-to-point traffic with global rank ``peer`` uses: ``inter`` iff it is on another node."""
        other_node = self.topology.node_of(peer) != self.topology.node
        return self.links.get("inter" if other_node else "intra")

    def _ranks(self, group: str) -> tuple[int, ...]:
        try:
            return self._global_ranks[group]
        except KeyError:
            raise ValueError(f"group must be one of {GROUPS}, got {group!r}") from None

    # ------------------------------------------------------------------ collectives
    @_labeled("quietsync/comm/all_reduce")
    def all_reduce(
        self, tensor: torch.Tensor, group: str = "world", op: str = "sum", async_op: bool = False,
        name: str = "all_reduce",
    ) -> Work:
        """In-place all-reduce of ``tensor`` (``op`` in sum, avg, max, min)."""
        n = self.group_size(group)
        red, post = self._op(op, n, tensor)
        handle = None
        if n > 1:
            handle = dist.all_reduce(tensor, op=red, group=self._groups[group], async_op=True)
        return self._collective(handle, "all_reduce", group, _nbytes(tensor), name, post, async_op)

    @_labeled("quietsync/comm/reduce_scatter")
    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, group: str = "world", op: str = "sum",
        async_op: bool = False, name: str = "reduce_scatter",
    ) -> Work:
        """``output`` (this worker's 1/n) ← reduction of the n equal chunks of ``input``."""
        n = self.group_size(group)
        if input.numel() != n * output.numel():
            raise ValueError(
                f"reduce_scatter input must have {n}x the output's elements, got {input.numel()} vs {output.numel()}"
            )
        red, post = self._op(op, n, output)
        handle = None
        if n > 1:
            handle = _reduce_scatter_flat(output, input, op=red, group=self._groups[group], async_op=True)
        elif output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
        return self._collective(handle, "reduce_scatter", group, _nbytes(input), name, post, async_op)

    @_labeled("quietsync/comm/all_gather")
    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: str = "world", async_op: bool = False,
        name: str = "all_gather",
    ) -> Work:
        """``output`` ← concatenation of every worker's ``input`` in group-rank order."""
        n = self.group_size(group)
        if output.numel() != n * input.numel():
            raise ValueError(
                f"all_gather output must have {n}x the input's elements, got {output.numel()} vs {input.numel()}"
            )
        handle = None
        if n > 1:
            handle = _all_gather_flat(output, input, group=self._groups[group], async_op=True)
        elif output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
        return self._collective(handle, "all_gather", group, _nbytes(output), name, None, async_op)

    def all_gather_uneven(self, tensor: torch.Tensor, group: str = "world", name: str = "all_gather_uneven"
                          ) -> list[torch.Tensor]:
        """Gather 1-D tensors of different lengths; returns one tensor per group rank (blocking)."""
        n = self.group_size(group)
        flat = tensor.reshape(-1)
        if n == 1:
            return [flat.clone()]
        sizes = torch.zeros(n, dtype=torch.int64, device=flat.device)
        mine = torch.tensor([flat.numel()], dtype=torch.int64, device=flat.device)
        self.all_gather(sizes, mine, group, name=f"{name}/sizes")
        counts = sizes.tolist()
        width = max(counts)
        padded = flat.new_zeros(width)
        padded[: flat.numel()] = flat
        out = flat.new_empty(n * width)
        self.all_gather(out, padded, group, name=name)
        return [out[i * width : i * width + c] for i, c in enumerate(counts)]

    @_labeled("quietsync/comm/broadcast")
    def broadcast(self, tensor: torch.Tensor, src: int = 0, group: str = "world", async_op: bool = False,
                  name: str = "broadcast") -> Work:
        """``tensor`` ← the one of group rank ``src``."""
        n = self.group_size(group)
        self._check_group_rank(group, src, "src")
        handle = None
        if n > 1:
            handle = dist.broadcast(tensor, src=self.global_rank(group, src), group=self._groups[group], async_op=True)
        # chain broadcast: every worker but the last forwards B; every worker but the source receives B
        pos = (self.group_rank(group) - src) % n
        nbytes = _nbytes(tensor)
        sent = nbytes if n > 1 and pos < n - 1 else 0
        recv = nbytes if n > 1 and pos > 0 else 0
        return self._collective(handle, "broadcast", group, nbytes, name, None, async_op, sent, recv, src=src)

    @_labeled("quietsync/comm/send")
    def send(self, tensor: torch.Tensor, dst: int, group: str = "world", async_op: bool = False,
             name: str = "send") -> Work:
        """Point-to-point send to group rank ``dst`` (another worker), matched by its :meth:`recv`."""
        return self._one_way("send", tensor, dst, group, async_op, name)

    @_labeled("quietsync/comm/recv")
    def recv(self, tensor: torch.Tensor, src: int, group: str = "world", async_op: bool = False,
             name: str = "recv") -> Work:
        """Point-to-point receive from group rank ``src`` (another worker), matched by its :meth:`send`."""
        return self._one_way("recv", tensor, src, group, async_op, name)

    def _one_way(self, kind: str, tensor: torch.Tensor, peer_rank: int, group: str, async_op: bool,
                 name: str) -> Work:
        """A send (``kind="send"``, to ``peer_rank``) or a receive (from it): metered, booked on the transmit or
        the receive queue of the peer's link."""
        sending = kind == "send"
        peer = self._peer(group, peer_rank, "dst" if sending else "src")
        _check_p2p_tensor(tensor, "tensor")
        if sending:
            handle = dist.isend(tensor, group=self._groups[group], group_dst=peer_rank)
        else:
            handle = dist.irecv(tensor, group=self._groups[group], group_src=peer_rank)
        link = self.link_to(peer)
        nbytes = _nbytes(tensor)
        seconds = link.time(kind, nbytes, 2) if link is not None else 0.0
        return self._p2p((handle,), kind, group, nbytes, name, async_op, sent=nbytes if sending else 0,
                         recv=0 if sending else nbytes, dst=peer_rank if sending else None,
                         src=None if sending else peer_rank, bookings=[(link, seconds, sending, not sending)])

    @_labeled("quietsync/comm/exchange")
    def exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group: str = "world",
                 async_op: bool = False, name: str = "exchange") -> Work:
        """Send ``send`` to group rank ``dst`` while receiving ``recv`` from group rank ``src``, at once.

        Both are posted together (``torch.distributed.batch_isend_irecv``), so a ring step costs one
        transfer time on a full-duplex link (B/β), not two. Metered as ``exchange`` on ``group`` and per peer
        (bytes of ``send`` sent to ``dst``, bytes of ``recv`` received from ``src``), link-emulated on the
        transmit queue of ``dst``'s link and the receive queue of ``src``'s link, recorded as one ``comm`` span.

        Matching rules (point-to-point operations are matched, not collective):

        * every ``exchange`` (or :meth:`send`) to a peer must be matched by that peer's ``exchange`` (or
          :meth:`recv`) from this worker, with a tensor of the same number of elements and dtype;
        * operations between the same two workers in the same direction are matched in the order issued,
          so issue them in the same order on both sides, from one thread per group;
        * in a ring every worker calls ``exchange(x, right, y, left)`` in the same step
          (``right = (r + 1) % n``, ``left = (r - 1) % n``); a ring of 2 is fine (``right == left``);
        * with NCCL, if this is the first operation on ``group``, all of its workers must take part.

        ``dst == src == this worker`` (e.g. a ring of one) copies ``send`` into ``recv`` with no network.
        """
        n = self.group_size(group)
        me = self.group_rank(group)
        self._check_group_rank(group, dst, "dst")
        self._check_group_rank(group, src, "src")
        if (dst == me) != (src == me):
            raise ValueError(
                f"dst and src must both be this worker (group rank {me}: a local copy) or both other workers, "
                f"got dst={dst}, src={src}"
            )
        _check_p2p_tensor(send, "send")
        _check_p2p_tensor(recv, "recv")
        sent_b, recv_b = _nbytes(send), _nbytes(recv)
        if dst == me:
            if send.numel() != recv.numel() or send.dtype != recv.dtype:
                raise ValueError(
                    f"recv must match send in elements and dtype for an exchange with oneself, got "
                    f"{recv.numel()} {recv.dtype} vs {send.numel()} {send.dtype}"
                )
            if recv.data_ptr() != send.data_ptr():
                recv.copy_(send.view_as(recv))
            return self._p2p((), "exchange", group, sent_b, name, async_op, sent=0, recv=0, src=src, dst=dst,
                             bookings=[])
        assert n > 1
        pg = self._groups[group]
        handles = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, group=pg, group_peer=dst),
            dist.P2POp(dist.irecv, recv, group=pg, group_peer=src),
        ])
        tx_link, rx_link = self.link_to(self.global_rank(group, dst)), self.link_to(self.global_rank(group, src))
        tx_s = tx_link.time("send", sent_b, 2) if tx_link is not None else 0.0
        rx_s = rx_link.time("recv", recv_b, 2) if rx_link is not None else 0.0
        return self._p2p(tuple(handles), "exchange", group, sent_b, name, async_op, sent=sent_b, recv=recv_b,
                         src=src, dst=dst, bookings=[(tx_link, tx_s, True, False), (rx_link, rx_s, False, True)])

    def barrier(self, group: str = "world") -> None:
        """Wait for every worker of ``group`` (a tiny all-reduce, metered like any other)."""
        flag = torch.zeros(1, device=self.device)
        self.all_reduce(flag, group, name="barrier")

    def ddp_comm_hook(self, group: str = "world") -> Callable[[Any, Any], torch.futures.Future]:
        """A DDP communication hook that averages each gradient bucket through this transport.

        Use ``ddp.register_comm_hook(None, transport.ddp_comm_hook())``: torch DDP's all-reduce is then metered
        and link-emulated like every other collective.
        """
        n = self.group_size(group)

        def hook(_state: Any, bucket: Any) -> torch.futures.Future:
            buf = bucket.buffer()
            buf.div_(n)
            work = self.all_reduce(buf, group, async_op=True, name="ddp_bucket")

            def bucket_done(f: torch.futures.Future) -> torch.Tensor:
                f.value()  # re-raise a failure of the all-reduce or of its accounting
                return buf

            return work.get_future().then(bucket_done)

        # DDP inspects the hook's annotations; give it real types (this module uses postponed annotations).
        hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        return hook

    # ------------------------------------------------------------------ internals
    def _op(self, op: str, n: int, target: torch.Tensor) -> tuple[Any, Callable[[], None] | None]:
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        red = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}[op]
        post = (lambda: target.div_(n)) if op == "avg" and n > 1 else None
        return red, post

    def _collective(self, handle: Any, kind: str, group: str, nbytes: int, name: str,
                    finish: Callable[[], None] | None, async_op: bool, sent: int | None = None,
                    recv: int | None = None, src: int | None = None) -> Work:
        """Wrap a collective: ring traffic both ways, booked on both queues of the group's link."""
        t_issue = time.perf_counter()
        n = self.group_size(group)
        link = self.link_for(group)
        modeled = link.time(kind, nbytes, n) if link is not None else 0.0
        t_wire, deadline = link.book(modeled, t_issue) if link is not None and n > 1 else (None, 0.0)
        if sent is None or recv is None:
            sent = recv = traffic(kind, nbytes, n)[1]
        work = Work(self, (handle,) if handle is not None else (), kind, group, nbytes, name, sent, recv,
                    src=src, modeled_s=modeled, t_issue=t_issue, deadline=deadline, finish=finish, t_wire=t_wire,
                    cuda_events=self._issue_event(handle is not None))
        if not async_op:
            work.wait()
        return work

    def _p2p(self, handles: tuple[Any, ...], kind: str, group: str, nbytes: int, name: str, async_op: bool,
             sent: int, recv: int, bookings: Sequence[tuple[LinkModel | None, float, bool, bool]],
             src: int | None = None, dst: int | None = None) -> Work:
        """Wrap a point-to-point operation: each ``(link, seconds, tx, rx)`` booking runs on its own queue."""
        t_issue = time.perf_counter()
        deadline, modeled = 0.0, 0.0
        t_wire: float | None = None
        for link, seconds, tx, rx in bookings:
            if link is not None:
                begin, end = link.book(seconds, t_issue, tx=tx, rx=rx)
                deadline = max(deadline, end)
                t_wire = begin if t_wire is None else min(t_wire, begin)
                modeled = max(modeled, seconds)
        work = Work(self, handles, kind, group, nbytes, name, sent, recv, src=src, dst=dst, modeled_s=modeled,
                    t_issue=t_issue, deadline=deadline, t_wire=t_wire, cuda_events=self._issue_event(bool(handles)))
        if not async_op:
            work.wait()
        return work

    def _issue_event(self, on_network: bool) -> tuple[Any, Any] | None:
        """On CUDA, a pair of events, the first recorded now on the current stream (the second is recorded at
        completion, see :meth:`Work._complete`); None on CPU or when nothing goes on the network."""
        if not on_network or self.device.type != "cuda" or not self.recorder.enabled:
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def _peer(self, group: str, group_rank: int, what: str) -> int:
        """Global rank of the point-to-point peer ``group_rank`` (validated: in the group, not this worker)."""
        self._check_group_rank(group, group_rank, what)
        if group_rank == self.group_rank(group):
            raise ValueError(f"{what} must be another worker's rank in group '{group}', got {group_rank} (this worker)")
        return self.global_rank(group, group_rank)

    def _check_group_rank(self, group: str, group_rank: int, what: str) -> None:
        n = self.group_size(group)
        if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < n:
            raise ValueError(f"{what} must be a rank of group '{group}' in [0, {n}), got {group_rank!r}")

    def _wait_handle(self, handle: Any, work: Work) -> None:
        try:
            handle.wait(timeout=self._timeout) if self.backend == "gloo" else handle.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise RuntimeError(
                f"quietsync: {work.kind} '{work.name}' on group '{work.group}' failed on rank "
                f"{self.topology.rank} (a peer died, raised, or exceeded the {self.timeout_s:g}s timeout): {exc}"
            ) from exc

    def _account(self, work: Work, t1: float) -> None:
        self.meter.add(work.group, work.kind, work.sent, work.recv, t1 - work.t_issue)
        if not work.handles:
            return  # nothing went on the network (a group of one, an exchange with oneself): no span
        if work.dst is not None:
            self.meter.add_peer(self.global_rank(work.group, work.dst), sent=work.sent)
        if work.src is not None and work.kind != "broadcast":
            self.meter.add_peer(self.global_rank(work.group, work.src), recv=work.recv)
        self.recorder.add("comm", work.name, work.t_issue, t1, t_wire=work.t_wire, device_events=work.cuda_events,
                          group=work.group, kind=work.kind, bytes=work.sent, modeled_s=work.modeled_s)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_p2p_tensor(t: torch.Tensor, what: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous tensor for point-to-point transfer")
