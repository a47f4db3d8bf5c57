"""Imported by the local workers' forkserver before it forks them, for a job on a pretrained model: the
transformers classes its workers' model and tokenizer need.

``quietsync train --nproc N`` forks its workers from one forkserver (:mod:`quietsync.cli.launch`). transformers
loads a class's module when the name is first read, and a model class pulls in most of transformers: about
4 CPU-seconds per process. Read here once, in the forkserver, they are inherited by every worker instead of
imported N times (a preset's job needs none of them: :mod:`quietsync.models.gpt_neo`). A name transformers
lacks (or transformers not installed) is skipped: the workers then import what they need themselves.

Nothing here computes: a forked worker must not inherit thread pools (OpenMP, tokenizers' Rust pool) that a
computation in the forkserver would have started.
"""

from __future__ import annotations

import importlib

CLASSES = (
    ("transformers", "GPTNeoConfig"),
    ("transformers", "GPTNeoForCausalLM"),
    ("transformers", "AutoModelForCausalLM"),
    ("transformers", "PreTrainedTokenizerFast"),
)
"""``(module, name)`` read once: the loader of a model folder, the GPT-Neo classes, the exported tokenizer."""


def load() -> None:
    """Read every name of :data:`CLASSES`; skip what cannot be loaded."""
    for module, name in CLASSES:
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            pass


load()
