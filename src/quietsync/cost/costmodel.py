"""The cost model's core: what one step of a strategy moves over which link, and how long the step takes.

A strategy's step is described by two things (see :class:`Schedule`):

* its **transfers** (:class:`Comm`): each collective or point-to-point transfer with its kind, group and size
  ``B`` exactly as the transport meters it. Bytes per worker come from :func:`quietsync.link.traffic` — the
  same function the transport counts with, so a prediction and the meter cannot disagree on the formula
  (ring all-reduce 2(n−1)/n·B each way, reduce-scatter and all-gather (n−1)/n·B, point-to-point B);
* its **timeline**: how computation and those transfers combine into wall time, written with the composable
  overlap rules of :mod:`~quietsync.cost.terms` (``MicroBatches``, ``Wire``, ``Hidden``, ``Adaptive``...),
  evaluated to a :class:`Cost` in a :class:`Ctx` (the :class:`~quietsync.cost.compute.ComputeProfile`, the
  :class:`Links`, this worker's topology).

Links are alpha-beta (:class:`~quietsync.link.LinkModel`: ``messages·α + bytes/β``), one per kind
(``intra``, ``inter``), full duplex: a collective's ring traffic flows both ways at once; a collective over a
group that spans nodes uses ``inter``, a point-to-point transfer the link of its peer's node. A link may have a
**floor** (the measured speed of the real transport under an emulated link): a transfer then takes the larger
of the two, as the transport's emulation stretches a real transfer to at least its modeled time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..link import LINK_NAMES, LinkModel, traffic
from ..topology import GROUPS, Topology
from .compute import ComputeProfile

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
P2P = ("send", "recv", "exchange")


@dataclass(frozen=True)
class Comm:
    """One transfer of a step, as the transport meters it."""

    kind: str
    """``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``, ``send``, ``recv`` or ``exchange``."""
    group: str
    """Transport group: ``world``, ``shard`` or ``replicate``."""
    nbytes: int
    """``B`` of :func:`quietsync.link.traffic`: the whole buffer (all-reduce), the unscattered input
    (reduce-scatter), the gathered output (all-gather), the tensor (point-to-point)."""
    name: str = ""
    """What it carries (for tables and tests)."""
    count: int = 1
    """How many times it runs per occurrence (e.g. FSDP's all-gathers: per micro-batch, per unit)."""
    steps: tuple[int, ...] | None = None
    """The steps of the schedule's period (1-based) on which it runs; None: every step."""
    peer: int | None = None
    """Point-to-point: the global rank of the peer (the link is ``inter`` iff it is on another node)."""

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVES + P2P:
            raise ValueError(f"kind must be one of {', '.join(COLLECTIVES + P2P)}, got {self.kind!r}")
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {', '.join(GROUPS)}, got {self.group!r}")
        if self.kind in P2P and self.peer is None:
            raise ValueError(f"a {self.kind} needs its peer")

    def runs_at(self, step: int, period: int) -> bool:
        """Whether it runs at (1-based) step ``step`` of a schedule whose pattern repeats every ``period``."""
        return self.steps is None or ((step - 1) % period) + 1 in self.steps

    def per_period(self, period: int) -> int:
        """How many times it runs in one period."""
        return self.count * (period if self.steps is None else len(self.steps))

    def bytes(self, topo: Topology) -> tuple[int, int]:
        """``(sent, received)`` by worker ``topo.rank`` for one run, as the transport's meter counts them."""
        if self.kind in P2P:
            b = self.nbytes
            return {"send": (b, 0), "recv": (0, b), "exchange": (b, b)}[self.kind]
        n = len(topo.ranks(self.group))
        if self.kind == "broadcast":  # chain: every worker but the last forwards; all but the root receive
            pos = topo.ranks(self.group).index(topo.rank)
            return (self.nbytes if n > 1 and pos < n - 1 else 0, self.nbytes if n > 1 and pos > 0 else 0)
        sent = traffic(self.kind, self.nbytes, n)[1]  # ring algorithms receive what they send
        return sent, sent

    def link(self, topo: Topology) -> str:
        """``inter`` or ``intra``: the link this transfer of worker ``topo.rank`` uses."""
        if self.kind in P2P:
            return "inter" if topo.node_of(self.peer) != topo.node else "intra"
        return "inter" if topo.spans_nodes(self.group) else "intra"


@dataclass
class Links:
    """The links a prediction uses: one alpha-beta model per kind, and optionally a measured floor per kind.

    Either may also hold a model per collective kind (``by_kind[link][collective]``): a backend may not move a
    collective at the link's speed (gloo's CPU reduce-scatter moves an all-reduce's worth of bytes while the
    meter counts the ring algorithm's), and the probe measures each collective the strategies use."""

    model: dict[str, LinkModel] = field(default_factory=dict)
    """Modeled (given or emulated) links by kind; a missing kind costs nothing (unless it has a floor)."""
    floor: dict[str, LinkModel] = field(default_factory=dict)
    """What the real transport achieves (measured by the probe); a transfer takes at least this long."""
    model_by_kind: dict[str, dict[str, LinkModel]] = field(default_factory=dict)
    """Per link kind, per collective kind (``all_reduce``, ``reduce_scatter``, ``all_gather``, ``p2p``): overrides
    :attr:`model` for that collective."""
    floor_by_kind: dict[str, dict[str, LinkModel]] = field(default_factory=dict)
    """The same for :attr:`floor`."""

    def __post_init__(self) -> None:
        for key in (*self.model, *self.floor, *self.model_by_kind, *self.floor_by_kind):
            if key not in LINK_NAMES:
                raise ValueError(f"link kinds must be in {LINK_NAMES}, got {key!r}")

    def seconds(self, kind: str, comm: Comm, topo: Topology) -> float:
        """Seconds one run of ``comm`` occupies link ``kind`` (0 for a group of one)."""
        if comm.kind in P2P:
            # a transfer between two; an exchange costs its send (full duplex: the receive runs alongside)
            n, tkind, coll = 2, ("send" if comm.kind in ("send", "exchange") else "recv"), "p2p"
        else:
            n, tkind, coll = len(topo.ranks(comm.group)), comm.kind, comm.kind
        if n <= 1:
            return 0.0
        out = 0.0
        for table, by_kind in ((self.model, self.model_by_kind), (self.floor, self.floor_by_kind)):
            link = by_kind.get(kind, {}).get(coll) or table.get(kind)
            if link is not None:
                out = max(out, link.time(tkind, comm.nbytes, n))
        return out

    def describe(self) -> dict[str, str]:
        """``{kind: "100mbit,5ms"}`` of the modeled links, with the floor where one was measured."""
        out = {}
        for kind in LINK_NAMES:
            parts = []
            if kind in self.model:
                parts.append(str(self.model[kind]))
            if kind in self.floor:
                parts.append(f"floor {self.floor[kind]}")
            if parts:
                out[kind] = ", ".join(parts)
        return out


@dataclass
class Ctx:
    """What a :class:`Term` needs to become seconds: the compute profile, the links, this worker's topology."""

    compute: ComputeProfile
    links: Links
    topo: Topology

    @property
    def slowest(self) -> float:
        """Compute scale of the slowest worker (synchronous steps wait for it)."""
        return max(self.compute.scales(self.topo.world_size))

    def wire(self, comm: Comm) -> float:
        """Seconds of one run of ``comm`` on this worker's link (α-β, floored)."""
        return self.links.seconds(comm.link(self.topo), comm, self.topo)


@dataclass(frozen=True)
class Cost:
    """A term evaluated: wall seconds on the critical path, and what filled them."""

    time: float
    """Wall seconds."""
    compute: float = 0.0
    """Main-thread compute seconds inside ``time`` (on the slowest worker for synchronous steps)."""
    comm: float = 0.0
    """Wire seconds of the transfers inside (hidden or not)."""
    micro_batches: float = 0.0
    """Micro-batches computed per worker (mean over workers)."""
    global_micro_batches: float = 0.0
    """Micro-batches computed by all workers together."""

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.time + other.time, self.compute + other.compute, self.comm + other.comm,
                    self.micro_batches + other.micro_batches, self.global_micro_batches + other.global_micro_batches)

    def scaled(self, k: float) -> Cost:
        return Cost(self.time * k, self.compute * k, self.comm * k, self.micro_batches * k,
                    self.global_micro_batches * k)

    @property
    def exposed_comm(self) -> float:
        """Seconds of the step that are not computation (waiting on the network)."""
        return max(0.0, self.time - self.compute)


def lcm(*values: int) -> int:
    """Least common multiple (1 for none)."""
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def steps_where(period: int, pred: Callable[[int], bool]) -> tuple[int, ...] | None:
    """The 1-based steps of a period where ``pred`` holds (None: all of them)."""
    steps = tuple(s for s in range(1, period + 1) if pred(s))
    return None if len(steps) == period else steps


def chunk_rows(rows: int, n: int, index: int) -> int:
    """Rows of chunk ``index`` of ``torch.chunk(rows, n)`` (the dim-0 shard FSDP2 holds; 0 past the end)."""
    size = -(-rows // n)  # torch.chunk's chunk size: ceil(rows / n)
    return max(0, min(size, rows - index * size))


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if len(shape) else 1


__all__ = ["COLLECTIVES", "P2P", "Comm", "Cost", "Ctx", "Links", "chunk_rows", "lcm", "numel", "steps_where"]
