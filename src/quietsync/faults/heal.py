"""What a replica that heals takes from a live peer's strategy, and what it starts empty.

The source sends its strategy's :meth:`~quietsync.strategies.base.Strategy.state_dict` as it stands at a round
boundary (right after a commit: no open round). The healing replica loads it without the cross-worker position
check (the quorum already placed both at the same commit), keeps its own micro-batch counter, drops any gradient
it holds, and then has the strategy :meth:`~quietsync.strategies.base.Strategy.rejoin`: each strategy applies
its own joining rule, the one a checkpoint resharded onto more workers follows
(:mod:`~quietsync.strategies.checkpoint.replicas`): what a replica owes the others -- error-feedback residuals,
decoupled momentum -- starts empty, and local parameters that drift between syncs start from the agreed ones
(its declared :class:`~quietsync.strategies.declaration.ReplicaPolicy` says so in words).
"""

from __future__ import annotations

from typing import Any

import torch

from ..strategies import Strategy


def heal_state(strategy: Strategy) -> dict[str, Any]:
    """What a healing replica receives of this replica's strategy (a round boundary's full state)."""
    return strategy.state_dict()


def load_heal_state(strategy: Strategy, state: dict[str, Any]) -> None:
    """Take a live peer's strategy state (module docstring)."""
    own = strategy.micro_batches
    strategy.load_state_dict(state, check_positions=False)
    strategy.micro_batches = own
    with torch.no_grad():
        for p in strategy.module.parameters():
            # zeroed in place, not dropped: an asynchronous joiner enters its first average with these zeros
            p.grad = None if p.grad is None else p.grad.zero_()
    strategy.rejoin()


__all__ = ["heal_state", "load_heal_state"]
