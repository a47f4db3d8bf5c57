"""Which strategies run under ``--fault-tolerance torchft``, what each does with a missing replica's share and
what a returning replica takes from a live peer -- as each strategy declares it beside its code (the ``faults``
of its :class:`~quietsync.strategies.declaration.Declaration`: a
:class:`~quietsync.strategies.declaration.ReplicaPolicy`, or the one-line reason it is refused); this module asks
the registry and words the refusals (docs/faults.md and ``--help`` quote them).

Under torchft a **replica** is a replica group: one node of the topology (``--nodes`` of them, ``W`` workers
each). A strategy runs under torchft when its replicas hold the same model and meet only at commits (a gradient
average, an outer sync, a replicated momentum), so the ones present can commit without the others and a
returning one can take a peer's committed state at a step boundary.
"""

from __future__ import annotations

from typing import Any

from ..strategies.declaration import MISSING_DATA, ReplicaPolicy
from ..strategies.registry import declaration, ordered

DATA = MISSING_DATA
"""What becomes of a missing replica's data windows, whatever the strategy."""


def policies() -> dict[str, ReplicaPolicy]:
    """Strategy → its policy, for every registered strategy supported under ``--fault-tolerance torchft``."""
    return {n: f for n in ordered() if isinstance(f := declaration(n).faults, ReplicaPolicy)}


def refusals() -> dict[str, str]:
    """Strategy → why it is refused under ``--fault-tolerance torchft`` (one line), for those that say why."""
    return {n: f for n in ordered() if isinstance(f := declaration(n).faults, str)}


def alternative() -> str:
    """What a refused strategy's user may do instead."""
    return "use --elastic (torchrun restarts every worker from a checkpoint), or one of " + ", ".join(policies())


def refusal(strategy: str, facts: Any = None) -> str | None:
    """Why ``strategy`` cannot run under ``--fault-tolerance torchft`` (None: it can); ``facts``: its declared
    ``faults``, where the caller has them (else asked of the registry)."""
    facts = declaration(strategy).faults if facts is None else facts
    if isinstance(facts, ReplicaPolicy):
        return None
    why = facts or "it is not one of the strategies whose replicas meet only at commits"
    return f"--fault-tolerance torchft does not support --strategy {strategy}: {why}; {alternative()}"


def one_worker_only(strategy: str, strategy_config: Any) -> bool:
    """Whether ``strategy`` (with this config) runs only with one worker per replica group under torchft."""
    facts = declaration(strategy).faults
    return isinstance(facts, ReplicaPolicy) and facts.runs_one_worker(strategy_config)


def skip_problem(strategy: str, facts: Any = None) -> str | None:
    """Why ``--on-nonfinite skip`` cannot run with ``strategy`` under torchft (one line), or None: a strategy keeps
    it when its step's first exchange across replicas comes before any state changes, so a round dropped at the
    commit vote leaves nothing behind (:mod:`quietsync.train.replica_nonfinite`). ``facts`` as :func:`refusal`'s."""
    facts = declaration(strategy).faults if facts is None else facts
    why = facts.skip_refusal if isinstance(facts, ReplicaPolicy) else "it is not supported under torchft"
    if why is None:
        return None
    skippers = [n for n, p in policies().items() if p.skip_refusal is None]
    return (f"--on-nonfinite skip is not supported by --strategy {strategy} with --fault-tolerance torchft ({why}: a "
            f"round dropped at the commit vote would leave the other replicas' share of it behind); use stop, or "
            f"{' or '.join(skippers)}")


__all__ = ["DATA", "ReplicaPolicy", "alternative", "one_worker_only", "policies", "refusal",
           "refusals", "skip_problem"]
