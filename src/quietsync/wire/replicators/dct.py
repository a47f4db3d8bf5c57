"""``dct``: DeMo's replicator -- top-k DCT-II coefficients per chunk, values and positions, all-gather.

Per step, the momentum of every parameter is cut into ``chunk x chunk`` blocks (``chunk``-long
for vectors; see :class:`~quietsync.wire.codecs.BlockLayout`), each block goes through a DCT-II, and
the ``k`` largest-magnitude coefficients of every block travel with their position inside the
block (``uint8``/``int16``). Because positions differ per worker the payloads cannot be summed:
they are **all-gathered** (one collective, values and positions of all parameters packed into a
single byte buffer), then each coefficient is averaged over the workers that sent it and the
result decoded. The gather grows with the replicate group: each worker receives ``(n-1)`` payloads,
where an all-reduce of ``random``/``striding`` moves ``2(n-1)/n`` of one.

A decoupled optimizer keeps its momentum **in the DCT domain** (``momentum_domain == "dct:<chunk>"``: the
coefficients of every block, stacked per block shape, see :class:`~quietsync.wire.codecs.BlockLayout`):
:meth:`DCTReplicator.accumulate` adds the transformed gradient (``C <- beta C + s DCT(g)``),
:meth:`DCTReplicator.extract_momentum` picks the top-k straight from ``C``, does error feedback by zeroing what
was sent (keeping what the transfer cast lost) and projects the edge blocks of padded tensors back onto blocks
that are zero in their padding (so the residual is exactly the one a spatial momentum keeps), and
:meth:`DCTReplicator.exchange_momentum` all-gathers, sums and counts the received coefficients and decodes their
mean with one inverse transform (an unpadded matrix's sums lie in its own layout, so the decode writes the update
where it lies; ``sign=True``: the mean's sign, taken while a tile is in cache): two transforms a step where a
spatial momentum needs three (encode, decode what was sent, decode the mean). Each works through the stacked
coefficients in tiles of :data:`_TILE_ELEMENTS` (:meth:`~quietsync.wire.codecs.BlockLayout.tiles`), so a tile's
blocks, magnitudes, sums and counts stay in cache and nothing model-sized is written besides the momentum and the
update. :meth:`DCTReplicator.replicate`
is the spatial entry point (DiLoCo's pseudo-gradients): it converts, steps and converts back. The fp64 oracle
written from paper 001 (``tests/strategies/helpers/reference_demo.py``) agrees up to fp32 rounding; the top-k may
pick other positions only among coefficients of equal magnitude (:func:`~quietsync.wire.codecs.topk_positions`).

``k`` per block follows from ``compression`` (bytes per coefficient = value + position bytes), or
is fixed by ``topk`` (DeMo's own knob; then ``compression`` is not used). With a low-bit ``transfer_dtype``
the ``k`` values of a block travel as packed codes with one bf16 scale for the block (the residual keeps what
quantization lost), so about 4x (fp4) or 8x (int2) as many coefficients fit the same bytes as in fp32 minus
what the positions take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...transport import Collectives, across_replicas
from ...validate import check_int
from ..codecs import (
    BlockLayout,
    dct_basis,
    densify,
    index_dtype,
    nbytes,
    pack,
    scatter_mean,
    topk_per_block,
    topk_positions,
    unpack,
)
from ..codecs.dct import Tile
from .base import Message, Replicator, Segments, signed


class DCTReplicator(Replicator):
    """DeMo-DCT top-k replication.

    Args:
        chunk: block edge (DeMo's ``compression_chunk``; 64 by default).
        topk: coefficients per block; None derives it from ``compression``.
        (others as :class:`~quietsync.wire.replicators.base.Replicator`)
    """

    name = "dct"
    sends_indices = True
    collective = "all_gather"
    knobs = (*Replicator.knobs, "chunk", "topk")

    def __init__(self, compression: float = 1 / 32, transfer_dtype: Any = "fp32", transport: Collectives | None = None,
                 group: str = "replicate", chunk: int = 64, topk: int | None = None, transfer_block: int = 64) -> None:
        super().__init__(compression, transfer_dtype, transport, group, transfer_block)
        check_int("chunk", chunk, 1)
        check_int("topk", topk, 1, chunk * chunk, allow_none=True)  # at most chunk**2 per block
        self.chunk = chunk
        self.topk = topk
        self._layouts: dict[tuple[Segments, str], BlockLayout] = {}
        self._any_layout: dict[Segments, BlockLayout] = {}
        self._workspaces: dict[tuple[Segments, str, torch.dtype], _Workspace] = {}

    def set_topk(self, topk: int) -> None:
        """Send ``topk`` coefficients per block from the next extraction on (DeMo's ``--adapt``): the momentum (the
        DCT coefficients) does not depend on k, only the buffers of the picked values and positions, rebuilt."""
        check_int("topk", topk, 1, self.chunk * self.chunk)
        if topk != self.topk:
            self.topk = topk
            self._workspaces.clear()

    def layout(self, segments: Segments, device: torch.device | str | None = None) -> BlockLayout:
        """Block layout of ``segments`` on ``device`` (cached); ``None``: any device already built (for
        metadata only), else CPU."""
        if device is None and segments in self._any_layout:
            return self._any_layout[segments]
        key = (segments, str(device or "cpu"))
        if key not in self._layouts:
            self._layouts[key] = BlockLayout(segments.shapes, self.chunk, device or "cpu")
            self._any_layout.setdefault(segments, self._layouts[key])
        return self._layouts[key]

    def ks(self, segments: Segments, dtype: torch.dtype = torch.float32) -> list[int]:
        """Coefficients sent per block, for each block group of the layout."""
        eb = torch.empty((), dtype=dtype).element_size()
        out = []
        for g in self.layout(segments).groups:
            position = torch.empty((), dtype=index_dtype(g.block_numel)).element_size()
            if self.topk is not None:
                k = self.topk
            elif self.lowbit is not None:  # k codes + k positions + one scale per block
                per_coeff = self.lowbit.bits / 8 + position
                k = round((self.compression * g.real * eb / g.num_blocks - self.lowbit.scale_bytes) / per_coeff)
            else:
                per_coeff = self.value_bytes + position
                k = round(self.compression * g.real * eb / (g.num_blocks * per_coeff))
            out.append(max(1, min(g.block_numel, k)))
        return out

    def _specs(self, segments: Segments, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        specs: list[tuple[tuple[int, ...], torch.dtype]] = []
        for g, k in zip(self.layout(segments).groups, self.ks(segments, dtype)):
            if self.lowbit is not None:  # packed codes, a scale per block's k values
                specs.append(((self.values_payload_bytes(g.num_blocks * k, k),), torch.uint8))
            else:
                specs.append(((g.num_blocks, k), self.transfer_dtype))
            specs.append(((g.num_blocks, k), index_dtype(g.block_numel)))
        return specs

    def _values_of(self, tensor: torch.Tensor, g: Any, k: int) -> torch.Tensor:
        """The ``(workers, blocks, k)`` values of one block group from an unpacked (gathered) payload."""
        if self.lowbit is None:
            return tensor
        return self.decode_values(tensor.reshape(tensor.shape[0], -1), g.num_blocks * k, k).view(-1, g.num_blocks, k)

    def _workspace(self, segments: Segments, delta: torch.Tensor) -> _Workspace:
        key = (segments, str(delta.device), delta.dtype)
        ws = self._workspaces.get(key)
        if ws is None:
            transfer = delta.dtype if self.lowbit is not None else self.transfer_dtype  # what ws.values hold
            ws = self._workspaces[key] = _Workspace(self.layout(segments, delta.device), self.ks(segments, delta.dtype),
                                                    transfer, delta.dtype, delta.device)
        return ws

    # ------------------------------------------------------------------ the momentum in the DCT domain
    @property
    def momentum_domain(self) -> str:
        return f"dct:{self.chunk}"

    def momentum_numel(self, segments: Segments) -> int:
        return self.layout(segments).stacked_numel

    def momentum_views(self, momentum: torch.Tensor, segments: Segments) -> list[torch.Tensor]:
        """Each segment's DCT coefficients, ``(blocks, *block_shape)`` (see
        :class:`~quietsync.wire.codecs.BlockLayout`)."""
        layout = self.layout(segments, momentum.device)
        return layout.segment_blocks(layout.stacked_views(momentum))

    def accumulate(self, momentum: torch.Tensor, segments: Segments, grads: Sequence[torch.Tensor],
                   betas: Sequence[float], scales: Sequence[float]) -> None:
        """``C <- beta * C + scale * DCT(g)``, tile by tile: a tile's gradient is transformed in cache and added to
        its coefficients there (no model-sized temporary is written or read back). An unpadded matrix is
        transformed where it lies (rows of blocks side by side: one product with every block row's ``D_r`` at
        once) and its blocks are read out of that layout by the addition itself."""
        ws = self._workspace(segments, momentum)
        layout = ws.layout
        stacked = layout.stacked_views(momentum)
        for tile in ws.tiles:
            shape = layout.groups[tile.group].block_shape
            mine = stacked[tile.group][tile.first : tile.first + tile.count]
            spatial, tmp, coeffs = ws.scratch(tile, "spatial", "tmp", "coeffs")
            pieces = _piece_runs(tile)
            if len(shape) == 1 or not all(_in_place(p, grads[p.index], momentum.dtype) for p, *_ in tile.pieces):
                layout.tile_gather(tile, grads, spatial)  # through the blocks' own layout
                BlockLayout.transform(spatial, shape, inverse=False, out=coeffs, tmp=tmp)
                new = [coeffs[a:b] for a, b, _ in pieces]
            else:
                new = [_transform_rows(grads[p.index], p, r0, r1, tmp[a:b], coeffs[a:b])
                       for (p, r0, r1), (a, b, _) in zip(tile.pieces, pieces)]
            for (a, b, i), c in zip(pieces, new):
                target = mine[a:b].view(c.shape)
                if betas[i] != 1.0:
                    target.mul_(betas[i])
                target.add_(c, alpha=scales[i])

    def momentum_from_spatial(self, delta: torch.Tensor, segments: Segments) -> torch.Tensor:
        coeffs = self.layout(segments, delta.device).encode(delta)
        return torch.cat([c.reshape(-1) for c in coeffs]) if coeffs else delta.new_zeros(0)

    def momentum_to_spatial(self, momentum: torch.Tensor, segments: Segments) -> torch.Tensor:
        layout = self.layout(segments, momentum.device)
        if not layout.groups:
            return momentum.new_zeros(segments.numel)
        return layout.decode(layout.stacked_views(momentum))

    def replicate(self, delta: torch.Tensor, segments: Segments) -> torch.Tensor:
        """The spatial entry point: ``delta`` into the DCT domain, :meth:`replicate_momentum`, and the residual
        back (three transforms; a decoupled optimizer keeps its momentum in the DCT domain and needs two)."""
        alone = self._alone(delta, segments)
        if alone is not None:
            return alone
        momentum = self.momentum_from_spatial(delta, segments)
        update = self.replicate_momentum(momentum, segments).clone()
        delta.copy_(self.momentum_to_spatial(momentum, segments))
        return update

    def extract_momentum(self, momentum: torch.Tensor, segments: Segments) -> Message:
        """Top-k per block of the coefficients ``momentum``, removed from it (error feedback: the sent coefficients
        are zeroed -- minus what the transfer cast or quantization loses -- and padded blocks projected back onto
        tensors that are zero in their padding); the message holds the packed payload (values and positions of
        every block group) and its specs. Tile by tile, so the magnitudes never leave the cache."""
        layout = self.layout(segments, momentum.device)
        if momentum.dim() != 1 or momentum.numel() != layout.stacked_numel:
            raise ValueError(f"momentum must be flat with {layout.stacked_numel} elements, got shape "
                             f"{tuple(momentum.shape)}")
        if self.group_size == 1:
            return self._keep_all(momentum, segments)
        ws = self._workspace(segments, momentum)
        ks = self.ks(segments, momentum.dtype)
        stacked = layout.stacked_views(momentum)
        for tile in ws.tiles:
            g, k = layout.groups[tile.group], ks[tile.group]
            rows = slice(tile.first, tile.first + tile.count)
            c2 = stacked[tile.group][rows].view(tile.count, g.block_numel)
            pos = topk_positions(c2, k, scratch=ws.scratch(tile, "spatial")[0].view(tile.count, -1))
            vals = torch.gather(c2, 1, pos)
            ws.positions[tile.group][rows] = pos
            if self.lowbit is not None:  # quantized below, a whole group at once
                ws.values[tile.group][rows] = vals
                continue
            sent = vals.to(self.transfer_dtype)
            c2.scatter_(1, pos, vals - sent.to(vals.dtype))  # error feedback: 0 in fp32, the cast's loss
            ws.values[tile.group][rows] = sent
        parts = []
        for i, (g, k) in enumerate(zip(layout.groups, ks)):
            vals = ws.values[i]
            if self.lowbit is not None:
                pos = ws.positions[i].long()
                sent, own = self.encode_values(vals.reshape(-1), k)
                c2 = stacked[i].view(g.num_blocks, g.block_numel)
                c2.scatter_(1, pos, vals - own.view_as(vals))  # error feedback: what quantization lost
                vals = sent
            parts += [vals, ws.positions[i]]
        _project_padding(layout, stacked)
        return Message(pack(parts), meta=(self._specs(segments, momentum.dtype), momentum.dtype))

    def exchange_momentum(self, msg: Message, segments: Segments, sign: bool = False) -> torch.Tensor:
        """All-gather every worker's payload, average each coefficient over the workers that sent it and decode
        the mean with one inverse transform, tile by tile (sums and counts in cache, zeroed per tile). A tile of
        unpadded matrices keeps its sums in the matrices' own layout, so the inverse transform writes the update
        where it lies (no copy out of the stacked blocks), as :meth:`accumulate` reads the gradient.

        With ``sign`` the update is the mean's sign, taken tile by tile while it is in cache. The update is a buffer
        of the replicator's, valid until its next step (a fresh 40 MB tensor per step
        costs more in page faults than the transform that fills it)."""
        if msg.local:
            return signed(msg.payload, sign)
        specs, dtype = msg.meta
        payload = msg.payload
        layout = self.layout(segments, payload.device)
        ws = self._workspaces[(segments, str(payload.device), dtype)]  # extract_momentum's
        ks = self.ks(segments, dtype)

        def gather_and_average() -> torch.Tensor:  # one unit across replicas (re-run if one dies during it)
            n = self.group_size
            gathered = payload.new_empty(n * payload.numel())
            self.transport.all_gather(gathered, payload, self.group, name="replicate/dct")
            tensors = unpack(gathered.reshape(n, -1), specs)
            received = []
            for i, (g, k) in enumerate(zip(layout.groups, ks)):
                vals = self._values_of(tensors[2 * i], g, k).permute(1, 0, 2).reshape(g.num_blocks, n * k)
                pos = tensors[2 * i + 1].permute(1, 0, 2).reshape(g.num_blocks, n * k).long()
                received.append((vals.to(dtype), ws.sum_positions(i, pos)))
            update = ws.update(segments.numel)
            for tile, own in zip(ws.tiles, ws.own_layout):
                g = layout.groups[tile.group]
                vals, at = (x[tile.first : tile.first + tile.count].reshape(-1) for x in received[tile.group])
                total, count, tmp, spatial = ws.scratch(tile, "coeffs", "count", "tmp", "spatial")
                total.zero_().view(-1).scatter_add_(0, at, vals)  # worker by worker, as the reference's index_add_
                count.zero_().view(-1).scatter_add_(0, at, ws.ones(vals))
                total.div_(count.clamp_min_(1))  # mean over who sent it (0 / 1 where nobody did), in cache
                if own:  # decoded straight into the update, in each matrix's own layout
                    for (p, r0, r1), (a, b, _) in zip(tile.pieces, _piece_runs(tile)):
                        rows = r0 * p.block[0] * p.cols, r1 * p.block[0] * p.cols
                        out = _inverse_rows(total[a:b], p, tmp[a:b], update[p.offset + rows[0] : p.offset + rows[1]])
                        if sign:  # while it is in cache
                            out.sign_()
                    continue
                BlockLayout.transform(total.view(tile.count, *g.block_shape), g.block_shape, inverse=True,
                                      out=spatial, tmp=tmp)
                layout.tile_scatter(tile, spatial.sign_() if sign else spatial, update)
            return update

        return across_replicas(self.transport, gather_and_average)

    def extract(self, delta: torch.Tensor, segments: Segments) -> Message:
        layout = self.layout(segments, delta.device)
        parts, dense = [], []
        for g, k, coeffs in zip(layout.groups, self.ks(segments, delta.dtype), layout.encode(delta)):
            vals, pos = topk_per_block(coeffs.reshape(g.num_blocks, g.block_numel), k)
            if self.lowbit is not None:
                payload, own = self.encode_values(vals.reshape(-1), k)
                parts += [payload, pos]
                dense.append(densify(own.view_as(vals).to(delta.dtype), pos, g.block_numel).reshape(coeffs.shape))
                continue
            vals = vals.to(self.transfer_dtype)
            parts += [vals, pos]
            dense.append(densify(vals.to(delta.dtype), pos, g.block_numel).reshape(coeffs.shape))
        sent = layout.decode(dense)
        return Message(pack(parts), sent, self._specs(segments, delta.dtype))

    def exchange(self, msg: Message, segments: Segments) -> torch.Tensor:
        return across_replicas(self.transport, lambda: self._exchange(msg, segments))

    def _exchange(self, msg: Message, segments: Segments) -> torch.Tensor:
        n = self.group_size
        gathered = msg.payload.new_empty(n * msg.payload.numel())
        self.transport.all_gather(gathered, msg.payload, self.group, name="replicate/dct")
        tensors = unpack(gathered.reshape(n, -1), msg.meta)
        layout = self.layout(segments, msg.sent.device)
        coeffs = []
        for i, (g, k) in enumerate(zip(layout.groups, self.ks(segments, msg.sent.dtype))):
            vals, pos = self._values_of(tensors[2 * i], g, k), tensors[2 * i + 1]
            mean = scatter_mean(vals, pos, g.block_numel, dtype=msg.sent.dtype)
            coeffs.append(mean.reshape(g.num_blocks, *g.block_shape))
        return layout.decode(coeffs)

    def payload_bytes(self, segments: Segments, dtype: torch.dtype = torch.float32) -> int:
        return sum(nbytes(shape, dt) for shape, dt in self._specs(segments, dtype))


_TILE_ELEMENTS = 2**18
"""Elements of one tile (1 MiB in fp32): a tile's scratch buffers stay near a core's L2 cache (measured against
2**17 and 2**20 on the 10m model: 2**17 pays more per-call overhead, 2**20 spills)."""


def _piece_runs(tile: Tile) -> list[tuple[int, int, int]]:
    """``(start, stop, segment)``: the tile's blocks of each piece, with the segment they belong to."""
    out, at = [], 0
    for p, r0, r1 in tile.pieces:
        n = (r1 - r0) * p.nc
        out.append((at, at + n, p.index))
        at += n
    return out


def _in_place(p: Any, grad: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`_transform_rows` takes segment ``p``'s gradient where it lies."""
    return len(p.block) == 2 and not p.padded and grad.dtype == dtype and grad.is_contiguous()


def _transform_rows(grad: torch.Tensor, p: Any, r0: int, r1: int, tmp: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
    """DCT-II of the blocks in block rows ``r0 .. r1`` of an unpadded matrix's gradient, ``D_r B D_c^T``, in the
    matrix's own layout (``tmp``, ``out``: scratch of those blocks' size); returned as the stacked
    ``(blocks, br, bc)`` view of ``out``."""
    br, bc = p.block
    n = r1 - r0
    rows = grad.reshape(p.nr, br, p.cols)[r0:r1]
    torch.matmul(rows.reshape(-1, bc), dct_basis(bc, out.dtype, out.device).T, out=tmp.view(-1, bc))  # B D_c^T
    torch.matmul(dct_basis(br, out.dtype, out.device), tmp.view(n, br, p.cols), out=out.view(n, br, p.cols))
    return out.view(n, br, p.nc, bc).permute(0, 2, 1, 3)


def _inverse_rows(coeffs: torch.Tensor, p: Any, tmp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Inverse DCT-II, ``D_r^T X D_c``, of block rows of an unpadded matrix whose coefficients ``coeffs`` lie in the
    matrix's own layout (``(rows, br, cols)`` with block ``(r, c)`` at columns ``c * bc ..``), into ``out`` (the
    same rows of the matrix, flat); ``tmp``: scratch of ``coeffs``' size. The same two products as
    :meth:`~quietsync.wire.codecs.BlockLayout.transform` on the stacked blocks, row by row of blocks."""
    br, bc = p.block
    cols = p.cols
    torch.matmul(coeffs.reshape(-1, bc), dct_basis(bc, out.dtype, out.device), out=tmp.view(-1, bc))  # X D_c
    return torch.matmul(dct_basis(br, out.dtype, out.device).T, tmp.view(-1, br, cols), out=out.view(-1, br, cols))


class _Workspace:
    """What :class:`DCTReplicator` keeps across steps for one layout (dtype, device): the layout's tiles, cache-sized
    scratch buffers per block group (``spatial``, ``tmp``, ``coeffs``, ``count``: a tile's blocks), each group's
    picked ``values`` and ``positions`` (``(num_blocks, k)``), a buffer of ones for counting, and the flat
    update."""

    def __init__(self, layout: BlockLayout, ks: Sequence[int], transfer: torch.dtype, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.layout = layout
        self.tiles = layout.tiles(_TILE_ELEMENTS)
        most = [max((t.count for t in self.tiles if t.group == i), default=0) for i in range(len(layout.groups))]
        self._scratch = {name: [torch.empty(m, *g.block_shape, dtype=dtype, device=device)
                                for g, m in zip(layout.groups, most)]
                         for name in ("spatial", "tmp", "coeffs", "count")}
        self.values = [torch.empty(g.num_blocks, k, dtype=transfer, device=device) for g, k in zip(layout.groups, ks)]
        self.positions = [torch.empty(g.num_blocks, k, dtype=index_dtype(g.block_numel), device=device)
                          for g, k in zip(layout.groups, ks)]
        self._ones = torch.empty(0, dtype=dtype, device=device)
        self._update = torch.empty(0, dtype=dtype, device=device)
        self.own_layout = [len(layout.groups[t.group].block_shape) == 2 and all(not p.padded for p, *_ in t.pieces)
                           for t in self.tiles]
        """Per tile: whether the exchange sums its coefficients in its matrices' own layout (unpadded matrices)."""
        self._base = [torch.empty(g.num_blocks, 1, dtype=torch.long, device=device) for g in layout.groups]
        self._stride = [torch.zeros(g.num_blocks, 1, dtype=torch.long, device=device) for g in layout.groups]
        for tile, own in zip(self.tiles, self.own_layout):
            bn = layout.groups[tile.group].block_numel
            for (p, *_rows), (a, b, _) in zip(tile.pieces, _piece_runs(tile)):
                blocks = torch.arange(b - a, device=device)
                where = slice(tile.first + a, tile.first + b)
                if own:  # block (r, c) of the piece starts at row r * br, column c * bc of the piece's rows
                    br, bc = p.block
                    self._base[tile.group][where, 0] = a * bn + blocks // p.nc * br * p.cols + blocks % p.nc * bc
                    self._stride[tile.group][where] = p.cols - bc
                else:
                    self._base[tile.group][where, 0] = (a + blocks) * bn

    def sum_positions(self, group: int, pos: torch.Tensor) -> torch.Tensor:
        """Where each received coefficient of ``group`` is summed in its tile's ``coeffs`` / ``count`` buffers: its
        block's place plus its position (``(num_blocks, m)`` positions inside the blocks, int64; consumed)."""
        width = self.layout.groups[group].block_shape[-1]
        if width & (width - 1) == 0:  # a power of two (the usual chunk): a shift, a third of a division's time
            rows = torch.bitwise_right_shift(pos, width.bit_length() - 1)
        else:
            rows = torch.div(pos, width, rounding_mode="floor")
        return pos.add_(self._base[group]).add_(rows.mul_(self._stride[group]))  # rows: the matrix's longer rows

    def scratch(self, tile: Tile, *names: str) -> list[torch.Tensor]:
        """The named scratch buffers, each ``(tile.count, *block_shape)``."""
        return [self._scratch[name][tile.group][: tile.count] for name in names]

    def ones(self, like: torch.Tensor) -> torch.Tensor:
        """Ones of ``like``'s shape (a view of a kept buffer)."""
        if self._ones.numel() < like.numel():
            self._ones = torch.ones(like.numel(), dtype=self._ones.dtype, device=self._ones.device)
        return self._ones[: like.numel()].view_as(like)

    def update(self, numel: int) -> torch.Tensor:
        """The flat update buffer (reused across steps)."""
        if self._update.numel() != numel:
            self._update = self._update.new_empty(numel)
        return self._update


def _project_padding(layout: BlockLayout, stacked: Sequence[torch.Tensor]) -> None:
    """Make the coefficients of every padded block those of a block whose padding is zero (in place).

    After error feedback in the DCT domain, a padded block's inverse transform is not zero in its padding any
    more; a spatial residual would drop that part. So the edge blocks of padded segments go back to space,
    have their padding zeroed and come forward again -- the same residual a spatial momentum keeps, at the
    cost of two transforms of those edge blocks only.
    """
    for p in layout.placements:
        if not p.padded:
            continue
        blocks = stacked[p.group][p.first : p.first + p.num_blocks]
        bands: list[tuple[torch.Tensor, tuple[slice, ...]]] = []
        if len(p.block) == 1:
            bands.append((blocks[-1:], (slice(None), slice(p.rows - (p.nr - 1) * p.block[0], None))))
        else:
            br, bc = p.block
            grid = blocks.view(p.nr, p.nc, br, bc)
            if p.nr * br != p.rows:  # the last block row: its rows past the tensor's
                bands.append((grid[p.nr - 1], (slice(None), slice(p.rows - (p.nr - 1) * br, None), slice(None))))
            if p.nc * bc != p.cols:  # the last block column
                bands.append((grid[:, p.nc - 1], (slice(None), slice(None), slice(p.cols - (p.nc - 1) * bc, None))))
        for band, padding in bands:
            space = BlockLayout.transform(band, p.block, inverse=True)
            space[padding] = 0
            band.copy_(BlockLayout.transform(space, p.block, inverse=False))
