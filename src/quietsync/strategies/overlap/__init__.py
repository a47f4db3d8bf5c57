"""Hiding communication behind computation on a sharded optimizer (papers 000/003): ACCO, DPU and weight
prediction, and the overlap machinery they hold (buffers, the communication worker, hand-over, estimates)."""

from . import acco, dpu, wp  # noqa: F401  (importing a strategy module registers it)
