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
:meth:`DCTReplicator.accumulate` adds the transformed gradient (``C <- beta C + s DCT(g)``, the last product writing
the sum),
:meth:`DCTReplicator.extract_momentum` picks the top-k straight from ``C``, does error feedback by zeroing what
was sent (keeping what the transfer cast lost) and projects the edge blocks of padded tensors back onto blocks
that are zero in their padding (so the residual is exactly the one a spatial momentum keeps), and
:meth:`DCTReplicator.exchange_momentum` all-gathers, sums and counts the received coefficients and decodes their
mean with one inverse transform (an unpadded matrix's sums lie in its own layout, so the decode writes the update
where it lies; ``sign=True``: the mean's sign, taken while a tile is in cache): two transforms a step where a
spatial momentum needs three (encode, decode what was sent, decode the mean). Each works through the stacked
coefficients in tiles of :data:`_TILE_ELEMENTS` (:meth:`~quietsync.wire.codecs.BlockLayout.tiles`), so a tile's
blocks, magnitudes, sums and counts stay in cache and nothing model-sized is written besides the momentum and the
update; each tile's views of the buffers it works on are made once per layout (:class:`_TilePlan`), not per step.
:meth:`DCTReplicator.replicate`
is the spatial entry point (DiLoCo's pseudo-gradients): it converts, steps and converts back. The fp64 oracle
written from paper 001 (``tests/strategies/helpers/reference_demo.py``) agrees up to fp32 rounding; the top-k may
pick other positions only among coefficients of equal magnitude (:func:`~quietsync.wire.codecs.topk_picks`).

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
    topk_picks,
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
        transformed where it lies (:func:`_accumulate_rows`: its block rows' ``D_r B`` in one product, then each
        block's ``D_c`` product adds ``beta * C + scale * ...`` into the coefficients in the same call)."""
        ws = self._workspace(segments, momentum)
        layout = ws.layout
        for tile, plan, mine in zip(ws.tiles, ws.plans, ws.momentum_views(momentum)):
            shape = layout.groups[tile.group].block_shape
            if plan.in_place and all(_in_place(grads[piece.index], momentum.dtype) for piece in plan.pieces):
                for piece, target in zip(plan.pieces, mine.targets):
                    _accumulate_rows(piece.mats_of(grads[piece.index]), piece, target, betas[piece.index],
                                     scales[piece.index])
            else:
                layout.tile_gather(tile, grads, plan.spatial)  # through the blocks' own layout
                BlockLayout.transform(plan.spatial, shape, inverse=False, out=plan.coeffs, tmp=plan.tmp)
                new = [plan.coeffs[piece.a : piece.b].view(target.shape)
                       for piece, target in zip(plan.pieces, mine.targets)]
                for piece, target, c in zip(plan.pieces, mine.targets, new):
                    if betas[piece.index] != 1.0:
                        target.mul_(betas[piece.index])
                    target.add_(c, alpha=scales[piece.index])

    def momentum_from_spatial(self, delta: torch.Tensor, segments: Segments) -> torch.Tensor:
        coeffs = self.layout(segments, delta.device).encode(delta)
        # no blocks (every segment empty): torch.cat refuses an empty list
        return torch.cat([c.reshape(-1) for c in coeffs]) if coeffs else delta.new_zeros(0)

    def momentum_to_spatial(self, momentum: torch.Tensor, segments: Segments) -> torch.Tensor:
        layout = self.layout(segments, momentum.device)
        if not layout.groups:  # no blocks: decode's empty result would be a CPU tensor
            return momentum.new_zeros(segments.numel)
        return layout.decode(layout.stacked_views(momentum))

    def replicate(self, delta: torch.Tensor, segments: Segments) -> torch.Tensor:
        """The spatial entry point: ``delta`` into the DCT domain, :meth:`replicate_momentum`, and the residual
        back (three transforms; a decoupled optimizer keeps its momentum in the DCT domain and needs two)."""
        alone = self._alone(delta, segments)
        if alone is not None:
            return alone
        momentum = self.momentum_from_spatial(delta, segments)
        # the update is the workspace's buffer, rewritten by the next step: the spatial caller gets its own
        update = self.replicate_momentum(momentum, segments).clone()
        delta.copy_(self.momentum_to_spatial(momentum, segments))
        for ws in self._workspaces.values():  # this momentum was for one step only: its views need not keep it
            ws.forget_momentum()
        return update

    def extract_momentum(self, momentum: torch.Tensor, segments: Segments) -> Message:
        """Top-k per block of the coefficients ``momentum``, removed from it (error feedback: the sent coefficients
        are zeroed -- minus what the transfer cast or quantization loses -- and padded blocks projected back onto
        tensors that are zero in their padding); the message holds the packed payload (values and positions of
        every block group) and its specs. Run by run (a few tiles); the selection writes no magnitudes
        (:func:`~quietsync.wire.codecs.topk_picks`)."""
        layout = self.layout(segments, momentum.device)
        if momentum.dim() != 1 or momentum.numel() != layout.stacked_numel:
            raise ValueError(f"momentum must be flat with {layout.stacked_numel} elements, got shape "
                             f"{tuple(momentum.shape)}")
        if self.group_size == 1:
            return self._keep_all(momentum, segments)
        ws = self._workspace(segments, momentum)
        ks = self.ks(segments, momentum.dtype)
        stacked = layout.stacked_views(momentum)
        for run, c2 in zip(ws.runs, ws.run_blocks(momentum)):
            pos, vals = topk_picks(c2, ks[run.group])
            run.positions.copy_(pos)
            if self.lowbit is not None:  # quantized below, a whole group at once
                run.values.copy_(vals)
                continue
            sent = vals.to(self.transfer_dtype)
            c2.scatter_(1, pos, vals - sent.to(vals.dtype))  # error feedback: 0 in fp32, the cast's loss
            run.values.copy_(sent)
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
        the mean with one inverse transform, tile by tile (counts and sums in cache: each value is divided by its
        coefficient's count before it is summed, and both are zeroed again only where something arrived: a few
        percent of a tile). A tile of
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
                # one row per block, every worker's k values side by side: a tile then takes its blocks' rows
                vals = self._values_of(tensors[2 * i], g, k).permute(1, 0, 2).reshape(g.num_blocks, n * k)
                pos = tensors[2 * i + 1].permute(1, 0, 2).reshape(g.num_blocks, n * k).long()
                received.append((vals.to(dtype), ws.sum_positions(i, pos)))
            update = ws.update(segments.numel)
            ws.zero_sums()  # the sums and counts are zero between tiles (left so only by a step that finished)
            for tile, plan, out in zip(ws.tiles, ws.plans, ws.update_views(update)):
                g = layout.groups[tile.group]
                vals, at = (x[tile.first : tile.first + tile.count].reshape(-1) for x in received[tile.group])
                sums, counts = plan.flat_sums, plan.flat_count
                # the mean over who sent it: each value divided by its coefficient's count, then summed -- work on
                # what arrived only (a few percent of the tile), where dividing every sum by its count clamped to 1
                # is three passes over it
                counts.scatter_add_(0, at, ws.ones(vals))
                sums.scatter_add_(0, at, vals / counts.index_select(0, at))
                if plan.own_layout:  # decoded straight into the update, in each matrix's own layout
                    for piece, rows in zip(plan.pieces, out):
                        _inverse_rows(piece, rows)
                        if sign:  # while it is in cache
                            rows.sign_()
                else:
                    BlockLayout.transform(plan.sums, g.block_shape, inverse=True, out=plan.spatial, tmp=plan.tmp)
                    layout.tile_scatter(tile, plan.spatial.sign_() if sign else plan.spatial, update)
                sums.index_fill_(0, at, 0.0)  # zero again where written, for the next tile
                counts.scatter_add_(0, at, ws.ones(vals, -1.0))  # (whole counts: exactly 0; faster than a fill)
            ws.sums_zero = True
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
            vals = vals.to(self.transfer_dtype)  # sent decodes these: the residual keeps the cast's loss
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


_RUN_ELEMENTS = 2**20
"""Elements of the momentum whose top-k the extract picks in one call (a few tiles: measured on the 10m model,
2**20 against one tile of 2**18, about 2 ms a step less NumPy overhead)."""


def _piece_runs(tile: Tile) -> list[tuple[int, int, int]]:
    """``(start, stop, segment)``: the tile's blocks of each piece, with the segment they belong to."""
    out, at = [], 0
    for p, r0, r1 in tile.pieces:
        n = (r1 - r0) * p.nc
        out.append((at, at + n, p.index))
        at += n
    return out


def _in_place(grad: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`_accumulate_rows` takes an unpadded matrix's gradient where it lies."""
    # mats_of views the gradient as it lies, and the products pair it with bases and scratch of the momentum's dtype
    return grad.dtype == dtype and grad.is_contiguous()


def _accumulate_rows(mats: torch.Tensor, piece: _Piece, target: torch.Tensor, beta: float, scale: float) -> None:
    """``C <- beta * C + scale * D_r B D_c^T`` for the blocks of ``piece`` (block rows of an unpadded matrix), from the
    gradient's rows ``mats`` (``(n, br, cols)``, the matrix's own layout) into their coefficients ``target``
    (``(n, nc, br, bc)``, stacked blocks). ``D_r B`` goes into the piece's ``tmp`` scratch in one product; each block
    row's ``D_c`` products read its blocks out of that layout (a strided batch) and write ``beta * C + scale * ...``
    in the same call, so the coefficients are read and written once, not by a product and two passes after it."""
    torch.matmul(piece.d_rows, mats, out=piece.tmp_mats)  # D_r B
    for row, blocks in zip(target, piece.tmp_blocks):
        row.baddbmm_(blocks, piece.d_cols_t_batch, beta=beta, alpha=scale)


def _inverse_rows(piece: _Piece, out: torch.Tensor) -> torch.Tensor:
    """Inverse DCT-II, ``D_r^T X D_c``, of the piece's summed coefficients (its ``sums`` scratch, in the matrix's own
    layout: ``(rows, br, cols)`` with block ``(r, c)`` at columns ``c * bc ..``) into ``out`` (the same rows of the
    matrix, viewed ``(-1, br, cols)``). The same two products as :meth:`~quietsync.wire.codecs.BlockLayout.transform`
    on the stacked blocks, row by row of blocks."""
    torch.matmul(piece.sum_rows, piece.d_cols, out=piece.tmp_rows)  # X D_c
    return torch.matmul(piece.d_rows_t, piece.tmp_mats, out=out)


class _Piece:
    """Block rows ``r0 .. r1`` of one segment in a tile -- the tile's blocks ``a .. b`` -- with the views of the
    workspace's scratch that the step's loops use, made once: a view costs microseconds of dispatch, and a step
    over every tile would otherwise make thousands.

    ``coeffs`` are the piece's blocks in the ``coeffs`` scratch, stacked ``(blocks, *block)`` (for an unpadded matrix
    ``(n, nc, br, bc)``, the shape its coefficients are read in). For an unpadded matrix also: ``grad_rows`` (its
    rows of the gradient viewed ``(-1, bc)``), ``span`` (its elements in the flat update), the ``tmp`` scratch as rows
    ``(-1, bc)``, as matrices ``(n, br, cols)`` and as each block row's blocks ``(nc, br, bc)`` (``tmp_blocks``), the
    ``sums`` scratch in the matrix's layout, and the DCT bases ``D_c``, ``D_r``, ``D_r^T`` (``d_cols``, ``d_rows``,
    ``d_rows_t``) and ``D_c^T`` once per block of a row (``d_cols_t_batch``, ``(nc, bc, bc)``, not copied).
    """

    __slots__ = ("index", "a", "b", "coeffs", "grad_rows", "span", "shape", "tmp_rows", "tmp_mats", "tmp_blocks",
                 "sum_rows", "d_cols", "d_cols_t_batch", "d_rows", "d_rows_t")

    def __init__(self, p: Any, r0: int, r1: int, a: int, b: int, scratch: dict[str, torch.Tensor],
                 in_place: bool) -> None:
        self.index, self.a, self.b = p.index, a, b
        if not in_place:
            self.coeffs = scratch["coeffs"][a:b]
            return
        br, bc = p.block
        n = r1 - r0
        tmp, coeffs, sums = (scratch[name][a:b] for name in ("tmp", "coeffs", "sums"))
        self.grad_rows = slice(r0 * br * p.nc, r1 * br * p.nc)
        self.span = slice(p.offset + r0 * br * p.cols, p.offset + r1 * br * p.cols)
        self.shape = (n, br, p.cols)
        self.tmp_rows = tmp.view(-1, bc)
        self.tmp_mats = tmp.view(n, br, p.cols)
        self.tmp_blocks = list(tmp.view(n, br, p.nc, bc).permute(0, 2, 1, 3))
        self.coeffs = coeffs.view(n, p.nc, br, bc)
        self.sum_rows = sums.reshape(-1, bc)
        self.d_cols, self.d_rows = dct_basis(bc, tmp.dtype, tmp.device), dct_basis(br, tmp.dtype, tmp.device)
        self.d_rows_t = self.d_rows.T  # a transposed view, as the products always took
        self.d_cols_t_batch = self.d_cols.T.expand(p.nc, bc, bc)

    def mats_of(self, grad: torch.Tensor) -> torch.Tensor:
        """The piece's rows of its (contiguous) matrix ``grad``, viewed ``(n, br, cols)``."""
        return grad.view(-1, self.tmp_rows.shape[1])[self.grad_rows].view(self.shape)


class _TilePlan:
    """One tile's views of the workspace's buffers, made once (see :class:`_Piece`): its scratch (``spatial``, ``tmp``,
    ``coeffs``, ``sums``, ``count``: ``(count, *block_shape)``; ``flat_sums``, ``flat_count`` flat), its pieces,
    whether its pieces are all unpadded matrices (``in_place``: transformed where they lie) and whether the exchange
    sums its coefficients in its matrices' own layout (``own_layout``)."""

    def __init__(self, tile: Tile, scratch: dict[str, torch.Tensor], own_layout: bool) -> None:
        self.spatial, self.tmp, self.coeffs, self.sums, self.count = (
            scratch[name] for name in ("spatial", "tmp", "coeffs", "sums", "count"))
        self.flat_sums, self.flat_count = self.sums.view(-1), self.count.view(-1)
        self.own_layout = self.in_place = own_layout
        self.pieces = [_Piece(p, r0, r1, a, b, scratch, own_layout)
                       for (p, r0, r1), (a, b, _) in zip(tile.pieces, _piece_runs(tile))]


class _Run:
    """Consecutive blocks ``first .. first + count`` of group ``group`` -- a few tiles -- whose top-k the extract
    picks in one go (the selection is row by row, so a run gives each row what its tile would; fewer, larger calls
    cost less NumPy overhead), with its rows of the group's ``values`` and ``positions``."""

    def __init__(self, group: int, first: int, count: int, values: torch.Tensor, positions: torch.Tensor) -> None:
        self.group, self.first, self.count = group, first, count
        rows = slice(first, first + count)
        self.values, self.positions = values[rows], positions[rows]


def _runs(tiles: Sequence[Tile], block_numels: Sequence[int], max_elements: int) -> list[tuple[int, int, int]]:
    """``(group, first, count)``: consecutive tiles of one group merged while they hold at most ``max_elements``."""
    out: list[tuple[int, int, int]] = []
    for t in tiles:
        if out and out[-1][0] == t.group and (out[-1][2] + t.count) * block_numels[t.group] <= max_elements:
            group, first, count = out[-1]
            out[-1] = (group, first, count + t.count)
        else:
            out.append((t.group, t.first, t.count))
    return out


class _MomentumViews:
    """One tile's views of the momentum: its blocks ``(count, block_numel)`` and, per piece, its blocks shaped as the
    piece's ``coeffs``."""

    def __init__(self, blocks: torch.Tensor, plan: _TilePlan) -> None:
        self.blocks = blocks.view(blocks.shape[0], -1)
        self.targets = [blocks[piece.a : piece.b].view(piece.coeffs.shape) for piece in plan.pieces]


class _Workspace:
    """What :class:`DCTReplicator` keeps across steps for one layout (dtype, device): the layout's tiles, cache-sized
    scratch buffers per block group (``spatial``, ``tmp``, ``coeffs``, and ``sums``, ``count``, which the exchange keeps
    zero between tiles: a tile's blocks), each group's picked ``values`` and ``positions`` (``(num_blocks, k)``),
    buffers of ones and minus ones for counting, the flat update, each tile's views (``plans``, :class:`_TilePlan`),
    the extract's ``runs`` (:class:`_Run`) and the views of the last momentum and update it was given."""

    def __init__(self, layout: BlockLayout, ks: Sequence[int], transfer: torch.dtype, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.layout = layout
        self.tiles = layout.tiles(_TILE_ELEMENTS)
        # scratch sized for each group's largest tile; every tile's plan takes a prefix of it
        most = [max((t.count for t in self.tiles if t.group == i), default=0) for i in range(len(layout.groups))]
        self._scratch = {name: [torch.empty(m, *g.block_shape, dtype=dtype, device=device)
                                for g, m in zip(layout.groups, most)]
                         for name in ("spatial", "tmp", "coeffs", "sums", "count")}
        self.sums_zero = False  # torch.empty: the first exchange zeroes them
        """Whether ``sums`` and ``count`` are all zero (the exchange leaves them so, zeroing only what it wrote)."""
        self.values = [torch.empty(g.num_blocks, k, dtype=transfer, device=device) for g, k in zip(layout.groups, ks)]
        self.positions = [torch.empty(g.num_blocks, k, dtype=index_dtype(g.block_numel), device=device)
                          for g, k in zip(layout.groups, ks)]
        self._ones = self._minus_ones = torch.empty(0, dtype=dtype, device=device)
        self._update = torch.empty(0, dtype=dtype, device=device)
        self.own_layout = [len(layout.groups[t.group].block_shape) == 2 and all(not p.padded for p, *_ in t.pieces)
                           for t in self.tiles]
        """Per tile: whether the exchange sums its coefficients in its matrices' own layout (unpadded matrices)."""
        self.plans = [_TilePlan(t, {name: bufs[t.group][: t.count] for name, bufs in self._scratch.items()}, own)
                      for t, own in zip(self.tiles, self.own_layout)]
        runs = _runs(self.tiles, [g.block_numel for g in layout.groups], _RUN_ELEMENTS)
        self.runs = [_Run(g, first, count, self.values[g], self.positions[g]) for g, first, count in runs]
        self._momentum: tuple[torch.Tensor | None, list[_MomentumViews]] = (None, [])
        self._run_views: list[torch.Tensor] = []
        self._update_views: tuple[torch.Tensor | None, list[list[torch.Tensor]]] = (None, [])
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
                    self._stride[tile.group][where] = p.cols - bc  # a block's next row starts cols on, not bc
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

    def zero_sums(self) -> None:
        """Make ``sums`` and ``count`` zero (at once, unless the last exchange left them so) and mark them in use."""
        if not self.sums_zero:
            for name in ("sums", "count"):
                for buffer in self._scratch[name]:
                    buffer.zero_()
        self.sums_zero = False  # until the exchange has zeroed what it wrote (an error on the way leaves it False)

    def momentum_views(self, momentum: torch.Tensor) -> list[_MomentumViews]:
        """Each tile's views of the flat ``momentum``, made again only for another tensor than the last one (a
        decoupled optimizer passes its own buffer every step; :meth:`forget_momentum` lets a passing one go)."""
        kept, views = self._momentum
        if kept is not momentum:
            stacked = self.layout.stacked_views(momentum)
            views = [_MomentumViews(stacked[t.group][t.first : t.first + t.count], plan)
                     for t, plan in zip(self.tiles, self.plans)]
            self._momentum = (momentum, views)
            self._run_views = [stacked[r.group][r.first : r.first + r.count].view(r.count, -1) for r in self.runs]
        return views

    def run_blocks(self, momentum: torch.Tensor) -> list[torch.Tensor]:
        """Each :class:`_Run`'s blocks of the flat ``momentum``, ``(count, block_numel)`` (kept as
        :meth:`momentum_views` keeps its views)."""
        self.momentum_views(momentum)
        return self._run_views

    def forget_momentum(self) -> None:
        """Drop the views of the last momentum (and with them that buffer)."""
        self._momentum, self._run_views = (None, []), []

    def update_views(self, update: torch.Tensor) -> list[list[torch.Tensor]]:
        """Per tile, per piece of an unpadded matrix, its rows of the flat ``update`` viewed ``(n, br, cols)`` (made
        again only for another buffer)."""
        kept, views = self._update_views
        if kept is not update:
            views = [[update[piece.span].view(piece.shape) for piece in plan.pieces] if plan.own_layout else []
                     for plan in self.plans]
            self._update_views = (update, views)
        return views

    def ones(self, like: torch.Tensor, value: float = 1.0) -> torch.Tensor:
        """``value`` (1 or -1) in ``like``'s shape (a view of a kept buffer)."""
        if self._ones.numel() < like.numel():
            self._ones = torch.ones(like.numel(), dtype=self._ones.dtype, device=self._ones.device)
            self._minus_ones = -self._ones
        return (self._ones if value == 1.0 else self._minus_ones)[: like.numel()].view_as(like)

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
