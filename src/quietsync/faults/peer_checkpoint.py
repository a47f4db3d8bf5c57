"""How a replica that heals receives a live peer's state: over the replicate dimension's own process group,
through quietsync's transport (metered as ``heal/send``/``heal/recv`` on ``replicate``, link-emulated).

torchft calls a :class:`~torchft.checkpointing.transport.CheckpointTransport` inside the quorum, once the new
quorum's process group is connected: the up-to-date replica chosen as the source ``send_checkpoint``s to the
ranks that heal, each of them ``recv_checkpoint``s from its source. :class:`PeerCheckpoint` packs the state
(:func:`pack_state`: the tensors' bytes copied side by side into one buffer, the rest pickled around them -- a
memory copy, where ``torch.save`` serialised every tensor and ``torch.load`` parsed it back, ~10 ms each way for
the benchmark's 7.7 MB; the packed state is a snapshot, so the source's training may go on), sends the two
lengths, then the pickled skeleton, then the buffer. Worker ``i`` of a healing replica group receives from worker
``i`` of the source (each worker's state is its own: a ZeRO-1 shard, an FSDP shard). A source that dies
mid-transfer makes the receive fail: the quorum is asked again, and another live peer is the source.

torchft's own HTTP transport works too, but talks past the transport (neither metered nor emulated).
"""

from __future__ import annotations

import io
import pickle
import time
from datetime import timedelta
from typing import Any

import torch
from torchft.checkpointing.transport import CheckpointTransport

from .inject import reached_heal_send
from .transport import FaultTolerantTransport

ALIGN = 16
"""Byte alignment of each tensor in the packed buffer (so that every dtype can be viewed in place)."""


def _raw(obj: Any) -> bool:
    """Whether ``obj`` travels as raw bytes (a dense, strided tensor of a real device; anything else is pickled)."""
    return (type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided
            and not obj.is_quantized and obj.device.type != "meta")


class _Packer(pickle.Pickler):
    """Pickles a state with each tensor replaced by its place in one byte buffer."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[tuple[torch.Tensor, int, int]] = []
        """Each distinct tensor with its offset and length in the buffer."""
        self.places: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.size = 0

    def persistent_id(self, obj: Any) -> Any:  # noqa: D102 - pickle's hook
        if not _raw(obj):
            return None
        t = obj.detach().resolve_conj().resolve_neg()  # lazy conj/neg resolved: the bytes copied must be the values
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride(), str(t.device))
        place = self.places.get(key) if t.numel() else None  # empty tensors may share a data pointer: never merged
        if place is None:  # the same tensor (tied weights) twice is one tensor on the other side, as with torch.save
            place = (len(self.tensors), self.size, t.numel() * t.element_size(), t.dtype, tuple(t.shape),
                     str(t.device))
            self.places[key] = place
            self.tensors.append((t, place[1], place[2]))
            self.size += -(-place[2] // ALIGN) * ALIGN
        return place


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, buffer: torch.Tensor) -> None:
        super().__init__(file)
        self.buffer = buffer
        self.seen: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> torch.Tensor:  # noqa: D102 - pickle's hook
        index, offset, nbytes, dtype, shape, device = pid
        if index not in self.seen:
            view = self.buffer[offset:offset + nbytes].view(dtype).reshape(shape)
            # a storage of its own (a view would keep the whole buffer alive); .to() copies already
            self.seen[index] = view.clone() if device == "cpu" else view.to(device)
        return self.seen[index]


def pack_state(state: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(skeleton, buffer)``: ``state`` pickled with its tensors left out (``skeleton``, bytes as uint8) and the
    tensors' bytes side by side (``buffer``, uint8 on the CPU): one copy of each tensor, no serialisation of its
    data, so a large state costs a memory copy to pack, not a ``torch.save``."""
    file = io.BytesIO()
    packer = _Packer(file)
    packer.dump(state)
    buffer = torch.empty(packer.size, dtype=torch.uint8)
    for t, offset, nbytes in packer.tensors:
        if nbytes:
            # contiguous first: view(uint8) needs the elements in memory order
            buffer[offset:offset + nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    # bytearray: torch.frombuffer warns on read-only bytes
    return torch.frombuffer(bytearray(file.getvalue()), dtype=torch.uint8), buffer


def unpack_state(skeleton: torch.Tensor, buffer: torch.Tensor) -> Any:
    """The state :func:`pack_state` packed: every tensor with its dtype, shape and device, in storage of its own
    (as ``torch.load`` gives them); a tensor packed twice is one tensor."""
    return _Unpacker(io.BytesIO(skeleton.numpy().tobytes()), buffer).load()


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
        self.marks: dict[str, float] = {}
        """Wall-clock marks of the latest transfer: sending ``send_start``, ``serialized``, ``sent``; receiving
        ``recv_start``, ``received`` (the bytes arrived), ``deserialized``."""

    def metadata(self) -> str:
        return "quietsync-replicas"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        self.marks = {"send_start": time.time()}
        skeleton, buffer = pack_state(state_dict)
        self.marks["serialized"] = time.time()
        lengths = torch.tensor([skeleton.numel(), buffer.numel()], dtype=torch.int64)
        for dst in dst_ranks:
            # the lengths first: the receiver sizes its two buffers from them
            self.transport.heal_transfer(lengths, int(dst), sending=True)
            reached_heal_send()
            self.transport.heal_transfer(skeleton, int(dst), sending=True)
            self.transport.heal_transfer(buffer, int(dst), sending=True)
            self.sent_bytes += skeleton.numel() + buffer.numel()
        self.marks["sent"] = time.time()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        self.receiving = True
        self.marks = {"recv_start": time.time()}
        lengths = torch.zeros(2, dtype=torch.int64)
        self.transport.heal_transfer(lengths, int(src_rank), sending=False)
        skeleton = torch.empty(int(lengths[0]), dtype=torch.uint8)
        buffer = torch.empty(int(lengths[1]), dtype=torch.uint8)
        self.transport.heal_transfer(skeleton, int(src_rank), sending=False)
        self.transport.heal_transfer(buffer, int(src_rank), sending=False)
        self.received_bytes += skeleton.numel() + buffer.numel()
        self.marks["received"] = time.time()
        state = unpack_state(skeleton, buffer)
        self.receiving = False
        self.marks["deserialized"] = time.time()
        return state

    def disallow_checkpoint(self) -> None:
        """Nothing to hold back: the sent state was a snapshot."""

    def shutdown(self, wait: bool = True) -> None:
        """Nothing runs in the background."""


__all__ = ["ALIGN", "PeerCheckpoint", "pack_state", "unpack_state"]
