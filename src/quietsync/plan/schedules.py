"""Every strategy's communication schedule, by name: ``schedule(name, workload, topology, config)``.

The schedules live **beside the strategies**, one ``cost.py`` per family folder
(``quietsync/strategies/baselines/cost.py``, ``overlap/cost.py``, ``decoupled/cost.py``, ``local/cost.py``,
``cdp/cost.py``, each with a ``SCHEDULES = {name: function}`` dict; the substrates' and parts' shared costs in
``substrates/cost.py`` and ``parts/cost.py``), so a change to a strategy's communication is made next to its cost
and the tests that hold every schedule's bytes to the transport's meter fail when they drift apart. This module
only collects them: it walks ``quietsync.strategies`` for ``cost`` modules (importing the package registers the
strategies and imports them). A strategy registered without one (your own, say) is not predicted; the tests check
that every strategy quietsync ships has one.

A schedule function takes ``(workload, topology, config)`` — the strategy's own config dataclass — and returns a
:class:`~quietsync.plan.costmodel.Schedule` for worker ``topology.rank``.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import is_dataclass
from typing import Any

from ..topology import Topology
from .costmodel import Schedule
from .workload import Workload


@functools.cache
def schedules() -> dict[str, Callable[..., Schedule]]:
    """Strategy name → its schedule function, from every ``quietsync.strategies.*.cost`` module."""
    from .. import strategies

    found: dict[str, Callable[..., Schedule]] = {}
    for mod in pkgutil.walk_packages(strategies.__path__, prefix=f"{strategies.__name__}."):
        if mod.name.rsplit(".", 1)[-1] != "cost":
            continue
        for name, fn in getattr(importlib.import_module(mod.name), "SCHEDULES", {}).items():
            if name in found:
                raise RuntimeError(f"strategy {name!r} has two schedules ({mod.name} and another cost module)")
            found[name] = fn
    return found


def schedule_function(name: str) -> Callable[..., Schedule]:
    """The schedule function of strategy ``name``."""
    table = schedules()
    if name not in table:
        from ..strategies.registry import available

        if name in available():
            raise ValueError(f"strategy {name!r} has no schedule: the planner cannot predict it (its family needs a "
                             f"cost.py with SCHEDULES[{name!r}])")
        raise ValueError(f"strategy must be one of {', '.join(sorted(table))}, got {name!r}")
    return table[name]


def strategy_config(name: str, config: Any = None) -> Any:
    """The strategy's own config dataclass from a dict of its fields (validated by the strategy's checks)."""
    from ..strategies.registry import get

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
    return schedule_function(name)(workload, topo, strategy_config(name, config))


__all__ = ["schedule", "schedule_function", "schedules", "strategy_config"]
