"""A store of a torchrun worker generation's own, for jobs under torchrun's shared agent store.

torchrun (c10d rendezvous, store sharing on, the default since torch 2.4) hands every generation of workers the
same TCPStore; :func:`worker_group_store` gives each generation a store that starts empty, so an elastic restart
never reads a previous generation's keys.
"""

from __future__ import annotations

import datetime
import os
import secrets
import time
from typing import Any

import torch.distributed as dist

from ..topology import Topology

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""Set to ``True`` by torchrun when its workers share the agent's rendezvous store (the default since torch
2.4): see :func:`worker_group_store`."""

_ROUND_KEY = "quietsync/worker_group_store"


def uses_agent_store() -> bool:
    """Whether this worker was started by torchrun with the agent's store shared across restarts."""
    return os.environ.get(AGENT_STORE_ENV) == "True"


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
    world = topology.world_size
    timeout = datetime.timedelta(seconds=timeout_s)
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if topology.rank == 0:
        # port 0: any free port, published below with the nonce
        server = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = secrets.token_hex(8)
        server.set("quietsync/nonce", nonce)
        shared.set(_ROUND_KEY, f"{host}|{server.port}|{nonce}")
        return server
    deadline = time.monotonic() + timeout_s
    probe = datetime.timedelta(seconds=2)  # short: a stale entry's server is gone, so read the entry again soon
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
