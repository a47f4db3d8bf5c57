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
  size. Blocks of the same shape from all segments are stacked, so two batched matmuls encode
  every parameter of a step at once.

Blocks are moved between a segment and its group's stacked ``(num_blocks, *block_shape)`` buffer by
**strided views of the segment's own layout** -- a ``(rows, cols)`` matrix is viewed as
``(nr, br, nc, bc)`` and permuted to ``(nr, nc, br, bc)`` -- so no int64 index buffer is built, read or
concatenated (padded segments go through a zero-padded copy of their own); the segments may also come as a
list of tensors (the gradients of a step). :meth:`BlockLayout.stacked_views` lays the groups' stacked blocks
end to end in one flat buffer (where a decoupled optimizer keeps a DCT-domain momentum) and
:meth:`BlockLayout.segment_blocks` gives each segment's own blocks in it. :class:`BlockWorkspace` holds
the stacked buffers of one layout so a replicator reuses them step after step. The oracle is an fp64 DCT-II
written from paper 001 in ``tests/strategies/helpers/reference_demo.py`` (``tests/wire/codecs/test_dct_oracle.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...validate import check_int

__all__ = ["dct_basis", "BlockGroup", "BlockLayout", "BlockWorkspace", "Tile"]


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
    return _dct_basis_cached(n, dtype, torch.device(device))  # one cache entry for "cpu" and torch.device("cpu")


@dataclass
class BlockGroup:
    """All blocks of one shape, stacked ``(num_blocks, *block_shape)`` in segment order.

    ``real`` is how many non-padding elements the group holds.
    """

    block_shape: tuple[int, ...]
    num_blocks: int
    real: int

    @property
    def block_numel(self) -> int:
        return math.prod(self.block_shape)


@dataclass(frozen=True)
class _Placement:
    """Where segment ``index`` (at ``offset`` in the flat buffer) has its blocks: group ``group``, blocks
    ``first .. first + nr*nc`` of it.

    2-D segments (``len(block) == 2``) are ``rows x cols`` cut into ``nr x nc`` blocks of ``block``;
    1-D segments are ``rows`` elements (``cols == 1``) in ``nr`` blocks (``nc == 1``).
    """

    index: int
    offset: int
    rows: int
    cols: int
    block: tuple[int, ...]
    group: int
    first: int
    nr: int
    nc: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def num_blocks(self) -> int:
        return self.nr * self.nc

    @property
    def padded(self) -> bool:
        if len(self.block) == 1:
            return self.nr * self.block[0] != self.rows
        return self.nr * self.block[0] != self.rows or self.nc * self.block[1] != self.cols


@dataclass(frozen=True)
class Tile:
    """A run of consecutive stacked blocks of one group, ``first .. first + count``, small enough to stay in a
    core's cache while a step works through it; ``pieces`` are where they come from: ``(placement, r0, r1)``,
    block rows ``r0 .. r1`` of a segment (all its rows for a 1-D or padded segment), in stacked order."""

    group: int
    first: int
    count: int
    pieces: tuple[tuple[_Placement, int, int], ...]


class BlockLayout:
    """Chunking of a flat buffer made of ``shapes`` (in order) into DCT blocks.

    Args:
        shapes: shapes of the segments of the flat buffer (concatenated in this order).
        chunk: the block edge ``C`` (matrices: ``C x C`` blocks, vectors: ``C``-long blocks).
        device: kept for compatibility (the layout holds no tensors; buffers follow the data).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], chunk: int, device: torch.device | str = "cpu") -> None:
        check_int("chunk", chunk, 1)
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.chunk = chunk
        self.numel = sum(math.prod(s) for s in self.shapes)
        raw: list[tuple[int, int, int, int, tuple[int, ...], int, int]] = []
        counts: dict[tuple[int, ...], int] = {}
        reals: dict[tuple[int, ...], int] = {}
        offset = 0
        for index, shape in enumerate(self.shapes):
            n = math.prod(shape)
            if n == 0:
                continue
            # one row or one column: 1-D blocks (a 1 x C block's DCT is the C-long one), stacked with the vectors'
            if len(shape) >= 2 and shape[0] > 1 and n // shape[0] > 1:
                rows, cols = shape[0], n // shape[0]
                bs: tuple[int, ...] = (min(chunk, rows), min(chunk, cols))
                nr, nc = -(-rows // bs[0]), -(-cols // bs[1])
            else:
                rows, cols = n, 1
                bs = (min(chunk, n),)
                nr, nc = -(-n // bs[0]), 1
            raw.append((index, offset, rows, cols, bs, nr, nc))
            counts[bs] = counts.get(bs, 0) + nr * nc
            reals[bs] = reals.get(bs, 0) + n
            offset += n
        order = sorted(counts, reverse=True)
        self.groups = [BlockGroup(bs, counts[bs], reals[bs]) for bs in order]
        gid = {bs: i for i, bs in enumerate(order)}
        filled = dict.fromkeys(order, 0)
        self.placements: list[_Placement] = []
        for index, off, rows, cols, bs, nr, nc in raw:
            self.placements.append(_Placement(index, off, rows, cols, bs, gid[bs], filled[bs], nr, nc))
            filled[bs] += nr * nc

    # -- a flat buffer of stacked blocks ------------------------------------------------------
    @property
    def stacked_numel(self) -> int:
        """Elements of all groups' stacked blocks (padding included)."""
        return sum(g.num_blocks * g.block_numel for g in self.groups)

    def stacked_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (``stacked_numel`` long) viewed as the groups' ``(num_blocks, *block_shape)`` tensors, in order."""
        if flat.numel() != self.stacked_numel:
            raise ValueError(f"buffer has {flat.numel()} elements, the stacked blocks need {self.stacked_numel}")
        out, at = [], 0
        for g in self.groups:
            n = g.num_blocks * g.block_numel
            out.append(flat[at : at + n].view(g.num_blocks, *g.block_shape))
            at += n
        return out

    def segment_blocks(self, stacked: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each segment's own blocks ``(nr * nc, *block)`` in ``stacked`` (an empty tensor for an empty segment)."""
        out = [stacked[0].new_empty(0) if stacked else torch.empty(0) for _ in self.shapes]
        for p in self.placements:
            out[p.index] = stacked[p.group][p.first : p.first + p.num_blocks]
        return out

    def tiles(self, max_elements: int) -> list[Tile]:
        """The stacked blocks cut into :class:`Tile` runs of at most ``max_elements`` elements (a larger
        unpadded matrix is cut by block rows; a tile holds at least one block row), each within one group."""
        check_int("max_elements", max_elements, 1)
        out: list[Tile] = []
        for gi, g in enumerate(self.groups):
            per = max(1, max_elements // g.block_numel)  # blocks per tile
            pieces: list[tuple[_Placement, int, int]] = []
            first = count = 0
            for p in sorted((q for q in self.placements if q.group == gi), key=lambda q: q.first):
                # only unpadded matrices are cut: tile_gather / tile_scatter take 1-D and padded segments whole
                splittable = len(p.block) == 2 and not p.padded
                step = max(1, per // p.nc) if splittable else p.nr  # block rows per piece
                for r0 in range(0, p.nr, step):
                    r1 = min(p.nr, r0 + step)
                    n = (r1 - r0) * p.nc
                    # never close an empty tile: a piece larger than a tile gets one of its own
                    if count and count + n > per:
                        out.append(Tile(gi, first, count, tuple(pieces)))
                        pieces, first, count = [], first + count, 0
                    pieces.append((p, r0, r1))
                    count += n
            if count:
                out.append(Tile(gi, first, count, tuple(pieces)))
        return out

    @staticmethod
    def _piece_views(p: _Placement, r0: int, r1: int, seg: torch.Tensor,
                     blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block rows ``r0 .. r1`` of an unpadded 2-D segment ``seg`` (flat) and the same blocks in ``blocks``
        (``((r1 - r0) * nc, br, bc)``), both viewed ``(r1 - r0, br, nc, bc)``."""
        br, bc = p.block
        rows = seg.view(p.nr, br, p.nc, bc)[r0:r1]
        return rows, blocks.view(r1 - r0, p.nc, br, bc).permute(0, 2, 1, 3)

    def tile_gather(self, tile: Tile, flat: torch.Tensor | Sequence[torch.Tensor], blocks: torch.Tensor) -> None:
        """:meth:`gather_blocks` for one tile: its segments' elements (of a flat buffer, or of a list of
        tensors, one per segment) into ``blocks`` (``(tile.count, *block_shape)``), padding written as zeros."""
        at = 0
        for p, r0, r1 in tile.pieces:
            seg = flat[p.offset : p.offset + p.numel] if isinstance(flat, torch.Tensor) else flat[p.index].reshape(-1)
            n = (r1 - r0) * p.nc
            dst = blocks[at : at + n]
            at += n
            if len(p.block) == 2 and not p.padded:
                src, view = self._piece_views(p, r0, r1, seg, dst)
                view.copy_(src)
                continue
            mine = self._own_layout(p, dst)
            if len(p.block) == 1:
                mine[: p.rows].copy_(seg)
                mine[p.rows :].zero_()  # blocks may be reused scratch: the padding holds the last tile's values
            else:  # through a zero-padded copy of the segment's own layout, as gather_blocks
                br, bc = p.block
                pad = seg.new_zeros(p.nr * br, p.nc * bc)
                pad[: p.rows, : p.cols] = seg.view(p.rows, p.cols)
                mine.copy_(pad.view(p.nr, br, p.nc, bc))

    def tile_scatter(self, tile: Tile, blocks: torch.Tensor, flat: torch.Tensor) -> None:
        """:meth:`scatter_blocks` for one tile: the real part of ``blocks`` (``(tile.count, *block_shape)``)
        written into the tile's segments of ``flat``."""
        at = 0
        for p, r0, r1 in tile.pieces:
            seg = flat[p.offset : p.offset + p.numel]
            n = (r1 - r0) * p.nc
            src = blocks[at : at + n]
            at += n
            if len(p.block) == 2 and not p.padded:
                dst, view = self._piece_views(p, r0, r1, seg, src)
                dst.copy_(view)
                continue
            mine = self._own_layout(p, src)
            if len(p.block) == 1:
                seg.copy_(mine[: p.rows])
            else:
                br, bc = p.block
                seg.view(p.rows, p.cols).copy_(mine.reshape(p.nr * br, p.nc * bc)[: p.rows, : p.cols])

    # -- moving blocks ------------------------------------------------------------------------
    def empty_blocks(self, dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
        """Zeroed stacked block buffers, one ``(num_blocks, *block_shape)`` per group."""
        return [torch.zeros(g.num_blocks, *g.block_shape, dtype=dtype, device=device) for g in self.groups]

    @staticmethod
    def _blocks_of(p: _Placement, stacked: torch.Tensor) -> torch.Tensor:
        """``p``'s blocks in ``stacked`` viewed in the segment's own (padded) layout:
        ``(nr, br, nc, bc)`` for 2-D, ``(nr * b,)`` for 1-D."""
        return BlockLayout._own_layout(p, stacked[p.first : p.first + p.num_blocks])

    @staticmethod
    def _own_layout(p: _Placement, mine: torch.Tensor) -> torch.Tensor:
        """``p``'s ``num_blocks`` blocks ``mine`` viewed as :meth:`_blocks_of` views them."""
        if len(p.block) == 1:
            return mine.view(-1)
        br, bc = p.block
        return mine.view(p.nr, p.nc, br, bc).permute(0, 2, 1, 3)

    def gather_blocks(self, flat: torch.Tensor | Sequence[torch.Tensor], blocks: Sequence[torch.Tensor]) -> None:
        """Copy every segment of ``flat`` (or of a list of tensors, one per segment, e.g. gradients) into its
        blocks in ``blocks``, padding written as zeros."""
        if isinstance(flat, torch.Tensor) and flat.numel() != self.numel:
            raise ValueError(f"buffer has {flat.numel()} elements, layout expects {self.numel}")
        if not isinstance(flat, torch.Tensor) and len(flat) != len(self.shapes):
            raise ValueError(f"got {len(flat)} tensors, layout has {len(self.shapes)} segments")
        for p in self.placements:
            if isinstance(flat, torch.Tensor):
                seg = flat[p.offset : p.offset + p.numel]
            else:
                seg = flat[p.index].reshape(-1)
            dst = self._blocks_of(p, blocks[p.group])
            if len(p.block) == 1:
                dst[: p.rows].copy_(seg)
                dst[p.rows :].zero_()
            elif not p.padded:
                dst.copy_(seg.view(p.nr, p.block[0], p.nc, p.block[1]))
            else:  # through a zero-padded copy of the segment's own layout
                br, bc = p.block
                pad = seg.new_zeros(p.nr * br, p.nc * bc)
                pad[: p.rows, : p.cols] = seg.view(p.rows, p.cols)
                dst.copy_(pad.view(p.nr, br, p.nc, bc))

    def scatter_blocks(self, blocks: Sequence[torch.Tensor], flat: torch.Tensor, subtract: bool = False) -> None:
        """Write (or, with ``subtract``, subtract) the real part of every block into ``flat``."""
        for p in self.placements:
            seg = flat[p.offset : p.offset + p.numel]
            src = self._blocks_of(p, blocks[p.group])
            if len(p.block) == 1:
                src = src[: p.rows]
            elif not p.padded:
                seg = seg.view(p.nr, p.block[0], p.nc, p.block[1])
            else:
                br, bc = p.block
                src = src.reshape(p.nr * br, p.nc * bc)[: p.rows, : p.cols]
                seg = seg.view(p.rows, p.cols)
            if subtract:
                seg.sub_(src)
            else:
                seg.copy_(src)

    # -- transforms ---------------------------------------------------------------------------
    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """DCT-II coefficients of every block, one tensor ``(num_blocks, *block_shape)`` per group."""
        blocks = self.empty_blocks(flat.dtype, flat.device)
        self.gather_blocks(flat, blocks)
        return [self.transform(b, g.block_shape, inverse=False) for g, b in zip(self.groups, blocks)]

    def decode(self, coeffs: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse of :meth:`encode`: a flat buffer with padding dropped."""
        if not self.groups:
            # every segment empty: there is no block to take a dtype and device from
            return torch.zeros(0) if out is None else out
        blocks = [self.transform(c, g.block_shape, inverse=True) for g, c in zip(self.groups, coeffs)]
        if out is None:
            out = blocks[0].new_empty(self.numel)
        self.scatter_blocks(blocks, out)
        return out

    @staticmethod
    def transform(x: torch.Tensor, block_shape: tuple[int, ...], inverse: bool,
                  out: torch.Tensor | None = None, tmp: torch.Tensor | None = None) -> torch.Tensor:
        """Batched (inverse) DCT-II over the trailing block dimensions of ``x``.

        ``out`` (and, for 2-D blocks, ``tmp`` for the intermediate product) receive the result when
        given; they must not alias ``x``.
        """
        if len(block_shape) == 1:
            d = dct_basis(block_shape[0], x.dtype, x.device)
            # blocks are rows: x @ D.T is X = D x for each, X @ D is x = D.T X
            return torch.matmul(x, d if inverse else d.T, out=out)
        dr = dct_basis(block_shape[0], x.dtype, x.device)
        dc = dct_basis(block_shape[1], x.dtype, x.device)
        if inverse:  # D_r^T X D_c
            return torch.matmul(dr.T, torch.matmul(x, dc, out=tmp), out=out)
        return torch.matmul(dr, torch.matmul(x, dc.T, out=tmp), out=out)  # D_r B D_c^T


class BlockWorkspace:
    """Stacked buffers of one :class:`BlockLayout`, kept across steps (one dtype and device).

    ``blocks`` (spatial blocks; :meth:`BlockLayout.gather_blocks` rewrites their padding with zeros), ``coeffs``
    (transform output) and ``tmp`` (the
    intermediate product of a 2-D transform) have one ``(num_blocks, *block_shape)`` tensor per group.
    """

    def __init__(self, layout: BlockLayout, dtype: torch.dtype, device: torch.device | str) -> None:
        self.layout = layout
        self.dtype, self.device = dtype, torch.device(device)
        self.blocks = layout.empty_blocks(dtype, device)
        self.coeffs = layout.empty_blocks(dtype, device)
        self.tmp = layout.empty_blocks(dtype, device)

    def encode(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """DCT-II coefficients of ``flat`` in ``self.coeffs`` (valid until the next call)."""
        self.layout.gather_blocks(flat, self.blocks)
        for g, b, c, t in zip(self.layout.groups, self.blocks, self.coeffs, self.tmp):
            BlockLayout.transform(b, g.block_shape, inverse=False, out=c, tmp=t)
        return self.coeffs

    def decode_into(self, coeffs: Sequence[torch.Tensor], flat: torch.Tensor, subtract: bool = False) -> None:
        """Inverse DCT of ``coeffs`` written into ``flat`` (or subtracted from it); uses ``self.blocks``."""
        for g, c, b, t in zip(self.layout.groups, coeffs, self.blocks, self.tmp):
            BlockLayout.transform(c, g.block_shape, inverse=True, out=b, tmp=t)
        self.layout.scatter_blocks(self.blocks, flat, subtract=subtract)
