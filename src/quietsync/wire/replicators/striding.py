"""``striding``: every ``s``-th element with a rotating offset -- values only, all-reduce.

Paper 001's Striding replicator: step ``t`` sends positions ``o_t, o_t + s, o_t + 2s, ...`` with
``o_t = (t mod s) + m*s*floor(t / s)`` (mod the buffer size), so the ``m*s`` window is swept in ``s``
steps and then moves on: every element is sent within ``2s`` steps. Like ``random`` it needs no
indices on the wire; unlike it, the pattern is structured (the paper finds it unstable on
language models).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Replicator, Segments
from .random import RandomReplicator


class StridingReplicator(RandomReplicator):
    """Strided positions with a rotating offset; values only; all-reduce (no seed: the pattern is fixed)."""

    name = "striding"
    knobs = Replicator.knobs

    def indices(self, segments: Segments, counter: int, device: torch.device | str = "cpu") -> torch.Tensor:
        n, m = segments.numel, self.count(segments)
        stride = n // m
        offset = (counter % stride + m * stride * (counter // stride)) % n
        return (torch.arange(m, device=device) * stride + offset) % n

    def state_dict(self) -> dict[str, Any]:
        return {"counter": self.counter}
