"""What a transport operation hands back (:class:`Work`), and the protocols the layers above depend on instead
of the whole :class:`~quietsync.transport.Transport` (:class:`Collectives`, :class:`PendingWork`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..events import label


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


def across_replicas(transport: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` as one exchange across replicas: ``transport.across_replicas(fn)`` where the transport has it
    (under torchft the quorum commits it, re-running it among the survivors when a replica dies during it), else
    ``fn()`` (a test double, a world without replicas). ``fn`` reads the group's size inside and changes no state
    but its result."""
    run = getattr(transport, "across_replicas", None)
    return fn() if transport is None or run is None else run(fn)


@dataclass(eq=False)
class Work:
    """Handle of a (possibly asynchronous) transport operation. :meth:`wait` is idempotent.

    Every field is fixed when the operation is issued; the transport fills them in, its own waiting and metering
    included (so a ``Work`` knows nothing of the transport beyond these two functions).
    """

    wait_handle: Callable[[Any, Work], None] = field(repr=False)
    """Waits for one torch.distributed handle of this operation (the issuer's timeout and error message)."""
    account: Callable[[Work, float], None] = field(repr=False)
    """Meters and records this operation once complete, given its ``perf_counter`` end time (the issuer's
    meter and timeline)."""
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
                self.wait_handle(handle, self)
            self._complete()

    def _complete(self) -> None:
        if self._done:  # wait() and a future's callback may both get here
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
        self.account(self, t1)

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
