"""What demo and flexdemo declare beside their code (:mod:`~quietsync.strategies.declaration`): their loss per token
(DeMo's and DeToNATION's papers), their grid of replicators and compressions, their codec for the calibration,
their policy under ``--fault-tolerance torchft`` (a missing replica's decoupled momentum is lost with it), and the
settings whose workers' parameters part (no replication, or not at every step)."""

from __future__ import annotations

import math
from typing import Any

from ...cost.compute import codec_key
from ...topology import Topology
from ..declaration import MISSING_DATA, Declaration, PlanFacts, Prior, ReplicaPolicy, Scale, penalty
from . import cost

SOURCES = {
    "peng2024": "Peng et al., \"DeMo: Decoupled Momentum Optimization\" (arXiv:2411.19870), abstract",
    "from2025": "From et al. 2025, \"FlexDeMo / DeToNATION\" (arXiv:2502.06728), §4 (shared/papers/001)",
}

DEMO_COMPRESSION = 1 / 85
"""DeMo: comparable loss to AdamW-DDP while sending up to 85× less data per GPU (Peng et al., abstract)."""


def decoupled_prior(cfg: Any, scale: Scale) -> Prior:
    """DeMo (and FlexDeMo on its shard): comparable to AdamW up to 85× less data (Peng et al.)."""
    rep = cfg.replicator
    # dct's topk fixes the coefficients per chunk**2 block and compression is then unused (wire/replicators/dct.py)
    c = cfg.topk / cfg.chunk ** 2 if rep == "dct" and cfg.topk else cfg.compression
    if rep in ("full",):
        prior = penalty(-0.01, 0.0, 0.01, "full replication: every momentum element sent, decoupled optimizer "
                        "[peng2024]", "peng2024")
    elif rep == "dct":
        if c >= DEMO_COMPRESSION:
            prior = penalty(-0.01, 0.0, 0.01, f"DCT top-k at {c:.3g} of the gradient's bytes: DeMo reached comparable "
                            "loss to AdamW-DDP sending up to 85× less [peng2024]; FlexDeMo ≈ hybrid-sharded AdamW "
                            "[from2025]", "peng2024", "from2025")
        else:
            doublings = math.log2(DEMO_COMPRESSION / c)
            prior = penalty(0.0, 0.01 * doublings, 0.03 * doublings,
                            f"DCT top-k at {c:.3g}: below the 1/85 DeMo was shown at [peng2024] (assumption: +1% "
                            "per halving of the density, 0 to +3% per halving)", "peng2024")
    elif rep == "random":
        doublings = max(0.0, math.log2(DEMO_COMPRESSION / c))
        prior = penalty(0.0, 0.02 + 0.01 * doublings, 0.1 + 0.03 * doublings,
                        f"random replicator at {c:.3g}: worse than DCT for causal language modeling (OLMo), better "
                        "for T5 [from2025] (figures only; assumption: +2%, up to +10%, more below 1/85)", "from2025")
    elif rep == "striding":
        prior = penalty(0.0, 0.03, 0.15, "striding replicator: unstable or uncompetitive in DeToNATION's runs "
                        "[from2025] (assumption: +3%, up to +15%)", "from2025")
    else:  # none: workers never exchange momentum (local training)
        prior = penalty(0.0, 0.1, 0.5, "no replication: workers train apart (assumption: +10%, up to +50%)")
    if not cfg.sign:
        prior = prior.combine(penalty(0.0, 0.02, 0.1, "without sign: the signed update was clearly better "
                                      "[from2025] (assumption: +2%, up to +10%)", "from2025"))
    if getattr(cfg, "adapt", False):  # demo --adapt: k may shrink to the smallest candidate while the link is slow
        halvings = math.log2(cfg.topk / cfg.topk_candidates()[-1])
        prior = prior.combine(penalty(0.0, 0.0, 0.03 * halvings, f"--adapt: top-k re-picked from the measured link, "
                                      f"down to {halvings:g} halvings of k when the link cannot carry it; the prior "
                                      "is at the k chosen, the interval widened for the smallest (assumption: up to "
                                      "+3% per halving, as below 1/85) [peng2024]", "peng2024"))
    return prior


def codec(cfg: Any) -> str | None:
    """The codec the calibration times for this setting (None: nothing replicated)."""
    if cfg.replicator == "none":
        return None
    return codec_key(cfg.replicator, cfg.compression, cfg.transfer_dtype, cfg.chunk, cfg.topk, cost._base(cfg))


def flexdemo_applies(topo: Topology, stage_counts: tuple[int, ...]) -> str | None:
    if topo.workers_per_node < 2:
        return ("needs more than one worker per node (FlexDeMo shards parameters inside a node and replicates "
                "compressed shards across nodes); with one worker per node it is DeMo")
    return None


def parameters_apart(cfg: Any) -> str | None:
    """Why the workers' parameters part with this setting, or None: only a step that replicates applies the same
    update on every worker; the others apply each worker's own gradient, and what they add stays."""
    if cfg.replicator == "none":
        return "with --replicator none each worker trains its own parameters (nothing is exchanged)"
    if cfg.replicate_every > 1:
        return (f"with --replicate-every {cfg.replicate_every} the steps between replications apply each worker's "
                "own gradient, so the workers' parameters part")
    if cfg.skip_every:
        return (f"with --skip-every {cfg.skip_every} a skipped step applies each worker's own gradient, so the "
                "workers' parameters part")
    return None


SENDS = "sends {sent} per step across nodes instead of {baseline_sent}"

DEMO = Declaration(
    schedule=cost.demo,
    plan=PlanFacts(prior=decoupled_prior, sources=SOURCES,
                   grid=({}, {"compression": 0.00390625}, {"replicator": "random"}),
                   wide=({"compression": 0.0009765625},), advice=SENDS, codec=codec,
                   varying=({"adapt": True, "topk": 128},),  # 128 of a 64x64 chunk: the default 1/32, re-picked
                   calibrate=({"replicator": "dct"}, {"replicator": "random"})),
    faults=ReplicaPolicy(
        missing="its decoupled momentum -- the part of its gradients it had not yet sent -- is lost with it; the "
                "step averages the parts the replicas present sent; " + MISSING_DATA,
        joining="the parameters and base-optimizer state (equal on every replica), and an empty decoupled momentum",
        workers="one", one_worker=True,
        skip_refusal="demo folds a round's gradient into its decoupled momentum before the exchange"),
    apart=parameters_apart,
    order=6)

FLEXDEMO = Declaration(
    schedule=cost.flexdemo,
    plan=PlanFacts(prior=decoupled_prior, sources=SOURCES, wide=({"compression": 0.0009765625},),
                   applies=flexdemo_applies, advice=SENDS, codec=codec),
    faults=ReplicaPolicy(
        missing="its node's decoupled momentum shards -- what it had not yet sent -- are lost with it; the step "
                "averages the parts the replica groups present sent; " + MISSING_DATA,
        joining="worker i takes worker i's parameter and base-optimizer shards of the peer replica group, and an "
                "empty decoupled momentum",
        skip_refusal="flexdemo folds a round's gradient into its decoupled momentum before the exchange"),
    apart=parameters_apart,
    order=7)
