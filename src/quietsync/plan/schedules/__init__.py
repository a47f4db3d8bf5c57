"""Every strategy's communication schedule, by name: ``schedule(name, workload, topology, config)``.

One function per strategy, grouped by family like the strategies themselves (baselines, overlap, decoupled,
local, cdp), each written from its strategy's docstring and code: which collectives, of what size, on which
group, at which steps, and what they overlap with. The tests run every strategy and check that the bytes these
functions predict per step equal the transport's meter exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import is_dataclass
from typing import Any

from ...topology import Topology
from ..costmodel import Schedule
from ..workload import Workload
from .baselines import ddp, fsdp, zero1
from .cdp import cdp
from .decoupled import demo, flexdemo
from .local import diloco, localsgd
from .overlap import acco, dpu, wp

SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "ddp": ddp, "zero1": zero1, "fsdp": fsdp,
    "acco": acco, "dpu": dpu, "wp": wp,
    "demo": demo, "flexdemo": flexdemo,
    "localsgd": localsgd, "diloco": diloco,
    "cdp": cdp,
}
"""Strategy name → its schedule function ``f(workload, topology, config) -> Schedule``."""


def strategy_config(name: str, config: Any = None) -> Any:
    """The strategy's own config dataclass from a dict of its fields (validated by the strategy's checks)."""
    from ...strategies.registry import get

    _, cls = get(name)
    if config is None:
        return cls()
    if is_dataclass(config) and isinstance(config, cls):
        return config
    if isinstance(config, dict):
        return cls(**config)
    raise TypeError(f"config must be a {cls.__name__} or a dict of its fields, got {type(config).__name__}")


def schedule(name: str, workload: Workload, topo: Topology, config: Any = None) -> Schedule:
    """The schedule of strategy ``name`` with ``config`` (its config dataclass or a dict of fields) for worker
    ``topo.rank`` of ``topo``."""
    if name not in SCHEDULES:
        raise ValueError(f"strategy must be one of {', '.join(sorted(SCHEDULES))}, got {name!r}")
    return SCHEDULES[name](workload, topo, strategy_config(name, config))


__all__ = ["SCHEDULES", "schedule", "strategy_config"]
