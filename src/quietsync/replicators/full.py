"""``full``: the whole decoupled momentum, all-reduced (hybrid-sharded AdamW's sync in decoupled form).

``compression`` is ignored (it is ``value_bytes / 4`` by construction: 1 in fp32, 1/2 in bf16).
With decay 0 and no sign, DeMo-SGD over ``full`` is exactly SGD on the all-reduced gradient.
"""

from __future__ import annotations

import torch

from .base import Message, Replicator, Segments


class FullReplicator(Replicator):
    """All-reduce (average) of the complete ``delta`` in the transfer dtype."""

    name = "full"

    def extract(self, delta: torch.Tensor, segments: Segments) -> Message:
        payload = delta.to(self.transfer_dtype).contiguous()
        if payload.data_ptr() == delta.data_ptr():
            payload = payload.clone()
        return Message(payload, payload.to(delta.dtype))

    def exchange(self, msg: Message, segments: Segments) -> torch.Tensor:
        self.transport.all_reduce(msg.payload, self.group, op="avg", name="replicate/full")
        return msg.payload.to(msg.sent.dtype)

    def payload_bytes(self, segments: Segments, dtype: torch.dtype = torch.float32) -> int:
        return segments.numel * self.value_bytes
