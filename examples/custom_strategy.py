"""A new quietsync strategy in about 100 lines: signSGD with majority vote (Bernstein et al., 2018).

Each worker accumulates its micro-batches, takes the **sign** of its gradient, and the workers add their signs
in one all-reduce of int8 votes (1 byte per parameter instead of 4); every worker then applies the sign of the
vote with its optimizer (plain SGD: θ ← θ − lr·sign(Σᵢ sign(gᵢ))). Importing this file registers it as
``signsgd``, so it is a strategy like the others::

    import quietsync, examples.custom_strategy  # noqa: F401  (registers "signsgd")
    strategy = quietsync.make_strategy("signsgd", model, torch.optim.SGD, lr=1e-3, config={"accumulation": 2})

It is the walkthrough of ``docs/contract.md``: the names a strategy author needs are marked (1)–(15) there and
here. ``tests/test_custom_strategy.py`` checks it against a plain-torch reference of the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quietsync.strategies import Strategy, register
from quietsync.strategies.parts.accumulation import AccumulationConfig, OptimizerRound
from quietsync.strategies.parts.broadcast import broadcast_parameters
from quietsync.strategies.substrates.sharded_optimizer import build_optimizer
from quietsync.validate import check_float


@dataclass
class SignSGDConfig(AccumulationConfig):  # (2) a config dataclass: one docstring under each field
    """Knobs of ``signsgd`` (``accumulation`` comes from :class:`AccumulationConfig`)."""

    min_votes: float = 0.0
    """Apply a coordinate's sign only when |Σ votes| exceeds this fraction of the workers (0: always)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("min_votes", self.min_votes, 0, 1, high_open=True)  # a bad value fails at construction


@register("signsgd", SignSGDConfig)  # (1) a Strategy subclass, registered by name with its config
class SignSGD(Strategy):
    """signSGD with majority vote; see the module docstring."""

    discards_rounds = True  # (13) its step commits a round of local micro-batches it holds
    reshard_refusal = "not written for this example"  # (14) why a checkpoint cannot reshard (None: it can)

    config: SignSGDConfig

    def __init__(self, model: torch.nn.Module, optimizer: Any = torch.optim.SGD, **kwargs: Any) -> None:
        super().__init__(model, optimizer, **kwargs)
        if self.transport.group_size("world") > 127:
            raise ValueError("signsgd adds int8 votes: at most 127 workers")
        self.params = [p for g in self.param_groups for p in g["params"]]
        broadcast_parameters(self.transport, self.params, "world")  # replicas start from rank 0's parameters
        # (12) the torch optimizer that steps this worker's parameters
        self.optimizer = build_optimizer(self.optimizer_factory, self.param_groups, self.optimizer_kwargs)
        # (7) a held part (15: every part is a Part): checkpointed, counted in memory_report(), discarded, closed
        self.round = self.hold("round", OptimizerRound(self.optimizer, self.config.accumulation, self.params))

    def _backward(self, loss: torch.Tensor) -> None:  # (4) where a micro-batch's loss goes
        self.round.backward(loss)  # accumulates loss / accumulation into p.grad

    def _step(self) -> bool:  # (3) after every micro-batch: commit when the round is full
        if not self.round.full:
            return False
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        votes = torch.cat([g.reshape(-1).sign() for g in grads]).to(torch.int8)
        with self.accounting.idle("vote"):  # (10) main-thread time blocked on the network counts as idle
            self.transport.all_reduce(votes, "world", name="all_reduce/votes")  # (11) the one door
        quorum = self.config.min_votes * self.transport.group_size("world")
        decided = torch.where(votes.abs().float() > quorum, votes.sign(), torch.zeros_like(votes)).float()
        with torch.no_grad():
            for g, v in zip(grads, decided.split([g.numel() for g in grads])):
                g.copy_(v.view_as(g))
            for p, g in zip(self.params, grads):
                p.grad = g
        # (9) the lr schedule of this step, applied by the round's LRScaler; the optimizer step counts as compute
        self.round.step(self._lr_scale(self.steps), self.accounting)
        self._commit(extra={"agreeing": int((decided != 0).sum())})  # (8) record the committed step
        return True

    def _state(self) -> dict[str, Any]:  # (6) what a checkpoint keeps beyond the parts
        return {"model": self.module.state_dict()}

    def _load_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])

    # (5) committed_params(): the base yields self.model, right here (the model always holds the committed θ)
