"""``none``: nothing crosses the network; every worker applies its own momentum.

Each step hands the whole local ``delta`` to the optimizer and clears it, so with decay ``beta``
the update is the local gradient (times lr) -- independent workers, the "no replication"
baseline of DeToNATION.
"""

from __future__ import annotations

import torch

from .base import Message, Replicator, Segments


class NoReplicator(Replicator):
    """No communication: the update is the local ``delta``."""

    name = "none"
    collective = "none"

    def replicate(self, delta: torch.Tensor, segments: Segments) -> torch.Tensor:
        update = delta.clone()
        delta.zero_()
        return update

    def extract_momentum(self, momentum: torch.Tensor, segments: Segments) -> Message:
        if momentum.dim() != 1 or momentum.numel() != self.momentum_numel(segments):
            return super().extract_momentum(momentum, segments)  # its error names the shape
        return self._keep_all(momentum, segments)

    def extract(self, delta: torch.Tensor, segments: Segments) -> Message:
        # nothing travels; sent is a copy of delta (delta -= sent would zero an alias too), so delta empties
        return Message(delta.new_empty(0), delta.clone())

    def exchange(self, msg: Message, segments: Segments) -> torch.Tensor:
        return msg.sent

    def payload_bytes(self, segments: Segments, dtype: torch.dtype = torch.float32) -> int:
        return 0
