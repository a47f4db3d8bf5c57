"""Topology: nodes x workers per node, shard and replicate groups, torchrun environment."""

import pytest

from quietsync import Topology


def test_groups_of_two_nodes_by_two_workers():
    t = Topology(rank=3, world_size=4, nodes=2)
    assert (t.node, t.local_rank, t.workers_per_node) == (1, 1, 2)
    assert t.shard_ranks == (2, 3)
    assert t.replicate_ranks == (1, 3)
    assert t.all_shard_groups() == [(0, 1), (2, 3)]
    assert t.all_replicate_groups() == [(0, 2), (1, 3)]
    assert t.spans_nodes("world") and t.spans_nodes("replicate") and not t.spans_nodes("shard")


def test_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    t = Topology.from_env()
    assert (t.rank, t.world_size, t.nodes) == (5, 8, 2)
    assert Topology.from_env(nodes=8).workers_per_node == 1


def test_no_launcher_is_a_world_of_one(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert Topology.from_env() == Topology.single()


def test_bad_topologies():
    with pytest.raises(ValueError, match="nodes must be a positive divisor of the world size 4"):
        Topology(0, 4, 3)
    with pytest.raises(ValueError, match="rank must be in"):
        Topology(4, 4, 1)
    with pytest.raises(ValueError, match="group must be one of"):
        Topology().ranks("galaxy")


def test_node_of_a_rank():
    t = Topology(rank=0, world_size=6, nodes=3)
    assert [t.node_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match=r"rank must be a global rank in \[0, 6\), got 6"):
        t.node_of(6)
