"""A compression chain: optional selection, then quantization of what was selected, as one packed payload.

:class:`Compressor` is what every link and every chain meets: a flat fp32 tensor in, one ``uint8`` payload
out (:meth:`~Compressor.payload_bytes` long, so the bytes a collective moves are the bytes counted), and back.
:class:`Chain` composes ``select`` (a :class:`~.select.TopK`, or none: every element) with ``quantize`` (a
:class:`~.quantize.Quantize` / :class:`~.quantize.Cast`; default fp32 values).

Payload of a chain with selection: ``[values payload][positions]`` -- the quantized values of all chunks,
then the positions (``position_dtype`` bytes each); without selection it is the quantize link's payload.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from .quantize import Cast
from .select import TopK

__all__ = ["Compressor", "Chain"]


@runtime_checkable
class Compressor(Protocol):
    """Flat fp32 tensor ↔ one ``uint8`` payload (see the module docstring)."""

    def payload_bytes(self, numel: int) -> int:
        """Bytes of the payload of a tensor of ``numel`` elements."""
        ...

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The ``uint8`` payload of flat ``x``."""
        ...

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """Dense fp32 ``(numel,)`` of one payload, or ``(workers, numel)`` of a ``(workers, bytes)`` stack."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def memory_report(self) -> dict[str, int]: ...


class Chain:
    """``select`` then ``quantize`` (module docstring).

    Args:
        select: a :class:`~.select.TopK`, or None to send every element.
        quantize: what the (selected) values travel as: a :class:`~.quantize.Quantize`, a
            :class:`~.quantize.Cast`, or None for fp32.
    """

    def __init__(self, select: TopK | None = None, quantize: Compressor | None = None) -> None:
        self.select = select
        self.quantize: Compressor = quantize if quantize is not None else Cast("fp32")

    def __repr__(self) -> str:
        return f"Chain(select={self.select!r}, quantize={self.quantize!r})"

    def payload_bytes(self, numel: int) -> int:
        if self.select is None:
            return self.quantize.payload_bytes(numel)
        return self.quantize.payload_bytes(self.select.selected(numel)) + self.select.position_bytes(numel)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.select is None:
            return self.quantize.encode(x)
        values, positions = self.select.select(x)
        return torch.cat([self.quantize.encode(values), positions.reshape(-1).view(torch.uint8)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        if self.select is None:
            return self.quantize.decode(payload, numel)
        buf = payload.reshape(1, -1) if payload.dim() == 1 else payload  # one payload: a stack of one
        if buf.shape[1] != self.payload_bytes(numel):
            raise ValueError(f"payload has {buf.shape[1]} bytes, {numel} elements in {self} need "
                             f"{self.payload_bytes(numel)}")
        m = self.select.selected(numel)
        vb = self.quantize.payload_bytes(m)
        values = self.quantize.decode(buf[:, :vb], m).reshape(buf.shape[0], m)
        raw = buf.new_empty(buf.shape[0], buf.shape[1] - vb)
        raw.copy_(buf[:, vb:])  # rows aligned for the view
        positions = raw.view(self.select.position_dtype)
        out = self.select.scatter(values, positions, numel)
        return out[0] if payload.dim() == 1 else out

    def state_dict(self) -> dict[str, Any]:
        return {"quantize": self.quantize.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.quantize.load_state_dict(state["quantize"])

    def memory_report(self) -> dict[str, int]:
        return self.quantize.memory_report()
