"""Decoupled momentum (paper 001): DeMo over plain data parallelism and FlexDeMo over hybrid sharding, with
the config and round they share."""

from . import demo, flexdemo  # noqa: F401  (importing a strategy module registers it)
