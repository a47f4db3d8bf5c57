"""The cost model's pieces every family shares (for the ``cost.py`` beside each family): optimizer state sizes,
dtype sizes, group sizes, and what a replicator puts on the wire (its own ``payload_bytes``, in one collective).

See :mod:`quietsync.cost.costmodel` for the model these feed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...cost.costmodel import Comm, Cost, Ctx, numel
from ...cost.terms import Term
from ...cost.workload import Shape
from ...topology import Topology

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "int8": 1}


@dataclass(frozen=True)


class OptimizerState:
    """Bytes of a torch optimizer's state: per parameter element and per parameter tensor."""

    per_element: int
    """e.g. AdamW: exp_avg and exp_avg_sq in fp32, 8."""
    per_tensor: int
    """e.g. AdamW: its ``step`` counter, a float32 scalar tensor, 4."""

    def bytes(self, numels: Sequence[int]) -> int:
        """State of an optimizer over tensors of ``numels`` elements."""
        return sum(self.per_element * n + self.per_tensor for n in numels)

ADAMW = OptimizerState(8, 4)
"""torch.optim.AdamW (the trainer's optimizer)."""


def dtype_bytes(name: str) -> int:
    """Bytes of one element of dtype ``name`` (``float32``, ``bf16``, ``int8``...)."""
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {name!r}") from None


def group_of(topo: Topology, group: str) -> int:
    """Workers in ``group`` as seen from ``topo``."""
    return len(topo.ranks(group))


def replicator(name: str, compression: float, transfer_dtype: str, chunk: int = 64, topk: int | None = None,
               seed: int = 0, transfer_block: int = 64):
    """The library's replicator with these knobs (its declared payload is what the schedule sends)."""
    from ...wire.replicators import make_replicator

    return make_replicator(name, compression=compression, transfer_dtype=transfer_dtype, chunk=chunk, topk=topk,
                           seed=seed, transfer_block=transfer_block)


def replicator_comm(rep, shapes: Sequence[Shape], group: str, n: int, name: str,
                    steps: tuple[int, ...] | None = None) -> list[Comm]:
    """The one collective a replicator runs for tensors of ``shapes`` over a group of ``n``: an all-gather of
    every worker's payload (``dct``, and any replicator with a low-bit ``transfer_dtype``), an all-reduce of it
    (the others), nothing (``none``, a group of one)."""
    from ...wire.replicators import Segments

    if n == 1 or rep.collective == "none":
        return []
    shapes = [s for s in shapes if numel(s) > 0]
    payload = rep.payload_bytes(Segments(shapes))
    if rep.collective == "all_gather" or rep.lowbit is not None:  # low-bit payloads are gathered, never summed
        return [Comm("all_gather", group, n * payload, f"{name}: all-gather {rep.name} payload", steps=steps)]
    return [Comm("all_reduce", group, payload, f"{name}: all-reduce {rep.name} payload", steps=steps)]


def momentum_numel(rep, shapes: Sequence[Shape]) -> int:
    """Elements of a decoupled optimizer's flat momentum for ``shapes`` in the replicator's domain."""
    from ...wire.replicators import Segments

    return rep.momentum_numel(Segments([s for s in shapes if numel(s) > 0]))


@dataclass(frozen=True)
class FirstThatFits(Term):
    """``--adapt``: the step at the knob the run's controller picks on this link -- the first of ``steps`` (``(knob
    value, the step at it)``, in the controller's order of preference) whose exposed communication is at most
    ``overhead`` of its compute, else the last. On a link that changes, each steady stretch of it is costed with the
    value picked for it (demo's top-k, :mod:`~quietsync.strategies.decoupled.adapt_topk`)."""

    knob: str
    steps: tuple[tuple[Any, Term], ...]
    overhead: float

    def pick(self, ctx: Ctx) -> tuple[Any, Cost]:
        """The value picked on ``ctx``'s link, and the step's cost at it."""
        costs = [(v, t.cost(ctx)) for v, t in self.steps]
        for v, c in costs:
            # with no compute to hide behind, no value fits and the last one is taken
            if c.compute > 0 and c.exposed_comm <= self.overhead * c.compute:
                return v, c
        return costs[-1]

    def cost(self, ctx: Ctx) -> Cost:
        return self.pick(ctx)[1]

    def describe(self) -> str:
        return (f"{self.knob} picked from {', '.join(str(v) for v, _ in self.steps)} (exposed communication <= "
                f"{self.overhead:.0%} of compute): {self.steps[0][1].describe()}")
