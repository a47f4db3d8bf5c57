"""Cyclic Data Parallelism (paper 002): the strategy that owns its schedule, the timeline it follows, the loss
capture that lets it run one stage at a time (the cutting of a model into stages is a view of the model:
:mod:`quietsync.models.stages`)."""

from . import cdp  # noqa: F401  (importing a strategy module registers it)
