"""The replicator interface: what a decoupled strategy sends across the replicate group.

A replicator (DeToNATION's word) takes the local decoupled momentum ``delta`` of all parameters
of a step -- one flat fp32 buffer laid out by a :class:`Segments` -- and

1. **extracts** a small part ``q`` of it (:meth:`Replicator.extract`, pure tensor math),
2. removes what was sent from the residual: ``delta <- delta - decode(q)`` (error feedback; the
   decoded ``q`` is what actually travels, transfer-dtype rounding included),
3. **exchanges** ``q`` with the replicate group in one collective through the
   :class:`~quietsync.transport.Transport` and returns the decoded average (:meth:`exchange`).

``compression`` means the same for every replicator: bytes one worker puts into the collective
per step divided by the bytes of the full (fp32) gradient. Replicators are therefore compared at
equal bandwidth, as in paper 001. In a replicate group of one worker there is nobody to talk to,
so every replicator hands the whole ``delta`` back (the paper's degenerate case: the base
optimizer on the local gradient).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..codecs import transfer_dtype as _transfer_dtype
from ..transport import Collectives
from ..validate import check_float

__all__ = ["Segments", "Message", "Replicator"]


class Segments:
    """Shapes of the tensors concatenated (in order) into one flat buffer."""

    def __init__(self, shapes: Sequence[Sequence[int]]) -> None:
        self.shapes: tuple[tuple[int, ...], ...] = tuple(tuple(int(d) for d in s) for s in shapes)
        self.sizes: tuple[int, ...] = tuple(math.prod(s) for s in self.shapes)
        self.numel: int = sum(self.sizes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Segments) and other.shapes == self.shapes

    def __hash__(self) -> int:
        return hash(self.shapes)

    def __repr__(self) -> str:
        return f"Segments({len(self.shapes)} tensors, {self.numel} elements)"


@dataclass
class Message:
    """What one worker sends in one step.

    Attributes:
        payload: the tensor that goes into the collective (values, or packed values+indices).
        sent: dense flat buffer of what ``payload`` decodes to (for error feedback).
        meta: whatever the replicator needs to decode the exchanged payload (indices, specs).
    """

    payload: torch.Tensor
    sent: torch.Tensor
    meta: Any = None


class Replicator(ABC):
    """Base class; one subclass per replication scheme.

    Args:
        compression: bytes sent per step / bytes of the full fp32 gradient, in ``(0, 1]``.
        transfer_dtype: dtype values travel in (``fp32``, ``bf16``, ``fp16``).
        transport: the :class:`~quietsync.transport.Transport` (None: a world of one).
        group: the transport group replicated over (``replicate`` for FlexDeMo, ``world`` for DeMo).
    """

    name: ClassVar[str] = ""
    sends_indices: ClassVar[bool] = False
    collective: ClassVar[str] = "all_reduce"
    knobs: ClassVar[tuple[str, ...]] = ("compression", "transfer_dtype", "transport", "group")
    """The keyword arguments of ``__init__`` that :func:`~quietsync.replicators.make_replicator` passes on;
    a subclass with knobs of its own extends this tuple."""

    def __init__(
        self,
        compression: float = 1 / 32,
        transfer_dtype: str | torch.dtype = "fp32",
        transport: Collectives | None = None,
        group: str = "replicate",
    ) -> None:
        check_float("compression", compression, 0, 1, low_open=True)
        self.compression = float(compression)
        self.transfer_dtype = _transfer_dtype(transfer_dtype)
        self.transport = transport
        self.group = group

    # ------------------------------------------------------------------ wiring
    def bind(self, transport: Collectives | None, group: str) -> Replicator:
        """Attach the transport and group name (strategies do this; plain users pass them to __init__)."""
        self.transport, self.group = transport, group
        return self

    @property
    def group_size(self) -> int:
        return 1 if self.transport is None else int(self.transport.group_size(self.group))

    @property
    def value_bytes(self) -> int:
        return torch.empty((), dtype=self.transfer_dtype).element_size()

    # ------------------------------------------------------------------ the step
    def replicate(self, delta: torch.Tensor, segments: Segments) -> torch.Tensor:
        """Extract, apply error feedback to ``delta`` in place, exchange; return the averaged update."""
        if delta.dim() != 1 or delta.numel() != segments.numel:
            raise ValueError(f"delta must be flat with {segments.numel} elements, got shape {tuple(delta.shape)}")
        if self.group_size == 1:
            update = delta.clone()
            delta.zero_()
            return update
        msg = self.extract(delta, segments)
        delta.sub_(msg.sent)
        return self.exchange(msg, segments)

    @abstractmethod
    def extract(self, delta: torch.Tensor, segments: Segments) -> Message:
        """Pick what travels from ``delta`` (not modified). Advances any per-step counter."""

    @abstractmethod
    def exchange(self, msg: Message, segments: Segments) -> torch.Tensor:
        """Run the collective and decode the average of every worker's message (flat, delta's dtype)."""

    @abstractmethod
    def payload_bytes(self, segments: Segments, dtype: torch.dtype = torch.float32) -> int:
        """Bytes this worker puts into the collective per step (the hand computation tests check)."""

    def achieved_compression(self, segments: Segments, dtype: torch.dtype = torch.float32) -> float:
        """:meth:`payload_bytes` / bytes of the full gradient."""
        full = segments.numel * torch.empty((), dtype=dtype).element_size()
        return self.payload_bytes(segments, dtype) / full if full else 0.0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters / seeds needed to resume exactly (empty for stateless replicators)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(compression={self.compression:g}, "
                f"transfer_dtype={self.transfer_dtype}, group={self.group!r})")
