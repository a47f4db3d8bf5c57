"""The replica group's own key-value store for torchft's Manager: where the workers of one replica group meet
(a ``TCPStore`` its rank 0 serves), kept in the fault-tolerance room so that the trainer builds no
``torch.distributed`` object of its own."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from .transport import FaultTolerantTransport

STORE_ENV = "QUIETSYNC_FT_STORE"
"""``host:port`` of a replica group's own TCPStore (torchft's Manager meets its workers there), set by the local
launcher for a replica group of several workers (its rank 0 serves it)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def replica_store(transport: FaultTolerantTransport, host: str, timeout_s: float) -> tuple[tuple[str, int], Any]:
    """``((host, port), server)``: the replica group's TCPStore for torchft's Manager; rank 0 serves it (the
    server object is kept alive by the caller; None on the other ranks)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    rank0 = transport.local_rank == 0
    given = os.environ.get(STORE_ENV)
    if given:
        where, _, port = given.rpartition(":")
        server = dist.TCPStore(where, int(port), is_master=rank0, wait_for_workers=False, timeout=timeout)
        return (where, int(port)), server if rank0 else None
    if transport.workers == 1:  # a lone worker serves its own store: nobody to tell its port
        port = _free_port()
        return (host, port), dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
    # under torchrun: rank 0 serves a store of its own and tells the others through torchrun's
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          wait_for_workers=False, timeout=timeout)
    key = "quietsync/fault_tolerance/store"
    server = None
    if rank0:
        port = _free_port()
        server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)
        agent.set(key, f"{host}:{port}")
    where, _, port = agent.get(key).decode().rpartition(":")
    return (where, int(port)), server
