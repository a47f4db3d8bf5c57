"""The replica group's own key-value store for torchft's Manager: where the workers of one replica group meet
(a ``TCPStore`` its rank 0 serves), kept in the fault-tolerance room so that the trainer builds no
``torch.distributed`` object of its own."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from .transport import FaultTolerantTransport

_KEY = "quietsync/fault_tolerance/store"
"""Where rank 0 of a replica group publishes ``host:port`` of the store it serves, in the group's rendezvous store."""


def replica_store(transport: FaultTolerantTransport, host: str, timeout_s: float) -> tuple[tuple[str, int], Any]:
    """``((host, port), server)``: the replica group's TCPStore for torchft's Manager; rank 0 serves it (the
    server object is kept alive by the caller; None on the other ranks).

    Rank 0 binds the store to a port the system picks when it listens (port 0), so no other process can take that
    port between its choice and its use, and tells the group's other workers where it is through their meeting
    store (:meth:`~quietsync.faults.transport.FaultTolerantTransport.rendezvous_store`, fresh for each start of the
    group, under the local launcher as under torchrun)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if transport.local_rank == 0:
        server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        if transport.workers > 1:  # a lone worker serves its own store: nobody to tell its port
            transport.rendezvous_store().set(_KEY, f"{host}:{server.port}")
        return (host, server.port), server
    where, _, port = transport.rendezvous_store().get(_KEY).decode().rpartition(":")
    return (where, int(port)), None
