"""The cost vocabulary: what a strategy's step moves over which link, and how long it takes.

Every strategy family writes its schedule in these words, beside the strategy (``strategies/<family>/cost.py``),
and the planner (:mod:`quietsync.plan`) evaluates them. The parts, one job each:

* :mod:`~quietsync.cost.costmodel` — transfers metered like the transport (:class:`Comm`), links, the
  evaluation context and the evaluated :class:`Cost`;
* :mod:`~quietsync.cost.terms` — the overlap rules as composable terms of a step's timeline;
* :mod:`~quietsync.cost.schedule` — a strategy's step: transfers, timeline, memory (:class:`Schedule`);
* :mod:`~quietsync.cost.workload` — the parameters' shapes and the micro-batch (from a model, or described);
* :mod:`~quietsync.cost.compute` — what the computation of a step costs on one worker (:class:`ComputeProfile`).
"""

from .compute import ComputeProfile
from .costmodel import Comm, Cost, Ctx, Links
from .schedule import Schedule
from .workload import Workload

__all__ = ["Comm", "ComputeProfile", "Cost", "Ctx", "Links", "Schedule", "Workload"]
