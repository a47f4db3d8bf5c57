"""The quantize link of a compression chain: a dtype cast (fp32/bf16/fp16) or a low-bit block quantizer.

:class:`Quantize` holds a :class:`~quietsync.wire.codecs.lowbit.BlockQuantizer` and, for stochastic rounding, a
seeded ``torch.Generator`` (its state is checkpointed, so a resumed run draws what the uninterrupted one
would have). :class:`Cast` sends values in a narrower float dtype. Both meet :class:`~.chain.Compressor`:
``encode`` → ``uint8`` payload, ``decode`` ← one payload or a ``(workers, bytes)`` stack.
"""

from __future__ import annotations

from typing import Any

import torch

from ...validate import check_choice, check_int
from ..codecs.lowbit import BlockQuantizer

__all__ = ["CAST_DTYPES", "Cast", "Quantize"]

CAST_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Cast:
    """Values travel as ``dtype`` (``fp32``, ``bf16`` or ``fp16``): round-to-nearest, decoded to fp32."""

    def __init__(self, dtype: str = "fp32") -> None:
        check_choice("dtype", dtype, CAST_DTYPES)
        self.name = dtype
        self.dtype = CAST_DTYPES[dtype]
        self.element_size = torch.empty((), dtype=self.dtype).element_size()

    def __repr__(self) -> str:
        return f"Cast({self.name})"

    def payload_bytes(self, numel: int) -> int:
        check_int("numel", numel, 0)
        return numel * self.element_size

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().reshape(-1).to(self.dtype).contiguous().view(torch.uint8)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        buf = payload.reshape(1, -1) if payload.dim() == 1 else payload
        if buf.shape[1] != self.payload_bytes(numel):
            raise ValueError(f"payload has {buf.shape[1]} bytes, {numel} elements in {self} need "
                             f"{self.payload_bytes(numel)}")
        raw = buf.new_empty(buf.shape)
        raw.copy_(buf)  # rows aligned for the view
        out = raw.view(self.dtype).float()
        return out[0] if payload.dim() == 1 else out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def memory_report(self) -> dict[str, int]:
        return {}


class Quantize:
    """Low-bit block quantization (:class:`~quietsync.wire.codecs.lowbit.BlockQuantizer`) with its own generator.

    Args:
        format: ``fp4``, ``fp4_e3m0``, ``int4`` or ``int2``.
        block: elements per scale.
        scale_dtype: ``bf16`` (default), ``fp16`` or ``fp32``.
        rounding: ``nearest`` (default) or ``stochastic``.
        seed: seeds the generator of stochastic rounding (give each worker its own, e.g. ``seed + rank``).
    """

    def __init__(self, format: str, block: int = 64, scale_dtype: str = "bf16", rounding: str = "nearest",
                 seed: int = 0) -> None:
        self.codec = BlockQuantizer(format, block=block, scale_dtype=scale_dtype, rounding=rounding)
        check_int("seed", seed, 0)
        self.seed = seed
        self.generator: torch.Generator | None = None
        self._loaded: torch.Tensor | None = None  # a checkpointed generator state, applied at first use

    def __repr__(self) -> str:
        return f"Quantize({self.codec!r}, seed={self.seed})"

    @property
    def name(self) -> str:
        return self.codec.format.name

    def _generator(self, device: torch.device) -> torch.Generator | None:
        """The generator of stochastic rounding, created on ``device`` at first use (None with ``nearest``)."""
        if self.codec.rounding != "stochastic":
            return None
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            if self._loaded is None:
                self.generator.manual_seed(self.seed)
            else:
                self.generator.set_state(self._loaded)
                self._loaded = None
        elif self.generator.device != device:
            raise ValueError(f"stochastic rounding draws on {self.generator.device}, the data is on {device}")
        return self.generator

    def payload_bytes(self, numel: int) -> int:
        return self.codec.payload_bytes(numel)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.codec.encode(x, self._generator(x.device))

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return self.codec.decode(payload, numel)

    def state_dict(self) -> dict[str, Any]:
        # not drawn from yet: hand back the loaded state, which a save before first use would otherwise lose
        state = self.generator.get_state() if self.generator is not None else self._loaded
        return {"generator": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # the generator is rebuilt at first use, on the data's device, from the loaded state
        self.generator = None
        self._loaded = state.get("generator")

    def memory_report(self) -> dict[str, int]:
        return {}
