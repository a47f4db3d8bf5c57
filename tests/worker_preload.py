"""What the test workers import, imported once in the forkserver of :mod:`tests.distributed`.

Each worker ``run_ranks`` starts is a fork of one forkserver process per test process, so every module imported
here is imported once per test process instead of once per worker: torch and quietsync (all strategies), the
training loop of ``quietsync train`` with what its workers use (the transformers classes
:mod:`quietsync.models.warm` reads, as the launcher's own forkserver does; tokenizers;
torch.distributed.checkpoint for logical checkpoints; the trace and the Agg plots). A module that is not
installed (the optional ``train`` extra) is left out silently: the workers then import what they need
themselves, as they would without this module.

Nothing here computes: a forked worker must not inherit thread pools (OpenMP, tokenizers' Rust pool) that a
computation in the forkserver would have started.
"""

from __future__ import annotations

import importlib

MODULES = (
    "torch",
    "torch.distributed",
    "quietsync",
    "quietsync.train.loop",
    "quietsync.train.logical_checkpoint",
    "quietsync.train.trace",
    "quietsync.train.export",
    "quietsync.models.warm",
    "quietsync.train.plots",
    "numpy",
    "tokenizers",
    "tqdm.auto",
)
"""Modules imported as they are."""


def _load() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    try:
        from quietsync.train.plots import pyplot

        pyplot()  # matplotlib on the Agg backend, as the workers' plots pick it
    except ImportError:
        pass


_load()
