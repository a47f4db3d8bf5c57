"""``dct``: DeMo's replicator -- top-k DCT-II coefficients per chunk, values and positions, all-gather.

Per step, the momentum of every parameter is cut into ``chunk x chunk`` blocks (``chunk``-long
for vectors; see :class:`~quietsync.codecs.BlockLayout`), each block goes through a DCT-II, and
the ``k`` largest-magnitude coefficients of every block travel with their position inside the
block (``uint8``/``int16``). Because positions differ per worker the payloads cannot be summed:
they are **all-gathered** (one collective, values and positions of all parameters packed into a
single byte buffer), then each coefficient is averaged over the workers that sent it and the
result decoded. The gather grows with the replicate group: each worker receives ``(n-1)`` payloads,
where an all-reduce of ``random``/``striding`` moves ``2(n-1)/n`` of one.

:meth:`DCTReplicator.replicate` runs the step on buffers kept across steps (a
:class:`~quietsync.codecs.BlockWorkspace` per layout): blocks move by strided views of each tensor's own
layout, what was sent is decoded and subtracted from ``delta`` in place (error feedback), and the received
coefficients are summed and counted straight into reused coefficient buffers, divided only where
something arrived and cleared again at those positions only. The values are bit-identical to the
gather-based implementation it replaced (kept as the oracle in ``tests/codecs/reference_dct_codec.py``).

``k`` per block follows from ``compression`` (bytes per coefficient = value + position bytes), or
is fixed by ``topk`` (DeMo's own knob; then ``compression`` is not used).
"""

from __future__ import annotations

from typing import Any

import torch

from ..codecs import (
    BlockLayout,
    BlockWorkspace,
    densify,
    index_dtype,
    nbytes,
    pack,
    scatter_mean,
    topk_per_block,
    unpack,
)
from ..codecs.topk import _flat_positions
from ..transport import Collectives
from ..validate import check_int
from .base import Message, Replicator, Segments


class DCTReplicator(Replicator):
    """DeMo-DCT top-k replication.

    Args:
        chunk: block edge (DeMo's ``compression_chunk``; 64 by default).
        topk: coefficients per block; None derives it from ``compression``.
        (others as :class:`~quietsync.replicators.base.Replicator`)
    """

    name = "dct"
    sends_indices = True
    collective = "all_gather"
    knobs = (*Replicator.knobs, "chunk", "topk")

    def __init__(self, compression: float = 1 / 32, transfer_dtype: Any = "fp32", transport: Collectives | None = None,
                 group: str = "replicate", chunk: int = 64, topk: int | None = None) -> None:
        super().__init__(compression, transfer_dtype, transport, group)
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
            if self.topk is not None:
                k = self.topk
            else:
                per_coeff = self.value_bytes + torch.empty((), dtype=index_dtype(g.block_numel)).element_size()
                k = round(self.compression * g.real * eb / (g.num_blocks * per_coeff))
            out.append(max(1, min(g.block_numel, k)))
        return out

    def _specs(self, segments: Segments, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        specs: list[tuple[tuple[int, ...], torch.dtype]] = []
        for g, k in zip(self.layout(segments).groups, self.ks(segments, dtype)):
            specs.append(((g.num_blocks, k), self.transfer_dtype))
            specs.append(((g.num_blocks, k), index_dtype(g.block_numel)))
        return specs

    def _workspace(self, segments: Segments, delta: torch.Tensor) -> _Workspace:
        key = (segments, str(delta.device), delta.dtype)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = self._workspaces[key] = _Workspace(self.layout(segments, delta.device), delta.dtype, delta.device)
        return ws

    def replicate(self, delta: torch.Tensor, segments: Segments) -> torch.Tensor:
        """:meth:`extract` + error feedback + :meth:`exchange` in one pass over reused buffers (same values)."""
        if delta.dim() != 1 or delta.numel() != segments.numel or self.group_size == 1:
            return super().replicate(delta, segments)
        ws = self._workspace(segments, delta)
        layout = ws.layout
        parts = []
        for i, (g, k, coeffs) in enumerate(zip(layout.groups, self.ks(segments, delta.dtype), ws.encode(delta))):
            vals, pos = topk_per_block(coeffs.reshape(g.num_blocks, g.block_numel), k)
            vals = vals.to(self.transfer_dtype)
            parts += [vals, pos]
            at = _flat_positions(pos, g.block_numel).reshape(-1)
            ws.sent[i].view(-1)[at] = vals.to(delta.dtype).reshape(-1)
            ws.sent_at[i] = at
        ws.decode_into(ws.sent_blocks(), delta, subtract=True)  # delta <- delta - decode(sent)
        for i, at in enumerate(ws.sent_at):
            ws.sent[i].view(-1)[at] = 0
        payload = pack(parts)
        n = self.group_size
        gathered = payload.new_empty(n * payload.numel())
        self.transport.all_gather(gathered, payload, self.group, name="replicate/dct")
        tensors = unpack(gathered.reshape(n, -1), self._specs(segments, delta.dtype))
        for i, g in enumerate(layout.groups):
            vals, pos = tensors[2 * i], tensors[2 * i + 1]
            at = _flat_positions(pos, g.block_numel).reshape(-1)
            total, count = ws.sent[i].view(-1), ws.count[i].view(-1)
            total.index_add_(0, at, vals.reshape(-1).to(delta.dtype))
            count.index_add_(0, at, ws.ones(at.numel()))
            total[at] = total[at] / count[at]  # the mean over the workers that sent it; 0 where none did
            ws.sent_at[i] = at
        update = delta.new_empty(delta.numel())
        ws.decode_into(ws.sent_blocks(), update)
        for i, at in enumerate(ws.sent_at):
            ws.sent[i].view(-1)[at] = 0
            ws.count[i].view(-1)[at] = 0
        return update

    def extract(self, delta: torch.Tensor, segments: Segments) -> Message:
        layout = self.layout(segments, delta.device)
        parts, dense = [], []
        for g, k, coeffs in zip(layout.groups, self.ks(segments, delta.dtype), layout.encode(delta)):
            vals, pos = topk_per_block(coeffs.reshape(g.num_blocks, g.block_numel), k)
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
        for i, g in enumerate(layout.groups):
            vals, pos = tensors[2 * i], tensors[2 * i + 1]
            mean = scatter_mean(vals, pos, g.block_numel, dtype=msg.sent.dtype)
            coeffs.append(mean.reshape(g.num_blocks, *g.block_shape))
        return layout.decode(coeffs)

    def payload_bytes(self, segments: Segments, dtype: torch.dtype = torch.float32) -> int:
        return sum(nbytes(shape, dt) for shape, dt in self._specs(segments, dtype))


class _Workspace(BlockWorkspace):
    """A :class:`BlockWorkspace` plus the sparse-coefficient buffers of :meth:`DCTReplicator.replicate`.

    ``sent`` (per group, ``(num_blocks, block_numel)``) holds what this worker sends, then the sum of what
    arrived; ``count`` how many workers sent each coefficient. Both are zero between steps: only the
    positions written (``sent_at``) are cleared, never the whole buffer.
    """

    def __init__(self, layout: BlockLayout, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(layout, dtype, device)
        self.sent = [torch.zeros(g.num_blocks, g.block_numel, dtype=dtype, device=device) for g in layout.groups]
        self.count = [torch.zeros(g.num_blocks, g.block_numel, dtype=dtype, device=device) for g in layout.groups]
        self.sent_at: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long, device=device) for _ in layout.groups]
        self._ones = torch.ones(0, dtype=dtype, device=device)

    def sent_blocks(self) -> list[torch.Tensor]:
        return [s.view(g.num_blocks, *g.block_shape) for g, s in zip(self.layout.groups, self.sent)]

    def ones(self, n: int) -> torch.Tensor:
        if self._ones.numel() < n:
            self._ones = self._ones.new_ones(n)
        return self._ones[:n]
