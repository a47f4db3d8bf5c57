"""Which strategies run under ``--fault-tolerance torchft``, what each does with a missing replica's share and
what a returning replica takes from a live peer -- stated once, here (docs/faults.md and ``--help`` quote it).

Under torchft a **replica** is a replica group: one node of the topology (``--nodes`` of them, ``W`` workers
each). A strategy runs under torchft when its replicas hold the same model and meet only at commits (a gradient
average, an outer sync, a replicated momentum), so the ones present can commit without the others and a
returning one can take a peer's committed state at a step boundary.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaPolicy:
    """What a strategy does when a replica leaves and when it returns."""

    missing: str
    """What becomes of a missing replica's share: its micro-batches, its residual, its momentum."""
    joining: str
    """What a returning replica takes from the live peer it heals from, and what it starts empty."""
    workers: str = "any"
    """Workers per replica group it runs with: ``any``, or ``one`` (its state is per worker, not per node)."""


DATA = ("the data windows dealt to it since the last commit go back to the stream and are dealt first to the "
        "replicas present (:mod:`quietsync.train.window_dealer`): no window is skipped or trained twice")

POLICIES: dict[str, ReplicaPolicy] = {
    "ddp": ReplicaPolicy(
        missing="the step commits with the gradients of the replicas present, averaged over them (each replica's "
                "step holds its own micro-batches: the global batch shrinks while one is missing); " + DATA,
        joining="the peer's parameters and optimizer state (equal on every replica: exact)"),
    "zero1": ReplicaPolicy(
        missing="inside a replica group its workers shard the optimizer (ZeRO-1 over the group) and the replicas "
                "average each gradient shard: a step commits with the replicas present, averaged over them; " + DATA,
        joining="worker i takes worker i's parameters, optimizer shard and master shard of the peer replica group "
                "(exact)"),
    "localsgd": ReplicaPolicy(
        missing="its local steps since the last average are lost (its parameters never reach the average); the "
                "average is over the replicas present; " + DATA,
        joining="the last averaged parameters as its own, and the peer's optimizer moments (exact with "
                "--average-optimizer-state, else the moments of one replica stand for the mean)",
        workers="one"),
    "diloco": ReplicaPolicy(
        missing="its inner steps since its last sync are lost (its pseudo-gradient never reaches the average); "
                "with error feedback (SparseLoCo, low-bit with --pseudo-grad-error-feedback, a replicator) its "
                "residual -- what it had not yet sent -- is lost with it; the outer step averages the replicas "
                "present; " + DATA,
        joining="theta_global, the outer optimizer's momentum, the fragment schedule and a fragment in flight; its "
                "local parameters start from theta_global (no drift), its residual empty (it owes nothing), its "
                "inner optimizer state the peer's (inner ddp/zero1: worker i from worker i)",
        workers="one (inner local); any (inner ddp, zero1)"),
    "demo": ReplicaPolicy(
        missing="its decoupled momentum -- the part of its gradients it had not yet sent -- is lost with it; the "
                "step averages the parts the replicas present sent; " + DATA,
        joining="the parameters and base-optimizer state (equal on every replica), and an empty decoupled momentum",
        workers="one"),
    "flexdemo": ReplicaPolicy(
        missing="its node's decoupled momentum shards -- what it had not yet sent -- are lost with it; the step "
                "averages the parts the replica groups present sent; " + DATA,
        joining="worker i takes worker i's parameter and base-optimizer shards of the peer replica group, and an "
                "empty decoupled momentum"),
}
"""Strategies supported under ``--fault-tolerance torchft``."""

REFUSALS: dict[str, str] = {
    "acco": "its update of one step is computed while the next step's gradients accumulate (the overlap that hides "
            "the network), so no moment holds a committed state a returning replica could take",
    "dpu": "its update of one step is applied while the next step computes (the delay that hides the network), so "
           "no moment holds a committed state a returning replica could take",
    "wp": "its update of one step is applied while the next step computes on a predicted model, so no moment holds a "
          "committed state a returning replica could take",
    "cdp": "its workers pass every micro-batch's activations and gradients around a ring every time step: a missing "
           "worker stops the ring, so there is no replica the others could go on without",
    "fsdp": "it shards the parameters over the whole world; sharded replicas under torchft are not built yet "
            "(zero1 and flexdemo shard inside a replica group)",
}
"""Strategies refused under ``--fault-tolerance torchft``, and why (one line each)."""

ALTERNATIVE = "use --elastic (torchrun restarts every worker from a checkpoint), or one of " + ", ".join(POLICIES)


def refusal(strategy: str) -> str | None:
    """Why ``strategy`` cannot run under ``--fault-tolerance torchft`` (None: it can)."""
    if strategy in POLICIES:
        return None
    why = REFUSALS.get(strategy, "it is not one of the strategies whose replicas meet only at commits")
    return f"--fault-tolerance torchft does not support --strategy {strategy}: {why}; {ALTERNATIVE}"


def one_worker_only(strategy: str, strategy_config: object) -> bool:
    """Whether ``strategy`` (with this config) runs only with one worker per replica group under torchft."""
    if strategy in ("localsgd", "demo"):
        return True
    return strategy == "diloco" and getattr(strategy_config, "inner", "local") == "local"


SKIPPERS = ("ddp", "zero1")
"""Strategies that keep ``--on-nonfinite skip`` under torchft: their step's first exchange across replicas comes
before any state changes, so a round dropped at the commit vote leaves nothing behind
(:mod:`quietsync.train.replica_nonfinite`)."""


def skip_problem(strategy: str) -> str | None:
    """Why ``--on-nonfinite skip`` cannot run with ``strategy`` under torchft (one line), or None."""
    if strategy in SKIPPERS:
        return None
    why = ("localsgd and diloco take their inner steps alone between commits" if strategy in ("localsgd", "diloco")
           else f"{strategy} folds a round's gradient into its decoupled momentum before the exchange")
    return (f"--on-nonfinite skip is not supported by --strategy {strategy} with --fault-tolerance torchft ({why}: a "
            f"round dropped at the commit vote would leave the other replicas' share of it behind); use stop, or "
            f"{' or '.join(SKIPPERS)}")


__all__ = ["ALTERNATIVE", "DATA", "POLICIES", "REFUSALS", "SKIPPERS", "ReplicaPolicy", "one_worker_only", "refusal",
           "skip_problem"]
