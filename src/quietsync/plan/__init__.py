"""The planner: measure the model, the device and the link, predict every strategy's step time, bytes and memory,
and recommend a strategy and its knobs.

``quietsync.plan.plan(...)`` in Python (:func:`~quietsync.plan.planner.plan`) and ``quietsync plan`` on the command
line. It predicts in the words of :mod:`quietsync.cost` (each strategy's schedule, registered with the strategy).
The parts, one job each:

* :mod:`~quietsync.plan.calibrate` — forward, backward, optimizer and codec times on this device;
* :mod:`~quietsync.plan.probe` and :mod:`~quietsync.plan.fit` — the real links between the workers, alpha-beta;
* :mod:`~quietsync.plan.cluster` — a described cluster (``--what-if``): device FLOP/s, memory, links;
* :mod:`~quietsync.plan.schedules` — every strategy's communication schedule, by name;
* :mod:`~quietsync.plan.table`, :mod:`~quietsync.plan.candidates`, :mod:`~quietsync.plan.recommend`,
  :mod:`~quietsync.plan.knowledge` — the rows, the tuned knobs, the advice and what is known of loss per token;
* :mod:`~quietsync.plan.plots` — the figure.
"""

from .config import PlanConfig
from .planner import plan
from .result import PlanResult

__all__ = ["PlanConfig", "PlanResult", "plan"]
