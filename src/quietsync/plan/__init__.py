"""The planner: measure the model, the device and the link, predict every strategy's step time, bytes and memory,
and recommend a strategy and its knobs.

``quietsync.plan(...)`` (this module is callable: it runs :func:`~quietsync.plan.planner.plan`) and ``quietsync
plan`` on the command line. The parts, one job each:

* :mod:`~quietsync.plan.workload` — the parameters' shapes and the micro-batch (from a model, or described);
* :mod:`~quietsync.plan.calibrate` — forward, backward, optimizer and codec times on this device;
* :mod:`~quietsync.plan.probe` and :mod:`~quietsync.plan.fit` — the real links between the workers, alpha-beta;
* :mod:`~quietsync.plan.cluster` — a described cluster (``--what-if``): device FLOP/s, memory, links;
* :mod:`~quietsync.plan.costmodel` — transfers metered like the transport, links, overlap rules as terms;
* :mod:`~quietsync.plan.schedules` — every strategy's communication schedule;
* :mod:`~quietsync.plan.table`, :mod:`~quietsync.plan.candidates`, :mod:`~quietsync.plan.recommend`,
  :mod:`~quietsync.plan.knowledge` — the rows, the tuned knobs, the advice and what is known of loss per token;
* :mod:`~quietsync.plan.plots` — the figure.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .config import PlanConfig
from .costmodel import Comm, ComputeProfile, Links, Schedule
from .planner import PlanResult, plan
from .workload import Workload

__all__ = ["Comm", "ComputeProfile", "Links", "PlanConfig", "PlanResult", "Schedule", "Workload", "plan"]


class _CallableModule(types.ModuleType):
    """``quietsync.plan(...)`` calls :func:`~quietsync.plan.planner.plan`; ``quietsync.plan.X`` stays a module."""

    def __call__(self, *args: Any, **kwargs: Any) -> PlanResult | None:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
