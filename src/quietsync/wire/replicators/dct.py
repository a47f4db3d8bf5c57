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
:meth:`DCTReplicator.accumulate` adds the transformed gradient (``C <- beta C + s DCT(g)``, one batched
transform per block shape), and :meth:`DCTReplicator.replicate_momentum` picks the top-k straight from ``C``,
does error feedback by zeroing what was sent (keeping what the transfer cast lost), projects the edge blocks
of padded tensors back onto blocks that are zero in their padding (so the residual is exactly the one a
spatial momentum keeps), all-gathers, sums and counts the received coefficients into reused buffers and
decodes their mean with one inverse transform: two transforms a step where a spatial momentum needs three
(encode, decode what was sent, decode the mean). :meth:`DCTReplicator.replicate` is the spatial entry point
(DiLoCo's pseudo-gradients): it converts, steps and converts back. The fp64 oracle written from paper 001
(``tests/strategies/helpers/reference_demo.py``) agrees up to fp32 rounding; the top-k may pick other positions only
among coefficients of equal magnitude (:func:`~quietsync.wire.codecs.topk_positions`).

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

from ...transport import Collectives
from ...validate import check_int
from ..codecs import (
    BlockLayout,
    BlockWorkspace,
    densify,
    index_dtype,
    nbytes,
    pack,
    scatter_mean,
    topk_per_block,
    topk_positions,
    unpack,
)
from .base import Message, Replicator, Segments, _equal_runs


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
            ws = self._workspaces[key] = _Workspace(self.layout(segments, delta.device), delta.dtype, delta.device)
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
        """``C <- beta * C + scale * DCT(g)``: the gradient goes through one batched transform per block shape."""
        ws = self._workspace(segments, momentum)
        layout = ws.layout
        layout.gather_blocks(list(grads), ws.blocks)
        for g, b, c, t in zip(layout.groups, ws.blocks, ws.coeffs, ws.tmp):
            BlockLayout.transform(b, g.block_shape, inverse=False, out=c, tmp=t)
        if len(set(zip(betas, scales))) <= 1:  # one rule for all: whole stacked buffers
            mine, new = layout.stacked_views(momentum), ws.coeffs
            runs = [(0, len(mine), betas[0] if betas else 1.0, scales[0] if scales else 1.0)]
        else:
            mine = layout.segment_blocks(layout.stacked_views(momentum))
            new = layout.segment_blocks(ws.coeffs)
            runs = [(a, b, betas[a], scales[a]) for a, b in _equal_runs(betas, scales)]
        for a, b, beta, scale in runs:
            if beta != 1.0:
                torch._foreach_mul_(mine[a:b], beta)
            torch._foreach_add_(mine[a:b], new[a:b], alpha=scale)

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
        if delta.dim() != 1 or delta.numel() != segments.numel or self.group_size == 1:
            return super().replicate(delta, segments)
        momentum = self.momentum_from_spatial(delta, segments)
        update = self.replicate_momentum(momentum, segments).clone()
        delta.copy_(self.momentum_to_spatial(momentum, segments))
        return update

    def replicate_momentum(self, momentum: torch.Tensor, segments: Segments) -> torch.Tensor:
        """One step on the coefficients ``momentum``: top-k per block, error feedback (the sent coefficients
        are zeroed -- minus what the transfer cast loses -- and padded blocks projected back onto tensors that
        are zero in their padding), all-gather, the per-coefficient mean, one inverse transform.

        The update is a buffer of the replicator's, valid until its next step (a fresh 40 MB tensor per step
        costs more in page faults than the transform that fills it)."""
        layout = self.layout(segments, momentum.device)
        if momentum.dim() != 1 or momentum.numel() != layout.stacked_numel:
            raise ValueError(f"momentum must be flat with {layout.stacked_numel} elements, got shape "
                             f"{tuple(momentum.shape)}")
        if self.group_size == 1:
            update = self.momentum_to_spatial(momentum, segments)
            momentum.zero_()
            return update
        ws = self._workspace(segments, momentum)
        parts = []
        for g, k, c, mag in zip(layout.groups, self.ks(segments, momentum.dtype), layout.stacked_views(momentum),
                                ws.mag):
            c2 = c.view(g.num_blocks, g.block_numel)
            pos = topk_positions(c2, k, scratch=mag)
            vals = torch.gather(c2, 1, pos)
            if self.lowbit is not None:
                sent, own = self.encode_values(vals.reshape(-1), k)
                c2.scatter_(1, pos, vals - own.view_as(vals))  # error feedback: what quantization lost
            else:
                sent = vals.to(self.transfer_dtype)
                c2.scatter_(1, pos, vals - sent.to(vals.dtype))  # error feedback: 0 in fp32, the cast's loss
            parts += [sent, pos.to(index_dtype(g.block_numel))]
        _project_padding(layout, layout.stacked_views(momentum))
        payload = pack(parts)
        n = self.group_size
        gathered = payload.new_empty(n * payload.numel())
        self.transport.all_gather(gathered, payload, self.group, name="replicate/dct")
        tensors = unpack(gathered.reshape(n, -1), self._specs(segments, momentum.dtype))
        for i, (g, k) in enumerate(zip(layout.groups, self.ks(segments, momentum.dtype))):
            vals = self._values_of(tensors[2 * i], g, k).permute(1, 0, 2).reshape(g.num_blocks, n * k)
            vals = vals.to(momentum.dtype)
            pos = tensors[2 * i + 1].permute(1, 0, 2).reshape(g.num_blocks, n * k).long()
            total, count = ws.sent[i], ws.count[i]
            total.scatter_add_(1, pos, vals)  # worker by worker, as the reference's index_add_
            count.scatter_add_(1, pos, torch.ones_like(vals))
            total.scatter_(1, pos, total.gather(1, pos) / count.gather(1, pos))  # mean over who sent it
        update = ws.update(segments.numel)
        ws.decode_into(ws.sent_blocks(), update)
        for total, count in zip(ws.sent, ws.count):
            total.zero_()
            count.zero_()
        return update

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


class _Workspace(BlockWorkspace):
    """A :class:`BlockWorkspace` plus the buffers of :meth:`DCTReplicator.replicate_momentum`, all
    ``(num_blocks, block_numel)`` per group: ``mag`` (magnitudes for top-k), ``sent`` (the sum of what arrived,
    then the mean) and ``count`` (how many workers sent each coefficient); ``sent`` and ``count`` are zero
    between steps."""

    def __init__(self, layout: BlockLayout, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(layout, dtype, device)
        def zeros() -> list[torch.Tensor]:
            return [torch.zeros(g.num_blocks, g.block_numel, dtype=dtype, device=device) for g in layout.groups]
        self.mag, self.sent, self.count = zeros(), zeros(), zeros()
        self._update = torch.empty(0, dtype=dtype, device=device)

    def update(self, numel: int) -> torch.Tensor:
        """The flat update buffer (reused across steps)."""
        if self._update.numel() != numel:
            self._update = self._update.new_empty(numel)
        return self._update

    def sent_blocks(self) -> list[torch.Tensor]:
        return [s.view(g.num_blocks, *g.block_shape) for g, s in zip(self.layout.groups, self.sent)]


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
