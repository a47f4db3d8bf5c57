"""quietsync: distributed training when the network is the bottleneck.

Hide communication (ACCO, DPU, weight prediction, Cyclic DP) and shrink it (DeMo/FlexDeMo replicators,
Local SGD, DiLoCo) behind one strategy interface, on torch.distributed (gloo on CPU, NCCL on GPU).

    import quietsync
    strategy = quietsync.make_strategy("zero1", model, torch.optim.AdamW, lr=6e-4)
"""

from __future__ import annotations

__version__ = "0.1.0"

from . import (
    _versions,  # noqa: F401  (first: refuses a torch older than the suite runs on, in one line)
    plan,
)
from .comm_worker import CommWorker, CommWorkerError
from .events import ByteMeter, EventRecorder, Span
from .flat import DTypePolicy, FlatParams
from .link import LinkModel, parse_links
from .optim import DecoupledAdamW, DeMoSGD
from .strategies import StepMetrics, Strategy, StrategyConfig, available, make_strategy
from .topology import Topology
from .transport import Transport, Work

__all__ = [
    "ByteMeter", "CommWorker", "CommWorkerError", "DTypePolicy", "DeMoSGD", "DecoupledAdamW", "EventRecorder",
    "FlatParams", "LinkModel", "Span", "StepMetrics", "Strategy", "StrategyConfig", "Topology", "Transport", "Work",
    "__version__", "available", "make_strategy", "parse_links", "plan",
]
