"""A new quietsync strategy in under 90 lines: signSGD with majority vote (Bernstein et al., 2018).

Each worker accumulates its micro-batches, takes the **sign** of its gradient, and the workers add their signs
in one all-reduce of int8 votes (1 byte per parameter instead of 4); every worker then applies the sign of the
vote with its optimizer (plain SGD: θ ← θ − lr·sign(Σᵢ sign(gᵢ))). Importing this file registers it as
``signsgd``, so it is a strategy like the others::

    import quietsync, examples.custom_strategy  # noqa: F401  (registers "signsgd")
    strategy = quietsync.make_strategy("signsgd", model, torch.optim.SGD, lr=1e-3, config={"accumulation": 2})

It writes only its recurrence: the ``Replicated`` substrate it holds broadcasts the parameters, builds the
optimizer, runs the round of accumulation, unscales fp16 gradients (an overflow on any worker drops the round on
every worker), clips the committed update to ``max_grad_norm`` and checkpoints — in a form that reshards. And it
declares what the rest must know of it (``FACTS``): its cost, its loss prior for ``quietsync plan``, its policy
under ``--fault-tolerance torchft``. It is the walkthrough of ``docs/contract.md``: the names an author needs are
marked (1)–(20) there and here. ``tests/test_custom_strategy.py`` checks it against a plain-torch reference of the
rule; ``tests/test_custom_strategy_declared.py`` plans it, runs it under torchft and lists it in the GPU check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quietsync.strategies import Strategy, register
from quietsync.strategies.declaration import Declaration, PlanFacts, ReplicaPolicy, penalty
from quietsync.strategies.parts.accumulation import AccumulationConfig
from quietsync.strategies.substrates.cost import replicated_cost
from quietsync.strategies.substrates.replicated import Replicated


@dataclass
class SignSGDConfig(AccumulationConfig):  # (3) a config dataclass: one docstring under each field
    """Knobs of ``signsgd`` (``accumulation`` comes from :class:`AccumulationConfig`)."""

    min_votes: float = 0.0
    """Apply a coordinate's sign only when |Σ votes| exceeds this fraction of the workers (0: always)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.min_votes < 1:  # a bad value fails at construction, naming the field
            raise ValueError(f"min_votes must be in [0, 1), got {self.min_votes!r}")


def prior(config: SignSGDConfig, scale: Any) -> Any:  # (19) its loss per token against DDP's, with its source
    return penalty(0.0, 0.05, 0.2, "signSGD-MV was shown on ImageNet/ResNet-50 in figures [bernstein2019], not on "
                   "language models (assumption: +5%, up to +20%)", "bernstein2019")


FACTS = Declaration(  # (16) what the rest must know of it: (17) its cost, (18) the planner's facts, (20) torchft's
    schedule=lambda w, topo, cfg: replicated_cost(w, topo, cfg, "signsgd", element_bytes=1),  # int8 votes
    plan=PlanFacts(prior=prior, sources={"bernstein2019": "Bernstein et al. 2019, \"signSGD with Majority Vote is "
                   "Communication Efficient and Fault Tolerant\" (arXiv:1810.05291)"},
                   advice="sends {sent} per step: one int8 vote per parameter"),
    faults=ReplicaPolicy(missing="the step's vote is that of the replicas present", workers="one", one_worker=True,
                         joining="the peer's parameters and optimizer state (equal on every replica: exact)"))


@register("signsgd", SignSGDConfig, facts=FACTS)  # (1) a Strategy subclass, (2) registered with its config
class SignSGD(Strategy):
    """signSGD with majority vote; see the module docstring."""

    reshard_refusal = None  # (7) its checkpoint reshards: the substrate's logical form (None: no refusal)

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.SGD, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        if self.world_size > 127:  # (8) the number of workers
            raise ValueError("signsgd adds int8 votes: at most 127 workers")
        # (4) the substrate of a replicated strategy, (5) held: checkpointed, given each loss, closed with it
        self.replicas = self.hold("replicas", Replicated(self))

    def _step(self) -> bool:  # (6) after every micro-batch: commit when the round is full
        grads = self.replicas.gradient()  # (9) the round's gradient (None: not full yet, or dropped by fp16)
        if grads is None:
            return False
        votes = torch.cat([g.reshape(-1).sign() for g in grads]).to(torch.int8)
        with self.accounting.idle("vote"):  # (10) (11) main-thread time blocked on the network is idle time
            self.transport.all_reduce(votes, "world", name="all_reduce/votes")  # (12) (13) the one door
        quorum = self.config.min_votes * self.world_size  # (14) the strategy's config
        decided = torch.where(votes.abs().float() > quorum, votes.sign(), torch.zeros_like(votes)).float()
        torch._foreach_copy_(grads, [v.view_as(g) for g, v in zip(grads, decided.split([g.numel() for g in grads]))])
        # (15) clip the update to max_grad_norm, step the optimizer at the scheduled lr, record the step
        return self.replicas.commit(extra={"agreeing": int((decided != 0).sum())})
