"""One interface for averaging a tensor across a group in what it travels as: :class:`Exchange`.

Every worker of ``group`` holds a flat fp32 tensor ``x`` of the same size (DiLoCo's pseudo-gradient of one
fragment, say); :meth:`Exchange.average` returns the mean over the group of every worker's ``x`` *as it arrived*
(decoded, in fp32), and :meth:`Exchange.payload_bytes` the bytes this worker put into the collective(s). Four
ways, one class each, all through the transport (metered, link-emulated):

* :class:`Dense` — fp32 or bf16 values, one all-reduce (average);
* :class:`Int8` — int8 codes with this worker's scale ``max|x|/127``, all-gathered, decoded and averaged locally;
* :class:`Replicated` — through a replicator (:mod:`~quietsync.wire.replicators`: DCT top-k, random, striding,
  full) with error feedback: ``e ← e + x; q = extract(e); e ← e − decode(q)``, the mean of ``decode(q)``;
* :class:`~quietsync.wire.packed.PackedExchange` — a compression chain (:mod:`~quietsync.wire.compression`:
  low-bit block codes, optionally of a top-k selection, optionally with error feedback), all-gathered, decoded
  and averaged in fp32.

An exchange may keep per-worker state: :attr:`Exchange.residual` (what error feedback still owes, None without
it) and its :meth:`~Exchange.state_dict` (a replicator's counters, a rounding generator). Every worker of the
group calls :meth:`~Exchange.average` in step, with the same ``numel``; which workers form the group is the
transport's business, so a group that changes between calls (the replicas present) fits behind it unchanged.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..transport import Transport, across_replicas
from .replicators import Replicator, Segments


class Exchange(Protocol):
    """Averages a flat fp32 tensor across a group (see the module docstring)."""

    residual: torch.Tensor | None
    """This worker's error-feedback residual (what it still owes the others), None without error feedback."""

    def average(self, x: torch.Tensor) -> torch.Tensor:
        """The mean over the group of every worker's ``x`` as it arrived (fp32, ``x.numel()`` elements)."""
        ...

    def payload_bytes(self) -> int:
        """Bytes this worker puts into the collective(s) of one :meth:`average`."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What this worker's checkpoint keeps of the exchange (its residual included)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...


class Dense:
    """fp32 or bf16 values averaged by one all-reduce."""

    residual = None

    def __init__(self, numel: int, transport: Transport, group: str, dtype: str = "fp32", name: str = "exchange"):
        if dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be fp32 or bf16, got {dtype!r}")
        self.numel, self.transport, self.group, self.dtype, self.name = numel, transport, group, dtype, name

    def average(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 travels as x itself: the in-place all-reduce overwrites the caller's x with the mean
        wire = x if self.dtype == "fp32" else x.to(torch.bfloat16)
        self.transport.all_reduce(wire, self.group, op="avg", name=self.name)
        return wire.float()

    def payload_bytes(self) -> int:
        return self.numel * (4 if self.dtype == "fp32" else 2)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Int8:
    """int8 codes with this worker's scale ``max|x|/127``; all-gathered, decoded and averaged locally."""

    residual = None

    def __init__(self, numel: int, transport: Transport, group: str, name: str = "exchange"):
        self.numel, self.transport, self.group, self.name = numel, transport, group, name

    def average(self, x: torch.Tensor) -> torch.Tensor:
        # one unit across replicas (two gathers whose sizes read the group's): re-run whole if a replica dies in it
        return across_replicas(self.transport, lambda: self._average(x))

    def _average(self, x: torch.Tensor) -> torch.Tensor:
        n = self.transport.group_size(self.group)
        amax = float(x.abs().max()) if x.numel() else 0.0  # max() of an empty tensor raises
        # an all-zero x gets scale 1, not 0: x / scale stays finite (every code is 0 either way)
        scale = torch.tensor([amax / 127 if amax > 0 else 1.0], dtype=torch.float32, device=x.device)
        codes = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        all_codes = torch.empty(n * codes.numel(), dtype=torch.int8, device=x.device)
        all_scales = torch.empty(n, dtype=torch.float32, device=x.device)
        self.transport.all_gather(all_codes, codes, self.group, name=self.name)
        self.transport.all_gather(all_scales, scale, self.group, name=f"{self.name}/scale")
        return (all_codes.view(n, -1).float() * all_scales[:, None]).mean(0)

    def payload_bytes(self) -> int:
        return self.numel + 4

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Replicated:
    """Through a bound replicator with error feedback: ``e ← e + x``, then the replicator extracts, subtracts
    what it sent from ``e`` and returns the mean of every worker's decoded part.

    Args:
        replicator: a replicator bound to the transport and group (:meth:`~Replicator.bind`).
        segments: the shapes of the tensors concatenated in ``x`` (the replicator chunks each on its own).
        device: where the residual lives.
    """

    def __init__(self, replicator: Replicator, segments: Segments, device: torch.device | str = "cpu"):
        self.replicator, self.segments = replicator, segments
        self.residual = torch.zeros(segments.numel, device=device)

    def average(self, x: torch.Tensor) -> torch.Tensor:
        self.residual.add_(x)
        return self.replicator.replicate(self.residual, self.segments)

    def payload_bytes(self) -> int:
        return self.replicator.payload_bytes(self.segments)

    def state_dict(self) -> dict[str, Any]:
        # a copy: average() changes the residual in place
        return {"replicator": self.replicator.state_dict(), "residual": self.residual.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["residual"].numel() != self.residual.numel():
            raise ValueError("checkpoint pseudo-gradient replicator does not match this run's")
        self.replicator.load_state_dict(state["replicator"])
        self.residual.copy_(state["residual"])  # into the live buffer, on its device (checkpoints load on the CPU)


__all__ = ["Dense", "Exchange", "Int8", "Replicated"]
