"""What the baselines declare beside their code (:mod:`~quietsync.strategies.declaration`): ``ddp``, ``zero1`` and
``fsdp`` follow one trajectory (the synchronous baseline the planner measures the others against), their
schedules in :mod:`.cost`, ddp and zero1 under ``--fault-tolerance torchft``."""

from __future__ import annotations

from typing import Any

from ..declaration import EXACT, MISSING_DATA, Declaration, PlanFacts, Prior, ReplicaPolicy, Scale, penalty
from . import cost

SOURCES = {"vogels2019": "Vogels et al. 2019, \"PowerSGD\" (arXiv:1905.13727)"}


def synchronous_prior(cfg: Any, scale: Scale) -> Prior:
    """The baseline's own trajectory; a compressing DDP hook costs a little (fp16/bf16 averages, PowerSGD)."""
    hook = getattr(cfg, "comm_hook", "allreduce")
    if hook in ("fp16", "bf16"):
        return penalty(0.0, 0.0, 0.005, f"{hook} gradient average (assumption: within 0.5%)")
    if hook == "powersgd":
        return penalty(0.0, 0.01, 0.05, f"PowerSGD rank {cfg.powersgd_rank}: matched SGD on image models at rank 2 "
                       "[vogels2019] (assumption for LLMs: +1%, up to +5%)", "vogels2019")
    return EXACT


EXACT_ADVICE = "exact synchronous gradients"

DDP = Declaration(
    schedule=cost.ddp,
    plan=PlanFacts(prior=synchronous_prior, sources=SOURCES, exact=True, baseline=1, advice=EXACT_ADVICE),
    faults=ReplicaPolicy(
        missing="the step commits with the gradients of the replicas present, averaged over them (each replica's "
                "step holds its own micro-batches: the global batch shrinks while one is missing); " + MISSING_DATA,
        joining="the peer's parameters and optimizer state (equal on every replica: exact)",
        skip_refusal=None),
    order=0)

ZERO1 = Declaration(
    schedule=cost.zero1,
    plan=PlanFacts(prior=synchronous_prior, sources=SOURCES, exact=True, baseline=0, advice=EXACT_ADVICE),
    faults=ReplicaPolicy(
        missing="inside a replica group its workers shard the optimizer (ZeRO-1 over the group) and the replicas "
                "average each gradient shard: a step commits with the replicas present, averaged over them; "
                + MISSING_DATA,
        joining="worker i takes worker i's parameters, optimizer shard and master shard of the peer replica group "
                "(exact)",
        skip_refusal=None),
    gpu_precisions=("bf16", "fp16"),
    order=1)

FSDP = Declaration(
    schedule=cost.fsdp,
    plan=PlanFacts(prior=synchronous_prior, sources=SOURCES, exact=True, advice=EXACT_ADVICE),
    faults="it shards the parameters over the whole world; sharded replicas under torchft are not built yet "
           "(zero1 and flexdemo shard inside a replica group)",
    order=2)
