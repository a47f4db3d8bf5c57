"""The operations of the one door to ``torch.distributed``: collectives and point-to-point transfers, each metered
and, with a link model, stretched to its modeled time (see the package docstring)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..events import ByteMeter, EventRecorder
from ..link import LINK_NAMES, LinkModel, traffic
from ..topology import Topology
from .groups import ProcessGroups
from .work import Work

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


class Transport(ProcessGroups):
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

    fault_tolerant = False
    """Whether the replicate dimension is torchft's (members change with the quorum; see quietsync.faults)."""

    def __init__(
        self,
        topology: Topology | None = None,
        links: Mapping[str, LinkModel] | None = None,
        recorder: EventRecorder | None = None,
        timeout_s: float = 300.0,
        backend: str | None = None,
    ) -> None:
        links = dict(links or {})
        for key in links:
            if key not in LINK_NAMES:
                raise ValueError(f"links keys must be in {LINK_NAMES}, got {key!r}")
        self.links: dict[str, LinkModel] = links
        self.recorder = recorder if recorder is not None else EventRecorder()
        self.meter = ByteMeter()
        super().__init__(topology, timeout_s, backend)
        self.start_link_clocks()

    def start_link_clocks(self, elapsed: float = 0.0) -> None:
        """Start the clock of every scheduled link at one moment shared by all workers: a collective (every
        worker calls it at the same point; nothing happens without a scheduled link).

        ``t = 0`` of a link schedule is the moment the workers leave a start barrier (an :meth:`agree` on the
        control group); each worker reads its own ``perf_counter`` then. So every worker sees the same rate at
        the same moment, to within the barrier's release skew (under a millisecond on one machine, about one
        network latency across machines), with no clock synchronised between machines. The transport starts the
        clocks when it is built; the trainer starts them again when training starts, with ``elapsed`` = the
        training time a resumed run already had (agreed: the largest any worker reports), so the schedule
        follows training time and a resumed run continues it where it stopped. The first call also creates the
        gloo groups on which each collective agrees when it starts (``ProcessGroups.latest_in``; the rule is in
        :mod:`quietsync.link`).
        """
        if not any(link.scheduled for link in self.links.values()):
            return
        if self.fault_tolerant:  # replicas start and restart on their own: no moment they all share
            raise ValueError("a --link schedule needs one clock shared by every worker, which --fault-tolerance "
                             "torchft's replicas do not have (they start and restart on their own); use a steady link")
        self.make_clock_groups()
        elapsed = self.agree(float(elapsed), "max")
        epoch = time.perf_counter() - elapsed
        for link in self.links.values():
            link.start_clock(epoch)

    # ------------------------------------------------------------------ links
    def link_for(self, group: str) -> LinkModel | None:
        """The link a collective over ``group`` uses: ``inter`` iff the group spans nodes, else ``intra``."""
        self._ranks(group)  # validates the name: raises on an unknown group
        return self.links.get("inter" if self.topology.spans_nodes(group) else "intra")

    def link_to(self, peer: int) -> LinkModel | None:
        """The link point-to-point traffic with global rank ``peer`` uses: ``inter`` iff it is on another node."""
        other_node = self.topology.node_of(peer) != self.topology.node
        return self.links.get("inter" if other_node else "intra")

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
            # always issued async: Work waits for it, then sits out the link's modeled time
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
        elif output.data_ptr() != input.data_ptr():  # a group of one: the input is the result (unless aliased)
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
        # all_gather needs equal sizes: pad to the longest, then cut each back to its count
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
            handle = dist.broadcast(tensor, group_src=src, group=self._groups[group], async_op=True)
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
        return self._p2p((handle,), kind, group, nbytes, name, async_op, sent=nbytes if sending else 0,
                         recv=0 if sending else nbytes, dst=peer_rank if sending else None,
                         src=None if sending else peer_rank, bookings=[(link, kind, nbytes, sending, not sending)])

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
        return self._p2p(tuple(handles), "exchange", group, sent_b, name, async_op, sent=sent_b, recv=recv_b,
                         src=src, dst=dst, bookings=[(tx_link, "send", sent_b, True, False),
                                                     (rx_link, "recv", recv_b, False, True)])

    def across_replicas(self, fn: Callable[[], Any]) -> Any:
        """``fn()``: the collectives of one exchange across replicas (e.g. an all-gather and the decoding that
        reads the group's size), as one unit. Here it simply runs; under ``--fault-tolerance torchft``
        (:class:`~quietsync.faults.transport.FaultTolerantTransport`) the quorum commits the unit, and runs it again
        among the survivors when a replica dies during it -- so ``fn`` must read ``group_size`` inside and leave
        no state changed but its result."""
        return fn()

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
        # avg as a sum, then a division once the data is in: gloo has no AVG reduction
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
        modeled = 0.0
        t_wire: float | None = None
        deadline = 0.0
        if link is not None and n > 1:
            start = t_issue
            if link.scheduled:
                # every end must read the schedule at one moment: when the last of them is ready to be served
                ready = link.ready_at(t_issue) - link.epoch
                start = link.epoch + self.latest_in(group, ready)
            t_wire, deadline = link.book_transfer(kind, nbytes, n, start)
            # on a scheduled link: at the rates in force while it is served
            modeled = deadline - t_wire if link.scheduled else link.time(kind, nbytes, n)
        if sent is None or recv is None:
            sent = recv = traffic(kind, nbytes, n)[1]  # ring algorithms receive what they send
        work = Work(self._wait_handle, self._account, (handle,) if handle is not None else (), kind, group, nbytes,
                    name, sent, recv, src=src, modeled_s=modeled, t_issue=t_issue, deadline=deadline, finish=finish,
                    t_wire=t_wire, cuda_events=self._issue_event(handle is not None))
        if not async_op:
            work.wait()
        return work

    def _p2p(self, handles: tuple[Any, ...], kind: str, group: str, nbytes: int, name: str, async_op: bool,
             sent: int, recv: int, bookings: Sequence[tuple[LinkModel | None, str, int, bool, bool]],
             src: int | None = None, dst: int | None = None) -> Work:
        """Wrap a point-to-point operation: each ``(link, kind, bytes, tx, rx)`` booking (``kind`` send or recv)
        runs on its own queue."""
        t_issue = time.perf_counter()
        deadline, modeled = 0.0, 0.0
        t_wire: float | None = None
        for link, one_way, size, tx, rx in bookings:
            if link is not None:
                # n=2: a transfer between two workers (traffic() counts nothing for a group of one)
                begin, end = link.book_transfer(one_way, size, 2, t_issue, tx=tx, rx=rx)
                deadline = max(deadline, end)
                t_wire = begin if t_wire is None else min(t_wire, begin)
                modeled = max(modeled, end - begin if link.scheduled else link.time(one_way, size, 2))
        work = Work(self._wait_handle, self._account, handles, kind, group, nbytes, name, sent, recv, src=src,
                    dst=dst, modeled_s=modeled, t_issue=t_issue, deadline=deadline, t_wire=t_wire,
                    cuda_events=self._issue_event(bool(handles)))
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
        # bool is an int subclass: True is no rank
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
        # a broadcast's src is its root, not the peer a chain relays from
        if work.src is not None and work.kind != "broadcast":
            self.meter.add_peer(self.global_rank(work.group, work.src), recv=work.recv)
        self.recorder.add("comm", work.name, work.t_issue, t1, t_wire=work.t_wire, device_events=work.cuda_events,
                          group=work.group, kind=work.kind, bytes=work.sent, modeled_s=work.modeled_s)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_p2p_tensor(t: torch.Tensor, what: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous tensor for point-to-point transfer")
