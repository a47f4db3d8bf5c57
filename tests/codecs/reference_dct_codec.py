"""Oracle: quietsync's DeMo DCT codec and ``dct`` replicator as they were before the issue-13 rewrite.

Copied verbatim (renamed ``Ref*``) from ``src/quietsync/codecs/{dct,topk}.py`` and
``src/quietsync/replicators/dct.py`` at commit d01645c: int64 gather indices, a sentinel-extended buffer,
a concatenate-and-gather decode and dense scatter-mean temporaries, ``torch.topk`` for the top-k (copied
from ``codecs/topk.py`` at commit 498f691) and a spatial momentum (three transforms a step). The tests check
the block layout against it bit for bit, and the DCT-domain replicator step within rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quietsync.codecs import dct_basis, index_dtype, pack, unpack
from quietsync.replicators.base import Message, Segments
from quietsync.validate import check_int


@dataclass
class RefBlockGroup:
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


class RefBlockLayout:
    """Chunking of a flat buffer made of ``shapes`` (in order) into DCT blocks.

    Args:
        shapes: shapes of the segments of the flat buffer (concatenated in this order).
        chunk: the block edge ``C`` (matrices: ``C x C`` blocks, vectors: ``C``-long blocks).
        device: where the gather indices live (the device of the buffers encoded).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], chunk: int, device: torch.device | str = "cpu") -> None:
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
            RefBlockGroup(bs, torch.cat(parts[bs]).to(device), reals[bs]) for bs in sorted(parts, reverse=True)
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


def topk_per_block(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` largest-magnitude entries of each row of ``x`` (shape ``(blocks, block_numel)``), by ``torch.topk``."""
    if x.dim() != 2:
        raise ValueError(f"x must be (blocks, block_numel), got shape {tuple(x.shape)}")
    n = x.shape[1]
    check_int("k", k, 1, n)  # at most the block size
    if k == n:
        pos = torch.arange(n, device=x.device).expand(x.shape[0], n)
        return x.clone(), pos.to(index_dtype(n))
    pos = x.abs().topk(k, dim=1, sorted=False).indices
    return torch.gather(x, 1, pos), pos.to(index_dtype(n))


def _flat_positions(positions: torch.Tensor, block_numel: int) -> torch.Tensor:
    blocks = positions.shape[-2]
    base = torch.arange(blocks, device=positions.device).unsqueeze(1) * block_numel
    return positions.long() + base


def densify(values: torch.Tensor, positions: torch.Tensor, block_numel: int) -> torch.Tensor:
    """One worker's sparse blocks as dense ``(blocks, block_numel)`` (zeros elsewhere)."""
    blocks = values.shape[0]
    out = torch.zeros(blocks * block_numel, dtype=values.dtype, device=values.device)
    out[_flat_positions(positions, block_numel).reshape(-1)] = values.reshape(-1)
    return out.reshape(blocks, block_numel)


def scatter_mean(
    values: torch.Tensor, positions: torch.Tensor, block_numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Average sparse blocks from several workers, per coefficient over the workers that sent it.

    ``values`` / ``positions`` have shape ``(workers, blocks, k)``; returns dense
    ``(blocks, block_numel)`` in ``dtype``.
    """
    workers, blocks, _ = values.shape
    flat = _flat_positions(positions, block_numel).reshape(-1)
    total = torch.zeros(blocks * block_numel, dtype=dtype, device=values.device)
    count = torch.zeros(blocks * block_numel, dtype=dtype, device=values.device)
    total.index_add_(0, flat, values.reshape(-1).to(dtype))
    count.index_add_(0, flat, torch.ones(flat.numel(), dtype=dtype, device=values.device))
    return (total / count.clamp_min(1)).reshape(blocks, block_numel)


class RefDCTCodec:
    """The old ``DCTReplicator.extract`` / ``exchange`` math, with ``ks`` passed in."""

    def __init__(self, shapes: Sequence[Sequence[int]], chunk: int, ks: list[int],
                 transfer_dtype: torch.dtype = torch.float32) -> None:
        self.layout = RefBlockLayout(shapes, chunk)
        self.ks = ks
        self.transfer_dtype = transfer_dtype

    def extract(self, delta: torch.Tensor) -> Message:
        layout = self.layout
        parts, dense = [], []
        for g, k, coeffs in zip(layout.groups, self.ks, layout.encode(delta)):
            vals, pos = topk_per_block(coeffs.reshape(g.num_blocks, g.block_numel), k)
            vals = vals.to(self.transfer_dtype)
            parts += [vals, pos]
            dense.append(densify(vals.to(delta.dtype), pos, g.block_numel).reshape(coeffs.shape))
        sent = layout.decode(dense)
        specs = []
        for g, k in zip(layout.groups, self.ks):
            specs += [((g.num_blocks, k), self.transfer_dtype), ((g.num_blocks, k), index_dtype(g.block_numel))]
        return Message(pack(parts), sent, specs)

    def exchange(self, gathered: torch.Tensor, n: int, msg: Message) -> torch.Tensor:
        tensors = unpack(gathered.reshape(n, -1), msg.meta)
        coeffs = []
        for i, g in enumerate(self.layout.groups):
            vals, pos = tensors[2 * i], tensors[2 * i + 1]
            mean = scatter_mean(vals, pos, g.block_numel, dtype=msg.sent.dtype)
            coeffs.append(mean.reshape(g.num_blocks, *g.block_shape))
        return self.layout.decode(coeffs)


__all__ = ["RefBlockLayout", "RefDCTCodec", "Segments", "densify", "scatter_mean", "topk_per_block"]
