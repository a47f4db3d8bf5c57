"""Strategies: how and when gradients or parameters cross the network, and when the optimizer runs.

``base.py`` holds the contract every strategy keeps (:class:`Strategy`) and ``registry.py`` the names. The rest
is folders, one per family, over three shared layers:

* families, each strategy one module that registers itself under its name when imported (this package imports
  every module below it, so ``quietsync.strategies.available()`` lists them all):
  ``baselines/`` (ddp, zero1, fsdp), ``overlap/`` (acco, dpu, wp, with the overlap machinery and the
  estimate), ``decoupled/`` (demo, flexdemo, with their config and round), ``local/`` (localsgd, diloco,
  with the outer loop and the fragments), ``cdp/`` (cdp, with its schedule, loss capture and stage cutting);
* ``parts/``: what any strategy may hold (the :class:`~quietsync.strategies.parts.part.Part` protocol, step
  accounting, lr scaling, the initial broadcast, accumulation);
* ``substrates/``: where parameters, gradients and optimizer state live (the sharded optimizer, the flat
  ZeRO-1 state, dim-0 shards on flat buffers and on FSDP2);
* ``checkpoint/``: checkpoint forms that reshard and the check that all workers saved at one position.

No family imports another (hierarchical DiLoCo builds its inner strategy through the registry); shared
layers register nothing. ``docs/contract.md`` is the guide for a new strategy.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Strategy, StrategyConfig
from .parts.accounting import StepMetrics
from .registry import available, get, make_strategy, register

for _mod in pkgutil.walk_packages(__path__, prefix=f"{__name__}."):
    if not _mod.name.rsplit(".", 1)[-1].startswith("_"):
        importlib.import_module(_mod.name)  # importing a strategy module registers it

__all__ = ["StepMetrics", "Strategy", "StrategyConfig", "available", "get", "make_strategy", "register"]
