"""How a replica that heals receives a live peer's state: over the replicate dimension's own process group,
through quietsync's transport (metered as ``heal/send``/``heal/recv`` on ``replicate``, link-emulated).

torchft calls a :class:`~torchft.checkpointing.transport.CheckpointTransport` inside the quorum, once the new
quorum's process group is connected: the up-to-date replica chosen as the source ``send_checkpoint``s to the
ranks that heal, each of them ``recv_checkpoint``s from its source. :class:`PeerCheckpoint` serialises the state
(``torch.save``; the state is a snapshot taken when the quorum formed, so the source's training may go on),
sends its length, then its bytes. Worker ``i`` of a healing replica group receives from worker ``i`` of the
source (each worker's state is its own: a ZeRO-1 shard, an FSDP shard). A source that dies mid-transfer makes
the receive fail: the quorum is asked again, and another live peer is the source.

torchft's own HTTP transport works too, but talks past the transport (neither metered nor emulated).
"""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import torch
from torchft.checkpointing.transport import CheckpointTransport

from .inject import reached
from .transport import FaultTolerantTransport


def _to_bytes(state: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


class PeerCheckpoint(CheckpointTransport[Any]):
    """A peer's state, sent over the replicate dimension (module docstring).

    Args:
        transport: the replica group worker's transport.
        timeout_s: the transfer waits at most this long (the transport's own collective timeout applies).
    """

    def __init__(self, transport: FaultTolerantTransport, timeout_s: float) -> None:
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.sent_bytes = 0
        """Bytes of state this replica sent to healing peers."""
        self.received_bytes = 0
        """Bytes of state this replica received when it healed."""
        self.receiving = False
        """Whether a receive started and did not complete (its source died mid-transfer)."""

    def metadata(self) -> str:
        return "quietsync-replicas"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        payload = _to_bytes(state_dict)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        for dst in dst_ranks:
            self.transport.heal_transfer(length, int(dst), sending=True)
            reached("heal_send")
            self.transport.heal_transfer(payload, int(dst), sending=True)
            self.sent_bytes += payload.numel()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        self.receiving = True
        length = torch.zeros(1, dtype=torch.int64)
        self.transport.heal_transfer(length, int(src_rank), sending=False)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.transport.heal_transfer(payload, int(src_rank), sending=False)
        self.received_bytes += payload.numel()
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)
        self.receiving = False
        return state

    def disallow_checkpoint(self) -> None:
        """Nothing to hold back: the sent state was a snapshot."""

    def shutdown(self, wait: bool = True) -> None:
        """Nothing runs in the background."""


__all__ = ["PeerCheckpoint"]
