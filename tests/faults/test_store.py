"""The replica group's own store for torchft's Manager (faults/store.py): rank 0 serves it on a port the system
picks as it listens, and the group's other workers learn where from their rendezvous store. A port chosen ahead and
bound later (by the launcher, then by rank 0) could be taken in between by any other process on the machine: the
replica group then failed to start with ``EADDRINUSE``."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks

pytest.importorskip("torchft")
pytestmark = pytest.mark.timeout(120)


def _store_of_a_group(rank: int, world: int) -> tuple[tuple[str, int], int | None, str]:
    """This worker's address of its replica group's store, the port its own server bound (rank 0), and what the
    other worker wrote there (with two)."""
    import torch.distributed as dist

    from quietsync.faults.store import replica_store
    from quietsync.faults.transport import FaultTolerantTransport

    transport = FaultTolerantTransport(0, 1, timeout_s=30)
    try:
        address, server = replica_store(transport, "127.0.0.1", 30)
        port = None if server is None else server.port
        if world == 1:
            return address, port, ""
        client = dist.TCPStore(address[0], address[1], is_master=False, wait_for_workers=False)
        client.set(f"hello/{rank}", str(rank))
        said = client.get(f"hello/{1 - rank}").decode()  # each reads what the other wrote there
        transport.barrier("shard")  # rank 0's server outlives the other's last read
        return address, port, said
    finally:
        transport.close()


def test_the_workers_of_a_replica_group_meet_at_the_store_its_rank_0_bound():
    (a0, port, said0), (a1, none, said1) = run_ranks(_store_of_a_group, 2, timeout=90)
    assert a0 == a1 == ("127.0.0.1", port) and port > 0 and none is None
    assert (said0, said1) == ("1", "0")


def test_a_lone_worker_serves_its_own_store_on_a_port_picked_as_it_listens():
    (address, port, _), = run_ranks(_store_of_a_group, 1, timeout=60)
    assert address == ("127.0.0.1", port) and port > 0
