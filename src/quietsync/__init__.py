"""quietsync: distributed training when the network is the bottleneck.

Hide communication (ACCO, DPU, weight prediction, Cyclic DP) and shrink it (DeMo/FlexDeMo replicators,
Local SGD, DiLoCo) behind one strategy interface, on torch.distributed (gloo on CPU, NCCL on GPU).

    import quietsync
    strategy = quietsync.make_strategy("zero1", model, torch.optim.AdamW, lr=6e-4)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _versions  # noqa: F401  (first: refuses a torch older than the suite runs on, in one line)
from ._versions import __version__

if TYPE_CHECKING:  # what the names below are, for type checkers and readers; loaded on first use
    from . import plan
    from .comm_worker import CommWorker, CommWorkerError
    from .events import ByteMeter, EventRecorder, Span
    from .flat import DTypePolicy, FlatParams
    from .link import LinkModel, parse_links
    from .optim import DecoupledAdamW, DeMoSGD
    from .strategies import StepMetrics, Strategy, StrategyConfig, available, make_strategy
    from .topology import Topology
    from .transport import Transport, Work

_EXPORTS = {
    "CommWorker": "comm_worker", "CommWorkerError": "comm_worker",
    "ByteMeter": "events", "EventRecorder": "events", "Span": "events",
    "DTypePolicy": "flat", "FlatParams": "flat",
    "LinkModel": "link", "parse_links": "link",
    "DecoupledAdamW": "optim", "DeMoSGD": "optim",
    "StepMetrics": "strategies", "Strategy": "strategies", "StrategyConfig": "strategies", "available": "strategies",
    "make_strategy": "strategies",
    "Topology": "topology",
    "Transport": "transport", "Work": "transport",
}
"""Name -> the module (under ``quietsync``) that defines it. Loaded on first use (PEP 562), so ``import quietsync``
and ``import quietsync.topology`` load what they use and nothing above it: not the strategies, not the planner."""


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value
    try:  # a sub-package or module, as an eager package would have it: quietsync.plan, quietsync.train, ...
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":  # the module exists but one of its own imports failed: surface that
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | {"plan"})  # plan: a sub-package in __all__, not in _EXPORTS


__all__ = [
    "ByteMeter", "CommWorker", "CommWorkerError", "DTypePolicy", "DeMoSGD", "DecoupledAdamW", "EventRecorder",
    "FlatParams", "LinkModel", "Span", "StepMetrics", "Strategy", "StrategyConfig", "Topology", "Transport", "Work",
    "__version__", "available", "make_strategy", "parse_links", "plan",
]
