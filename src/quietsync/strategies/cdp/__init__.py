"""Cyclic Data Parallelism (paper 002): the strategy that owns its schedule, the timeline it follows, the loss
capture that lets it run one stage at a time, and the cutting of a model into stages."""
