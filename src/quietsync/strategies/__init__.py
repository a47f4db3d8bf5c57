"""Strategies: how and when gradients or parameters cross the network, and when the optimizer runs.

One module per strategy; importing this package imports them all, which registers each under its name
(``quietsync.strategies.available()``). The other modules are **parts** that strategies hold, and register
nothing: ``accounting`` (time and bytes per step), ``lr`` (LR scaling), ``broadcast`` (the initial
broadcast), ``accumulation`` (fixed accumulation), ``sharded_state`` (flat parameters + ZeRO-1 optimizer
shard), ``fsdp_shards`` (FSDP2 parameter sharding inside the node, through the transport); family parts
beside their family: ``overlap`` (acco, dpu, wp), ``decoupled`` (demo, flexdemo), ``dim0_shards``
(flexdemo's flat substrate),
``outer`` (diloco's θ_global, outer optimizer and fragment schedule), ``stages`` (cdp's model cut into
stages). A strategy module never imports another strategy module.
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
