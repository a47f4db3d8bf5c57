"""What a replica that heals takes from a live peer's strategy, and what it starts empty.

The source sends its strategy's :meth:`~quietsync.strategies.base.Strategy.state_dict` as it stands at a round
boundary (right after a commit: no open round). The healing replica loads it without the cross-worker position
check (the quorum already placed both at the same commit), keeps its own micro-batch counter, drops any gradient
it holds, and then applies the joining rule of :mod:`~quietsync.faults.support`, the same rule a checkpoint
resharded onto more workers follows (:mod:`~quietsync.strategies.checkpoint.replicas`): what a replica owes the
others -- error-feedback residuals, decoupled momentum -- starts empty, and local parameters that drift between
syncs start from the agreed ones.
"""

from __future__ import annotations

from typing import Any

import torch

from ..strategies import Strategy


def heal_state(strategy: Strategy) -> dict[str, Any]:
    """What a healing replica receives of this replica's strategy (a round boundary's full state)."""
    return strategy.state_dict()


def _zero_decoupled_momentum(strategy: Any) -> None:
    """δ = 0: every decoupled momentum buffer of the strategy's decoupled optimizer."""
    with torch.no_grad():
        for state in strategy.optimizer.state.values():
            delta = state.get("delta")
            if isinstance(delta, torch.Tensor):
                delta.zero_()


def _from_global(strategy: Any) -> None:
    """diloco: local parameters from θ_global, residuals (``zero`` slots) empty."""
    outer = strategy.outer
    with torch.no_grad():
        for tensor, rule in outer.worker_slots().values():
            if rule == "zero":
                tensor.zero_()
    outer.start_from_global()


def _from_average(strategy: Any) -> None:
    """localsgd: local parameters from the last average."""
    with torch.no_grad():
        torch._foreach_copy_([p.data for p in strategy.params], strategy.synced)


JOINING = {"localsgd": _from_average, "diloco": _from_global, "demo": _zero_decoupled_momentum,
           "flexdemo": _zero_decoupled_momentum}
"""The joining rule per strategy, where it is more than the peer's state (ddp, zero1: exactly the peer's)."""


def load_heal_state(strategy: Strategy, state: dict[str, Any]) -> None:
    """Take a live peer's strategy state (module docstring)."""
    own = strategy.micro_batches
    strategy.load_state_dict(state, check_positions=False)
    strategy.micro_batches = own
    with torch.no_grad():
        for p in strategy.module.parameters():
            p.grad = None if p.grad is None else p.grad.zero_()
    rule = JOINING.get(strategy.name)
    if rule is not None:
        rule(strategy)


__all__ = ["JOINING", "heal_state", "load_heal_state"]
