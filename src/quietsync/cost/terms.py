"""The overlap rules as composable terms: how a step's computation and transfers combine into wall time.

========================  ==============================================================================
``MicroBatches(k)``       k forward+backward passes on the main thread
``Work(name, seconds)``   other main-thread computation (an optimizer step, a codec, a copy)
``Wire(comms)``           transfers on the main thread's critical path, serial on the link (alpha-beta)
``Seq(a, b, ...)``        one after another: times add
``Hidden(compute, comm)`` comm runs on another thread while compute runs: max of the two, and the exposed
                          communication is ``max(0, comm − compute)``
``Exposed(comm, window)`` comm on another thread during time counted elsewhere: only ``max(0, comm − window)``
``Every(term, k)``        something that happens once every k steps, amortised per step
``Buckets(...)``          DDP: bucket all-reduces start as the last backward frees their gradients
``Adaptive(job, ...)``    ACCO/DPU/WP stage: micro-batches accumulate until the job on the
                          communication worker is done (at least ``low``, at most ``high``)
========================  ==============================================================================

Each term evaluates to a :class:`~quietsync.cost.costmodel.Cost` in a :class:`~quietsync.cost.costmodel.Ctx` (the
compute profile, the links, this worker's topology).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .costmodel import Comm, Cost, Ctx


class Term:
    """A piece of a step's timeline (see the module docstring)."""

    def cost(self, ctx: Ctx) -> Cost:
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class MicroBatches(Term):
    """``count`` forward+backward passes on the main thread (synchronous: the slowest worker sets the time)."""

    count: float

    def cost(self, ctx: Ctx) -> Cost:
        t = self.count * ctx.compute.micro_batch_s * ctx.slowest
        w = ctx.topo.world_size
        return Cost(t, t, 0.0, self.count, self.count * w)

    def describe(self) -> str:
        return f"{self.count:g} micro-batch(es)"


@dataclass(frozen=True)
class Work(Term):
    """Other main-thread computation: ``seconds(ctx)``."""

    name: str
    seconds: Callable[[Ctx], float]

    def cost(self, ctx: Ctx) -> Cost:
        t = self.seconds(ctx) * ctx.slowest
        return Cost(t, t)

    def describe(self) -> str:
        return self.name


def optimizer(elements: float, name: str = "optimizer step") -> Work:
    """The user's optimizer over ``elements`` parameter elements on the main thread."""
    return Work(name, lambda ctx: ctx.compute.optimizer_s(elements))


def copy(nbytes: float, name: str = "copy") -> Work:
    """A memory copy of ``nbytes`` on the main thread."""
    return Work(name, lambda ctx: ctx.compute.copy_s_per_byte * nbytes)


@dataclass(frozen=True)
class Wire(Term):
    """Transfers on the critical path, one after another on the link (blocking collectives)."""

    comms: tuple[Comm, ...]

    def __init__(self, comms: Iterable[Comm]) -> None:
        object.__setattr__(self, "comms", tuple(comms))  # frozen: its own __init__ must bypass the freeze

    def cost(self, ctx: Ctx) -> Cost:
        t = sum(ctx.wire(c) * c.count for c in self.comms)
        return Cost(t, 0.0, t)

    def describe(self) -> str:
        return " + ".join(c.name or c.kind for c in self.comms)


@dataclass(frozen=True)
class Seq(Term):
    """Terms one after another."""

    terms: tuple[Term, ...]

    def __init__(self, *terms: Term) -> None:
        object.__setattr__(self, "terms", tuple(terms))

    def cost(self, ctx: Ctx) -> Cost:
        out = Cost(0.0)
        for t in self.terms:
            out = out + t.cost(ctx)
        return out

    def describe(self) -> str:
        return " → ".join(t.describe() for t in self.terms)


@dataclass(frozen=True)
class Hidden(Term):
    """``comm`` runs on another thread while ``compute`` runs on the main thread: the step waits for both."""

    compute: Term
    comm: Term

    def cost(self, ctx: Ctx) -> Cost:
        a, b = self.compute.cost(ctx), self.comm.cost(ctx)
        return Cost(max(a.time, b.time), a.compute, a.comm + b.comm, a.micro_batches, a.global_micro_batches)

    def describe(self) -> str:
        return f"[{self.compute.describe()}] ‖ [{self.comm.describe()}]"


@dataclass(frozen=True)
class Exposed(Term):
    """``comm`` runs on another thread during ``window``, which the timeline already counts elsewhere (e.g. the
    τ inner steps a Streaming DiLoCo exchange overlaps): only what sticks out, ``max(0, comm − window)``, adds."""

    comm: Term
    window: Term

    def cost(self, ctx: Ctx) -> Cost:
        c, w = self.comm.cost(ctx), self.window.cost(ctx)
        return Cost(max(0.0, c.time - w.time), 0.0, c.comm)

    def describe(self) -> str:
        return f"[{self.comm.describe()}] beyond [{self.window.describe()}]"


@dataclass(frozen=True)
class Every(Term):
    """``term`` once every ``k`` steps, amortised per step."""

    term: Term
    k: float

    def cost(self, ctx: Ctx) -> Cost:
        return self.term.cost(ctx).scaled(1.0 / self.k)

    def describe(self) -> str:
        return f"({self.term.describe()}) / {self.k:g}"


@dataclass(frozen=True)
class Buckets(Term):
    """DDP's overlap: the last micro-batch of a round, whose backward all-reduces gradient buckets as it frees them.

    Its forward runs first; backward runs in reverse parameter order, and bucket k is ready when the backward
    has covered ``ready[k]`` of itself (a fraction, by parameter elements). A bucket's all-reduce starts when it
    is ready and the previous one is done (one link, FIFO); the micro-batch ends when both the backward and the
    last all-reduce have ended. Counts as one micro-batch.
    """

    ready: tuple[float, ...]
    comms: tuple[Comm, ...]

    def cost(self, ctx: Ctx) -> Cost:
        fwd = ctx.compute.forward_s * ctx.slowest
        bwd = ctx.compute.backward_s * ctx.slowest
        end = 0.0
        total = 0.0
        for frac, c in zip(self.ready, self.comms):
            d = ctx.wire(c) * c.count
            end = max(end, frac * bwd) + d
            total += d
        return Cost(fwd + max(bwd, end), fwd + bwd, total, 1.0, float(ctx.topo.world_size))

    def describe(self) -> str:
        return f"forward, then backward ‖ {len(self.comms)} bucket all-reduce(s)"


@dataclass(frozen=True)
class Adaptive(Term):
    """A stage of ACCO/DPU/WP: the main thread accumulates micro-batches while ``job`` runs on the communication
    worker, and the stage ends after the first micro-batch that finishes once the job is done (at least
    ``low`` micro-batches; at ``high`` it waits for the job instead; ``fixed``: exactly that many, waiting if
    needed). Each worker computes at its own speed, so faster workers contribute more micro-batches."""

    job: Term
    low: int = 1
    high: int | None = None
    fixed: int | None = None

    def cost(self, ctx: Ctx) -> Cost:
        job = self.job.cost(ctx)
        mb = ctx.compute.micro_batch_s
        scales = ctx.compute.scales(ctx.topo.world_size)
        counts = []
        ends = []
        for s in scales:
            t = mb * s
            if self.fixed is not None:
                k = self.fixed
            else:
                # 1e-9: a job of exactly k micro-batches must not round up to k + 1
                k = max(self.low, math.ceil(job.time / t - 1e-9) if t > 0 else self.low)
                if self.high is not None:
                    k = min(k, self.high)
            counts.append(k)
            ends.append(k * t)
        # the job starts when the slowest worker hands over; the next hand-over waits for it
        stage = max(max(ends), job.time)
        me = ctx.topo.rank
        return Cost(stage, ends[me] if me < len(ends) else ends[0], job.comm, sum(counts) / len(counts), sum(counts))

    def describe(self) -> str:
        return f"micro-batches until [{self.job.describe()}] is done"
