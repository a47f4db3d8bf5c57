"""Strategies: how and when gradients or parameters cross the network, and when the optimizer runs.

``base.py`` holds the contract every strategy keeps (:class:`Strategy`), ``registry.py`` the names and
``declaration.py`` what a strategy declares for the rest of the house (its cost, its planner facts, its policy
under torchft, ...: everything outside this package asks the registry instead of naming a strategy). The rest is
folders, one per family, over three shared layers:

* families, each strategy one module that registers itself under its name, its config and its declaration (the
  family's ``facts.py``, beside its ``cost.py``) when imported (each family's ``__init__`` imports its strategy
  modules and this package imports every family, so ``quietsync.strategies.available()`` lists them all):
  ``baselines/`` (ddp, zero1, fsdp), ``overlap/`` (acco, dpu, wp, with the overlap machinery and the
  estimate), ``decoupled/`` (demo, flexdemo, with their config and round), ``local/`` (localsgd, diloco,
  with the outer loop and the fragments), ``cdp/`` (cdp, with its schedule and loss capture);
* ``parts/``: what any strategy may hold (the :class:`~quietsync.strategies.parts.part.Part` protocol, step
  accounting, lr scaling, the initial broadcast, accumulation);
* ``substrates/``: where parameters, gradients and optimizer state live (the sharded optimizer, the flat
  ZeRO-1 state, dim-0 shards on flat buffers and on FSDP2);
* ``checkpoint/``: checkpoint forms that reshard and the check that all workers saved at one position.

No family imports another (hierarchical DiLoCo builds its inner strategy through the registry); shared
layers register nothing. ``docs/contract.md`` is the guide for a new strategy.
"""

from __future__ import annotations

from . import baselines, cdp, decoupled, local, overlap  # noqa: F401  (each family registers its strategies)
from .base import Strategy
from .config import StrategyConfig
from .parts.accounting import StepMetrics
from .registry import available, get, make_strategy, register

__all__ = ["StepMetrics", "Strategy", "StrategyConfig", "available", "get", "make_strategy", "register"]
