"""Every strategy's communication schedule, by name: ``schedule(name, workload, topology, config)``.

The schedules live **beside the strategies**, one ``cost.py`` per family folder
(``quietsync/strategies/baselines/cost.py``, ``overlap/cost.py``, ``decoupled/cost.py``, ``local/cost.py``,
``cdp/cost.py``; the substrates' and parts' shared costs in ``substrates/cost.py`` and ``parts/cost.py``), and
each strategy registers its own (``@register(name, Config, schedule=cost.name)``), so a change to a strategy's
communication is made next to its cost and the tests that hold every schedule's bytes to the transport's meter
fail when they drift apart. A strategy registered without one (your own, say) is not predicted; the tests check
that every strategy quietsync ships has one.

A schedule function takes ``(workload, topology, config)`` — the strategy's own config dataclass — and returns a
:class:`~quietsync.cost.schedule.Schedule` for worker ``topology.rank``.
"""

from __future__ import annotations

from typing import Any

from ..cost.schedule import Schedule
from ..cost.workload import Workload
from ..strategies.registry import schedule_of, schedules, strategy_config
from ..topology import Topology


def schedule(name: str, workload: Workload, topo: Topology, config: Any = None) -> Schedule:
    """The schedule of strategy ``name`` with ``config`` (its config dataclass or a dict of fields) for worker
    ``topo.rank`` of ``topo``."""
    return schedule_of(name)(workload, topo, strategy_config(name, config))


__all__ = ["schedule", "schedule_of", "schedules", "strategy_config"]
