"""``full``: the whole decoupled momentum, all-reduced (hybrid-sharded AdamW's sync in decoupled form).

``compression`` is ignored (it is ``value_bytes / 4`` by construction: 1 in fp32, 1/2 in bf16, about 1/8
with packed 4-bit codes, which are all-gathered and averaged after decoding).
With decay 0 and no sign, DeMo-SGD over ``full`` is exactly SGD on the all-reduced gradient.
"""

from __future__ import annotations

import torch

from .base import Message, Replicator, Segments


class FullReplicator(Replicator):
    """All-reduce (average) of the complete ``delta`` in the transfer dtype."""

    name = "full"

    def extract(self, delta: torch.Tensor, segments: Segments) -> Message:
        payload, sent = self.encode_values(delta)
        return Message(payload, sent)

    def exchange(self, msg: Message, segments: Segments) -> torch.Tensor:
        if self.lowbit is not None:  # packed codes: all-gathered, decoded, averaged
            return self.average_lowbit(msg.payload, msg.sent.numel(), msg.sent.dtype, "replicate/full")
        self.transport.all_reduce(msg.payload, self.group, op="avg", name="replicate/full")
        return msg.payload.to(msg.sent.dtype)

    def payload_bytes(self, segments: Segments, dtype: torch.dtype = torch.float32) -> int:
        return self.values_payload_bytes(segments.numel)
