"""The one door to ``torch.distributed``: every collective quietsync runs goes through :class:`Transport`.

Because there is one door, three things hold for every algorithm, baselines included:

* **metering** — bytes sent and received are counted per group and per direction from the collective's
  algorithm (:func:`quietsync.link.traffic`), together with the seconds each group's collectives took;
* **timelines** — every collective becomes a ``comm`` span in the :class:`~quietsync.events.EventRecorder`;
* **link emulation** — with a :class:`~quietsync.link.LinkModel` for the ``inter`` (groups spanning nodes)
  or ``intra`` link, each collective is stretched to at least its modeled time, FIFO per link, so a
  laptop behaves like two nodes on a 100 Mbit/s network. The stretch happens in :meth:`Work.wait`, i.e. on
  whichever thread waits: the communication worker's in overlapped strategies, the main thread otherwise.

Groups are named ``world``, ``shard`` (inside a node) and ``replicate`` (across nodes); the transport
creates its own process group for each (all ranks, same order), so collectives issued from the
communication worker thread never interleave with another thread's on the same group. A group of one
never touches the network. Failures do not hang: collectives wait at most ``timeout_s`` and a dead peer
surfaces as an error on the others.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .events import ByteMeter, EventRecorder
from .link import LINK_NAMES, LinkModel, traffic
from .topology import GROUPS, Topology

OPS = ("sum", "avg", "max", "min")

# torch 2.13 renamed the flat collectives; keep older releases working.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Work:
    """Handle of a (possibly asynchronous) collective. :meth:`wait` is idempotent."""

    def __init__(
        self,
        transport: Transport,
        handle: Any,
        kind: str,
        group: str,
        nbytes: int,
        name: str,
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._transport = transport
        self._handle = handle
        self.kind, self.group, self.nbytes, self.name = kind, group, nbytes, name
        self._finish = finish
        self.t_issue = time.perf_counter()
        n = transport.group_size(group)
        link = transport.link_for(group)
        self.modeled_s = link.time(kind, nbytes, n) if link is not None else 0.0
        self._deadline = link.reserve(self.modeled_s, self.t_issue) if link is not None and n > 1 else 0.0
        self._done = False

    def wait(self) -> None:
        """Block until the collective (and its emulated wire time) is over; re-raise its error."""
        if self._done:
            return
        if self._handle is not None:
            self._transport._wait_handle(self._handle, self)
        self._complete()

    def _complete(self) -> None:
        remaining = self._deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        if self._finish is not None:
            self._finish()
        t1 = time.perf_counter()
        self._done = True
        self._transport._account(self, t1)

    def is_completed(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future:
        """A future that resolves after the emulated wire time, for DDP communication hooks."""
        if self._handle is None:
            self._complete()
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(None)
            return fut

        def then(_f: torch.futures.Future) -> None:
            _f.value()  # re-raise a failure
            self._complete()

        return self._handle.get_future().then(then)


class Transport:
    """Metered, link-emulating collectives over the ``world``, ``shard`` and ``replicate`` groups.

    Args:
        topology: who is where; by default :meth:`Topology.from_env`.
        links: ``{"inter": LinkModel, "intra": LinkModel}``; missing links are not emulated.
        recorder: where ``comm`` spans go (a new one by default).
        timeout_s: how long any collective may wait for its peers before failing.
        backend: ``gloo`` or ``nccl``; default nccl when CUDA is available, else gloo.

    ``torch.distributed`` is initialised from the environment (``env://``, as torchrun sets it) when the
    world has more than one worker and it is not initialised yet.
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
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.backend = backend
        self.device = (
            torch.device("cuda", self.topology.local_rank % max(1, torch.cuda.device_count()))
            if backend == "nccl"
            else torch.device("cpu")
        )
        self._groups: dict[str, Any] = {}
        self._global_ranks: dict[str, tuple[int, ...]] = {g: self.topology.ranks(g) for g in GROUPS}
        if self.topology.world_size > 1:
            self._init_groups()

    # ------------------------------------------------------------------ setup
    def _init_groups(self) -> None:
        topo = self.topology
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            if self.backend == "nccl":
                torch.cuda.set_device(self.device)
            dist.init_process_group(
                self.backend, rank=topo.rank, world_size=topo.world_size, timeout=self._timeout
            )
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
        """Destroy this transport's process groups (the default group stays, owned by the caller)."""
        for pg in set(g for g in self._groups.values() if g is not None):
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self._groups.clear()

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

    def link_for(self, group: str) -> LinkModel | None:
        return self.links.get("inter" if self.topology.spans_nodes(group) else "intra")

    def _ranks(self, group: str) -> tuple[int, ...]:
        try:
            return self._global_ranks[group]
        except KeyError:
            raise ValueError(f"group must be one of {GROUPS}, got {group!r}") from None

    # ------------------------------------------------------------------ collectives
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
        return self._issue(handle, "all_reduce", group, _nbytes(tensor), name, post, async_op)

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
        return self._issue(handle, "reduce_scatter", group, _nbytes(input), name, post, async_op)

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
        return self._issue(handle, "all_gather", group, _nbytes(output), name, None, async_op)

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

    def broadcast(self, tensor: torch.Tensor, src: int = 0, group: str = "world", async_op: bool = False,
                  name: str = "broadcast") -> Work:
        """``tensor`` ← the one of group rank ``src``."""
        n = self.group_size(group)
        handle = None
        if n > 1:
            handle = dist.broadcast(tensor, src=self.global_rank(group, src), group=self._groups[group], async_op=True)
        work = self._issue(handle, "broadcast", group, _nbytes(tensor), name, None, True)
        work.src = src  # type: ignore[attr-defined]
        if not async_op:
            work.wait()
        return work

    def send(self, tensor: torch.Tensor, dst: int, group: str = "world", async_op: bool = False,
             name: str = "send") -> Work:
        """Point-to-point send to group rank ``dst``."""
        handle = dist.isend(tensor, dst=self.global_rank(group, dst), group=self._groups.get(group))
        return self._issue(handle, "send", group, _nbytes(tensor), name, None, async_op, peers=2)

    def recv(self, tensor: torch.Tensor, src: int, group: str = "world", async_op: bool = False,
             name: str = "recv") -> Work:
        """Point-to-point receive from group rank ``src``."""
        handle = dist.irecv(tensor, src=self.global_rank(group, src), group=self._groups.get(group))
        return self._issue(handle, "recv", group, _nbytes(tensor), name, None, async_op, peers=2)

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
            return work.get_future().then(lambda _f: buf)

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

    def _issue(self, handle: Any, kind: str, group: str, nbytes: int, name: str,
               finish: Callable[[], None] | None, async_op: bool, peers: int | None = None) -> Work:
        work = Work(self, handle, kind, group, nbytes, name, finish)
        if peers is not None:  # point-to-point: a two-party exchange whatever the group size
            work.peers = peers  # type: ignore[attr-defined]
        if not async_op:
            work.wait()
        return work

    def _wait_handle(self, handle: Any, work: Work) -> None:
        try:
            handle.wait(timeout=self._timeout) if self.backend == "gloo" else handle.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise RuntimeError(
                f"quietsync: {work.kind} '{work.name}' on group '{work.group}' failed on rank "
                f"{self.topology.rank} (a peer died, raised, or exceeded the {self.timeout_s:g}s timeout): {exc}"
            ) from exc

    def _account(self, work: Work, t1: float) -> None:
        n = getattr(work, "peers", None) or self.group_size(work.group)
        _, sent = traffic(work.kind, work.nbytes, n)
        if work.kind == "send":
            s, r = sent, 0
        elif work.kind == "recv":
            s, r = 0, sent
        elif work.kind == "broadcast":
            # chain broadcast: every worker but the last forwards B; every worker but the source receives B
            size = self.group_size(work.group)
            me = self.group_rank(work.group)
            src = getattr(work, "src", 0)
            pos = (me - src) % size
            s = work.nbytes if size > 1 and pos < size - 1 else 0
            r = work.nbytes if size > 1 and pos > 0 else 0
        else:
            s = r = sent
        self.meter.add(work.group, work.kind, s, r, t1 - work.t_issue)
        if n > 1:
            self.recorder.add("comm", work.name, work.t_issue, t1, group=work.group, kind=work.kind,
                              bytes=s, modeled_s=work.modeled_s)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
