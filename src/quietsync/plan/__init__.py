"""The planner: measure the model, the device and the link, predict every setting's step time, bytes, memory and
time to a target loss, and recommend a strategy and its knobs by that time.

``quietsync.plan.plan(...)`` in Python (:func:`~quietsync.plan.planner.plan`) and ``quietsync plan`` on the command
line. It predicts in the words of :mod:`quietsync.cost` (each strategy's schedule, registered with the strategy).
The parts, one job each:

* :mod:`~quietsync.plan.calibrate` — forward, backward, optimizer and codec times on this device;
* :mod:`~quietsync.plan.probe` and :mod:`~quietsync.plan.fit` — the real links between the workers, alpha-beta;
* :mod:`~quietsync.plan.cluster` — a described cluster (``--what-if``): device FLOP/s, memory, links;
* :mod:`~quietsync.plan.schedules` — every strategy's communication schedule, by name;
* :mod:`~quietsync.plan.candidates` — the canonical candidate grid (spec strings), also the knob search space;
* :mod:`~quietsync.plan.table` — a row per setting (speed, bytes, memory);
* :mod:`~quietsync.plan.curve_fit`, :mod:`~quietsync.plan.priors`, :mod:`~quietsync.plan.loss_model` — held-out
  curves fitted ``a + b·t^(−c)``, the papers' priors on loss per token, tokens and time to a target;
* :mod:`~quietsync.plan.pilots`, :mod:`~quietsync.plan.pilot_plan` — pilot runs under successive halving, and the
  plan re-scored with them;
* :mod:`~quietsync.plan.objective`, :mod:`~quietsync.plan.recommend` — what is ranked, and the advice;
* :mod:`~quietsync.plan.compare_predict` — ``quietsync compare --predict``;
* :mod:`~quietsync.plan.plots` — the figure.
"""

from .config import PlanConfig
from .planner import plan
from .result import PlanResult

__all__ = ["PlanConfig", "PlanResult", "plan"]
