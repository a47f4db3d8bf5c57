"""Who is where: the world, the nodes, and the two groups every strategy talks to.

A **topology** names the world (all workers), the **shard group** (the workers of one node, who split
optimizer state / parameters over a fast local link) and the **replicate group** (the workers holding the
same shard on different nodes, linked by the slow network). It is a pure description; the transport builds
the process groups from it once.

Ranks are laid out node-major, as torchrun does: node ``k`` holds ranks ``k*W .. k*W + W - 1`` where ``W``
is the number of workers per node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GROUPS = ("world", "shard", "replicate")
"""The group names strategies use."""


@dataclass(frozen=True)
class Topology:
    """This worker's place in a ``nodes`` × ``workers_per_node`` world."""

    rank: int = 0
    """Global rank of this worker, in ``[0, world_size)``."""
    world_size: int = 1
    """Number of workers in the job."""
    nodes: int = 1
    """Number of nodes; must divide ``world_size``."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.nodes < 1 or self.world_size % self.nodes != 0:
            raise ValueError(
                f"nodes must be a positive divisor of the world size {self.world_size}, got {self.nodes}"
            )

    @classmethod
    def single(cls) -> Topology:
        """A world of one: no launcher, no process group."""
        return cls(0, 1, 1)

    @classmethod
    def from_env(cls, nodes: int | None = None) -> Topology:
        """Read the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``).

        Args:
            nodes: override the node count. By default it is ``WORLD_SIZE / LOCAL_WORLD_SIZE`` (one node per
                torchrun agent). Without any launcher variables the result is a world of one.
        """
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            # no launcher: a world of one, so nodes > 1 fails in _check_nodes with the usual message
            return cls.single() if nodes in (None, 1) else cls(0, 1, _check_nodes(nodes, 1))
        rank = int(os.environ["RANK"])
        world = int(os.environ["WORLD_SIZE"])
        if nodes is None:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            nodes = max(1, world // max(1, local))  # clamped: a LOCAL_WORLD_SIZE of 0 or above WORLD_SIZE is one node
        return cls(rank, world, _check_nodes(nodes, world))

    @property
    def workers_per_node(self) -> int:
        """Workers in each node (the shard group's size)."""
        return self.world_size // self.nodes

    @property
    def node(self) -> int:
        """Index of this worker's node."""
        return self.rank // self.workers_per_node

    @property
    def local_rank(self) -> int:
        """Index of this worker inside its node (its rank in the shard group)."""
        return self.rank % self.workers_per_node

    @property
    def shard_ranks(self) -> tuple[int, ...]:
        """Global ranks of this worker's shard group (its node)."""
        w = self.workers_per_node
        return tuple(range(self.node * w, (self.node + 1) * w))

    @property
    def replicate_ranks(self) -> tuple[int, ...]:
        """Global ranks of this worker's replicate group (same local index on every node)."""
        w = self.workers_per_node
        return tuple(self.local_rank + k * w for k in range(self.nodes))

    def all_shard_groups(self) -> list[tuple[int, ...]]:
        """Every shard group, in node order (process groups must be created by all ranks alike)."""
        w = self.workers_per_node
        return [tuple(range(k * w, (k + 1) * w)) for k in range(self.nodes)]

    def all_replicate_groups(self) -> list[tuple[int, ...]]:
        """Every replicate group, in local-index order."""
        w = self.workers_per_node
        return [tuple(i + k * w for k in range(self.nodes)) for i in range(w)]

    def ranks(self, group: str) -> tuple[int, ...]:
        """Global ranks of ``group`` (one of ``world``, ``shard``, ``replicate``) as seen from this worker."""
        if group == "world":
            return tuple(range(self.world_size))
        if group == "shard":
            return self.shard_ranks
        if group == "replicate":
            return self.replicate_ranks
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")

    def node_of(self, rank: int) -> int:
        """Index of the node holding global rank ``rank``."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be a global rank in [0, {self.world_size}), got {rank!r}")
        return rank // self.workers_per_node

    def spans_nodes(self, group: str) -> bool:
        """Whether a collective on ``group`` crosses the inter-node link."""
        ranks = self.ranks(group)
        w = self.workers_per_node
        return len({r // w for r in ranks}) > 1


def _check_nodes(nodes: int, world: int) -> int:
    if not isinstance(nodes, int) or nodes < 1 or world % nodes != 0:
        raise ValueError(f"nodes must be a positive divisor of the world size {world}, got {nodes}")
    return nodes
