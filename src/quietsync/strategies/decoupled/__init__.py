"""Decoupled momentum (paper 001): DeMo over plain data parallelism and FlexDeMo over hybrid sharding, with
the config and round they share."""
