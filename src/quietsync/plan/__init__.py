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

import importlib
import sys
import types
from typing import Any

_LAZY = {"Comm": "costmodel", "ComputeProfile": "compute", "Links": "costmodel", "Schedule": "costmodel",
         "PlanConfig": "config", "PlanResult": "planner", "plan": "planner", "Workload": "workload"}
"""Public names and their modules, imported on first use: the strategies' ``cost.py`` modules import
:mod:`~quietsync.plan.costmodel` when the strategies are registered, which must not pull in the planner."""

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _CallableModule(types.ModuleType):
    """``quietsync.plan(...)`` calls :func:`~quietsync.plan.planner.plan`; ``quietsync.plan.X`` stays a module."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from .planner import plan

        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
