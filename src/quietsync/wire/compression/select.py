"""The select link of a compression chain: chunk-wise top-k.

A flat tensor of ``numel`` elements is cut into chunks of ``chunk`` elements; with ``sizes`` (the lengths of
the tensors concatenated into the flat buffer, e.g. one fragment's parameters) chunks never cross a tensor
boundary: each tensor is cut on its own and its last chunk zero-padded, as SparseLoCo and DeMo chunk every
parameter separately. In every chunk the ``k = clamp(round(density·chunk), 1, chunk)`` entries of largest
magnitude are kept. What travels per chunk is the ``k`` values (through the chain's quantize link) and their
``k`` positions inside the chunk, in the smallest integer dtype that holds ``chunk − 1``
(:func:`quietsync.wire.codecs.topk.index_dtype`: ``uint8`` up to 256, ``int16`` up to 32768). Values are laid out
chunk after chunk, ``k`` each, so a quantizer with ``block = k`` gives every chunk a scale of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...validate import check_float, check_int
from ..codecs.topk import index_dtype, topk_positions

__all__ = ["TopK"]


class TopK:
    """Chunk-wise top-k selection (module docstring).

    Args:
        chunk: elements per chunk.
        density: fraction of each chunk kept, in ``(0, 1]`` (``k = clamp(round(density·chunk), 1, chunk)``).
        sizes: lengths of the tensors making up the flat buffers this selector sees (chunks stay inside each);
            None: the flat buffer is one tensor.
    """

    def __init__(self, chunk: int = 64, density: float = 1 / 32, sizes: Sequence[int] | None = None) -> None:
        check_int("chunk", chunk, 1)
        check_float("density", density, 0, 1, low_open=True)
        self.chunk = chunk
        self.density = float(density)
        self.k = min(chunk, max(1, round(density * chunk)))
        self.position_dtype = index_dtype(chunk)
        self.position_size = torch.empty((), dtype=self.position_dtype).element_size()
        self.sizes = None if sizes is None else tuple(int(s) for s in sizes)
        if self.sizes is not None and any(s < 0 for s in self.sizes):
            raise ValueError(f"sizes must be >= 0, got {self.sizes}")

    def __repr__(self) -> str:
        return f"TopK(chunk={self.chunk}, k={self.k})"

    def _sizes(self, numel: int) -> tuple[int, ...]:
        if self.sizes is None:
            return (numel,)
        if sum(self.sizes) != numel:
            raise ValueError(f"a buffer of {numel} elements, this selector's tensors hold {sum(self.sizes)}")
        return self.sizes

    def chunks(self, numel: int) -> int:
        """Chunks of a flat buffer of ``numel`` elements."""
        return sum(-(-s // self.chunk) for s in self._sizes(numel))

    def selected(self, numel: int) -> int:
        """How many values a buffer of ``numel`` elements sends."""
        return self.chunks(numel) * self.k

    def position_bytes(self, numel: int) -> int:
        return self.selected(numel) * self.position_size

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` as ``(..., chunks, chunk)``: every tensor zero-padded to whole chunks."""
        sizes = self._sizes(flat.shape[-1])
        if len(sizes) == 1 and sizes[0] % self.chunk == 0:
            return flat.reshape(*flat.shape[:-1], -1, self.chunk)  # one tensor of whole chunks: a view, no copy
        pieces = []
        for part in flat.split(list(sizes), dim=-1):
            pad = -part.shape[-1] % self.chunk
            pieces.append(torch.nn.functional.pad(part, (0, pad)) if pad else part)
        return torch.cat(pieces, dim=-1).reshape(*flat.shape[:-1], -1, self.chunk)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, positions)`` of flat ``x``: values fp32 ``(chunks·k,)`` chunk by chunk, positions
        ``(chunks, k)`` inside each chunk (``position_dtype``)."""
        rows = self._padded(x.detach().reshape(-1).float())
        pos = topk_positions(rows, self.k)
        return torch.gather(rows, 1, pos).reshape(-1), pos.to(self.position_dtype)

    def scatter(self, values: torch.Tensor, positions: torch.Tensor, numel: int) -> torch.Tensor:
        """Dense ``(..., numel)`` fp32 with ``values`` (``(..., chunks·k)``) at ``positions``
        (``(..., chunks·k)`` or ``(..., chunks, k)``), zeros elsewhere."""
        lead = values.shape[:-1]
        nc = self.chunks(numel)
        pos = positions.reshape(*lead, nc, self.k).long()  # scatter_ takes int64 indices
        out = torch.zeros(*lead, nc, self.chunk, dtype=torch.float32, device=values.device)
        out.scatter_(-1, pos, values.reshape(*lead, nc, self.k).float())
        out = out.reshape(*lead, nc * self.chunk)
        sizes = self._sizes(numel)
        if len(sizes) == 1:
            return out[..., :numel]
        parts, at = [], 0
        for s in sizes:
            parts.append(out[..., at: at + s])
            at += -(-s // self.chunk) * self.chunk  # each tensor's stretch of out is padded to whole chunks
        return torch.cat(parts, dim=-1)
