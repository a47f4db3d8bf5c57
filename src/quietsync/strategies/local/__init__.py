"""Infrequent synchronisation (paper 004, DiLoCo): Local SGD / K-batch synchronous SGD, DiLoCo and Streaming
DiLoCo, and the outer loop (θ_global, outer optimizer, fragments, pseudo-gradient exchange)."""

from . import diloco, localsgd  # noqa: F401  (importing a strategy module registers it)
