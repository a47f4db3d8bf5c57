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

from .agent_store import AGENT_STORE_ENV, worker_group_store
from .groups import BACKEND_ENV, RENDEZVOUS_ENV, ProcessGroups, default_backend
from .transport import OPS, Transport
from .work import Collectives, PendingWork, Work, across_replicas

__all__ = [
    "AGENT_STORE_ENV", "BACKEND_ENV", "OPS", "RENDEZVOUS_ENV", "Collectives", "PendingWork", "ProcessGroups",
    "Transport", "Work", "across_replicas", "default_backend", "worker_group_store",
]
