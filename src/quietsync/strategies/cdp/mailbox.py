"""Cyclic DP's mailbox (a part): the point-to-point transfers of the reduce and distribution chains.

Every transfer is the schedule's (:class:`~.schedule.Message`): at time step ``t`` a worker posts the receives of
everything sent to it at ``t − 1`` (:meth:`Mailbox.post`), in the senders' order, and waits for one when it needs
it (:meth:`Mailbox.take`, the wait counted as idle); its sends (:meth:`Mailbox.send`) stay open until they complete
(gloo cannot poll a send), and are completed — so metered — once their cycle is committed on every worker
(:meth:`Mailbox.retire`) or the run ends (:meth:`Mailbox.wind_down`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from ...transport import Transport
from ..parts.accounting import StepAccounting
from ..parts.part import Part


@dataclass
class Sent:
    """A point-to-point send still to be completed (and so metered)."""

    time: int
    """Time step it was sent at."""
    cycle: int
    """Cycle of the gradient or version it carries."""
    work: Any
    """The transport's handle."""
    tensor: torch.Tensor
    """What was sent (kept alive until the send completes)."""


class Mailbox(Part):
    """The open receives and sends of one worker (see the module docstring)."""

    def __init__(self, transport: Transport, accounting: StepAccounting) -> None:
        self.transport, self.accounting = transport, accounting
        self.posted: dict[tuple, tuple[Any, torch.Tensor]] = {}
        self.sends: list[Sent] = []
        self.sent_per_step: dict[int, int] = defaultdict(int)
        """Bytes this worker handed to the transport at each time step."""
        self.sent_completed = 0
        """Bytes of those sends that completed (what the transport's meter has counted)."""

    def post(self, key: tuple, buf: torch.Tensor, src: int, kind: str) -> None:
        """Post the receive of ``key`` from worker ``src`` into ``buf``."""
        self.posted[key] = (self.transport.recv(buf, src, async_op=True, name=f"cdp/{kind}"), buf)

    def take(self, key: tuple) -> torch.Tensor:
        """The received tensor of ``key``, once it arrived (the wait is idle time)."""
        work, buf = self.posted.pop(key)
        t0 = time.perf_counter()
        work.wait()
        t1 = time.perf_counter()
        self.accounting.move_to_idle(t1 - t0, t1, "cdp_recv")
        return buf

    def send(self, tensor: torch.Tensor, dst: int, t: int, kind: str, cycle: int) -> None:
        """Send ``tensor`` (of ``cycle``) to worker ``dst`` at time step ``t``, left open."""
        work = self.transport.send(tensor, dst, async_op=True, name=f"cdp/{kind}")
        self.sends.append(Sent(t, cycle, work, tensor))
        self.sent_per_step[t] += tensor.numel() * tensor.element_size()

    def retire(self, steps: int) -> None:
        """Complete (and so meter) the sends of cycles this worker has committed (``< steps``). Every worker
        commits the same cycles, so their receivers post those receives: waiting cannot hang. Sends of later
        cycles stay open until they complete or the run ends."""
        keep = []
        for sent in self.sends:
            if sent.cycle < steps or sent.work.ready():
                self._complete(sent)
            else:
                keep.append(sent)
        self.sends = keep

    def wind_down(self, t: int) -> None:
        """The run ends at time step ``t`` on every worker: every message sent before ``t − 1`` was received by a
        peer in its loop, so its send is completed (metered); the sends of ``t − 1`` are received by nobody (a
        send is dropped only once it completed: gloo cancels a dropped pending send)."""
        for sent in self.sends:
            if sent.time < t - 1:
                self._complete(sent)
        self.sends = [sent for sent in self.sends if sent.time >= t - 1]

    @property
    def busy(self) -> bool:
        """Whether a send is still open."""
        return bool(self.sends)

    def _complete(self, sent: Sent) -> None:
        sent.work.wait()
        self.sent_completed += sent.tensor.numel() * sent.tensor.element_size()

    def close(self) -> None:
        """Drop what nobody will complete (the last time step's sends, receives never taken)."""
        self.sends.clear()
        self.posted.clear()
