"""Orthonormal DCT-II and the block layout DeMo encodes momentum with.

DeMo (paper 001, after Peng et al. 2024) looks at the decoupled momentum in the frequency
domain: every tensor is cut into chunks, each chunk is taken through a DCT-II, and only the
largest coefficients per chunk travel.

* :func:`dct_basis` is the orthonormal DCT-II matrix ``D`` (``D @ D.T == I``), cached per
  ``(size, dtype, device)``; ``X = D x`` encodes, ``x = D.T X`` decodes.
* :class:`BlockLayout` maps a list of tensor shapes (the segments of one flat buffer) to blocks:
  matrices get ``chunk x chunk`` 2-D blocks, vectors ``chunk``-long 1-D blocks, higher-rank
  tensors are viewed as ``(shape[0], prod(shape[1:]))``. A dimension that is not a multiple of
  the chunk is **padded** with zeros (an odd or prime size still gets real chunks; the reference
  code falls back to chunk 1 there); a dimension smaller than the chunk gets one block of its own
  size. Blocks of the same shape from all segments are stacked, so one gather and two batched
  matmuls encode every parameter of a step at once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..validate import check_int

__all__ = ["dct_basis", "BlockGroup", "BlockLayout"]


@functools.lru_cache(maxsize=128)
def _dct_basis_cached(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(math.pi * (2.0 * i + 1.0) * k / (2.0 * n))
    basis[0] *= math.sqrt(1.0 / n)
    basis[1:] *= math.sqrt(2.0 / n)
    return basis.to(dtype=dtype, device=device)


def dct_basis(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal DCT-II matrix of size ``n x n`` (row k = frequency k). Cached; do not modify."""
    check_int("n", n, 1)
    return _dct_basis_cached(n, dtype, torch.device(device))


@dataclass
class BlockGroup:
    """All blocks of one shape: ``index`` gathers them from the (sentinel-extended) flat buffer.

    ``index`` has shape ``(num_blocks, *block_shape)``; entries equal to the layout's ``numel``
    point at a zero sentinel (padding). ``real`` is how many non-padding elements the group holds.
    """

    block_shape: tuple[int, ...]
    index: torch.Tensor
    real: int

    @property
    def num_blocks(self) -> int:
        return int(self.index.shape[0])

    @property
    def block_numel(self) -> int:
        return math.prod(self.block_shape)


def _blocks_2d(offset: int, rows: int, cols: int, br: int, bc: int, sentinel: int) -> torch.Tensor:
    nr, nc = -(-rows // br), -(-cols // bc)
    r = torch.arange(nr * br).unsqueeze(1)
    c = torch.arange(nc * bc).unsqueeze(0)
    idx = offset + r * cols + c
    idx = torch.where((r < rows) & (c < cols), idx, torch.full_like(idx, sentinel))
    return idx.reshape(nr, br, nc, bc).permute(0, 2, 1, 3).reshape(nr * nc, br, bc)


def _blocks_1d(offset: int, length: int, b: int, sentinel: int) -> torch.Tensor:
    n = -(-length // b)
    i = torch.arange(n * b)
    idx = torch.where(i < length, offset + i, torch.full_like(i, sentinel))
    return idx.reshape(n, b)


class BlockLayout:
    """Chunking of a flat buffer made of ``shapes`` (in order) into DCT blocks.

    Args:
        shapes: shapes of the segments of the flat buffer (concatenated in this order).
        chunk: the block edge ``C`` (matrices: ``C x C`` blocks, vectors: ``C``-long blocks).
        device: where the gather indices live (the device of the buffers encoded).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], chunk: int, device: torch.device | str = "cpu") -> None:
        check_int("chunk", chunk, 1)
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.chunk = chunk
        self.numel = sum(math.prod(s) for s in self.shapes)
        sentinel = self.numel
        parts: dict[tuple[int, ...], list[torch.Tensor]] = {}
        reals: dict[tuple[int, ...], int] = {}
        offset = 0
        for shape in self.shapes:
            n = math.prod(shape)
            if n == 0:
                continue
            if len(shape) >= 2 and shape[0] > 1 and n // shape[0] > 1:
                rows, cols = shape[0], n // shape[0]
                bs = (min(chunk, rows), min(chunk, cols))
                idx = _blocks_2d(offset, rows, cols, bs[0], bs[1], sentinel)
            else:
                bs = (min(chunk, n),)
                idx = _blocks_1d(offset, n, bs[0], sentinel)
            parts.setdefault(bs, []).append(idx)
            reals[bs] = reals.get(bs, 0) + n
            offset += n
        self.groups = [
            BlockGroup(bs, torch.cat(parts[bs]).to(device), reals[bs]) for bs in sorted(parts, reverse=True)
        ]
        # inverse map for decoding: flat position -> position in the concatenated blocks of all groups
        # (a gather is several times cheaper than scattering into the flat buffer)
        self.inverse = torch.empty(self.numel, dtype=torch.long, device=device)
        at = 0
        for g in self.groups:
            idx = g.index.reshape(-1)
            real = idx < self.numel
            self.inverse[idx[real]] = torch.arange(at, at + idx.numel(), device=device)[real]
            at += idx.numel()

    # -- transforms ---------------------------------------------------------------------------
    def _extended(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.cat([flat, flat.new_zeros(1)])

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """DCT-II coefficients of every block, one tensor ``(num_blocks, *block_shape)`` per group."""
        if flat.numel() != self.numel:
            raise ValueError(f"buffer has {flat.numel()} elements, layout expects {self.numel}")
        ext = self._extended(flat)
        out = []
        for g in self.groups:
            blocks = ext[g.index]
            out.append(self.transform(blocks, g.block_shape, inverse=False))
        return out

    def decode(self, coeffs: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse of :meth:`encode`: a flat buffer with padding dropped."""
        if not self.groups:
            return torch.zeros(0) if out is None else out
        blocks = [self.transform(c, g.block_shape, inverse=True).reshape(-1) for g, c in zip(self.groups, coeffs)]
        flat = torch.cat(blocks)[self.inverse]
        if out is not None:
            out.copy_(flat)
            return out
        return flat

    @staticmethod
    def transform(x: torch.Tensor, block_shape: tuple[int, ...], inverse: bool) -> torch.Tensor:
        """Batched (inverse) DCT-II over the trailing block dimensions of ``x``."""
        if len(block_shape) == 1:
            d = dct_basis(block_shape[0], x.dtype, x.device)
            return x @ d if inverse else x @ d.T
        dr = dct_basis(block_shape[0], x.dtype, x.device)
        dc = dct_basis(block_shape[1], x.dtype, x.device)
        if inverse:  # D_r^T X D_c
            return torch.matmul(dr.T, x @ dc)
        return torch.matmul(dr, x @ dc.T)  # D_r B D_c^T
