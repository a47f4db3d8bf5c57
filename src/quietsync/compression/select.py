"""The select link of a compression chain: chunk-wise top-k.

A flat tensor of ``numel`` elements is cut into ``ceil(numel/chunk)`` chunks of ``chunk`` elements (the last
one zero-padded); in every chunk the ``k = clamp(round(density·chunk), 1, chunk)`` entries of largest
magnitude are kept (SparseLoCo's and DeMo's "chunk-wise Top-k"). What travels per chunk is the ``k`` values
(through the chain's quantize link) and their ``k`` positions inside the chunk, in the smallest integer dtype
that holds ``chunk − 1`` (:func:`quietsync.codecs.topk.index_dtype`: ``uint8`` up to 256, ``int16`` up to
32768). Values are laid out chunk after chunk, ``k`` each, so a quantizer with ``block = k`` gives every
chunk a scale of its own.
"""

from __future__ import annotations

import torch

from ..codecs.topk import index_dtype, topk_positions
from ..validate import check_float, check_int

__all__ = ["TopK"]


class TopK:
    """Chunk-wise top-k selection (module docstring).

    Args:
        chunk: elements per chunk.
        density: fraction of each chunk kept, in ``(0, 1]`` (``k = clamp(round(density·chunk), 1, chunk)``).
    """

    def __init__(self, chunk: int = 64, density: float = 1 / 32) -> None:
        check_int("chunk", chunk, 1)
        check_float("density", density, 0, 1, low_open=True)
        self.chunk = chunk
        self.density = float(density)
        self.k = min(chunk, max(1, round(density * chunk)))
        self.position_dtype = index_dtype(chunk)
        self.position_size = torch.empty((), dtype=self.position_dtype).element_size()

    def __repr__(self) -> str:
        return f"TopK(chunk={self.chunk}, k={self.k})"

    def chunks(self, numel: int) -> int:
        return -(-numel // self.chunk)

    def selected(self, numel: int) -> int:
        """How many values a tensor of ``numel`` elements sends."""
        return self.chunks(numel) * self.k

    def position_bytes(self, numel: int) -> int:
        return self.selected(numel) * self.position_size

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, positions)`` of flat ``x``: values fp32 ``(chunks·k,)`` chunk by chunk, positions
        ``(chunks, k)`` inside each chunk (``position_dtype``)."""
        flat = x.detach().reshape(-1).float()
        pad = -flat.numel() % self.chunk
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        rows = flat.view(-1, self.chunk)
        pos = topk_positions(rows, self.k)
        return torch.gather(rows, 1, pos).reshape(-1), pos.to(self.position_dtype)

    def scatter(self, values: torch.Tensor, positions: torch.Tensor, numel: int) -> torch.Tensor:
        """Dense ``(..., numel)`` fp32 with ``values`` (``(..., chunks·k)``) at ``positions``
        (``(..., chunks·k)`` or ``(..., chunks, k)``), zeros elsewhere."""
        lead = values.shape[:-1]
        nc = self.chunks(numel)
        pos = positions.reshape(*lead, nc, self.k).long()
        out = torch.zeros(*lead, nc, self.chunk, dtype=torch.float32, device=values.device)
        out.scatter_(-1, pos, values.reshape(*lead, nc, self.k).float())
        return out.reshape(*lead, nc * self.chunk)[..., :numel]
