"""An asynchronous join: a replica that heals takes its first step without data of its own, so the replicas it
joins do not wait for its first forward and backward.

Without it, a returning replica heals at a round boundary (the quorum's round: its state received, unpacked and
loaded) and then computes its first step's micro-batches, while the others, back from the same round, wait in that
step's gradient average for it. With it (``--async-join``, the default), the replica that just healed **abstains**
from that one step:

* it counts the step's micro-batches without computing them (:func:`abstain_micro_batch`): its gradient stays the
  zeros the heal left (:func:`~quietsync.faults.heal.load_heal_state`), and it enters the step's average as soon
  as its state is loaded;
* the unit's vote (:meth:`~quietsync.faults.quorum.ReplicaQuorum.run`) carries, besides each replica's non-finite
  verdict, whether it contributes, so every replica knows the step's **contributors**; the average divides the sum
  by their number (:meth:`~quietsync.faults.transport.FaultTolerantTransport.all_reduce`, ``op="avg"``) -- the
  abstaining replica's zeros add nothing, so the average is the survivors' alone, bit for bit;
* it applies that averaged gradient to the state it received, as the others apply it to theirs: every replica
  leaves the step with the same parameters and optimizer state;
* the commit holds the contributors' windows only (the window dealer's rule for a replica that did not take part:
  its slot's windows of the step go back and are dealt again first, so none is lost or read twice), and its
  record lists no windows for that step.

Should every replica it joined die during that step, it commits the step alone with no contributor: a zero
gradient (the optimizer's step on it alone: decay and momentum), every window of the step given back -- the run
stays consistent and audited, one step without data (not exercised by the tests).

Where the others' step computes longer than the joiner takes to unpack and load the state (tens of milliseconds
for the benchmarks' models), they no longer wait for it at all. It applies to ``ddp`` (the step's only exchange
across the replicas is its gradient average). Not to the local methods (``localsgd``, ``diloco``): their replicas
meet only at the end of a round of ``H`` inner steps, which a returning replica computes like the others -- it
joins at a round boundary, so it enters no exchange across replicas before its first full round, and abstaining
would throw a whole round away; the others wait at that round's end only for what its heal added (the state's
unpack and load). Not yet to ``zero1``, ``demo`` or ``flexdemo`` (their step's exchange is a sharded or compressed
one; they join as before).
"""

from __future__ import annotations

from typing import Any


def async_join_problem(strategy: Any) -> str | None:
    """Why a replica running ``strategy`` cannot join asynchronously (it then computes its first step as before),
    or None where it can (module docstring)."""
    from ..strategies.baselines.ddp import DDP

    if not isinstance(strategy, DDP):
        return f"strategy {strategy.name}: only ddp's step averages one gradient across the replicas"
    if strategy.across != "replicate":
        return "ddp averages inside a replica group only (no average across the replicas to abstain from)"
    if strategy.scaler is not None:
        return "fp16's loss scale decides each round's skip from the replica's own gradient"
    return None


def abstain_micro_batch(strategy: Any) -> None:
    """One micro-batch of an abstaining step: counted in the strategy's open round, nothing computed (the round's
    gradient stays zero; the step's average counts this replica out)."""
    strategy.round.accumulator.add()


__all__ = ["abstain_micro_batch", "async_join_problem"]
