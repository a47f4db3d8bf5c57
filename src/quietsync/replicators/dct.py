"""``dct``: DeMo's replicator -- top-k DCT-II coefficients per chunk, values and positions, all-gather.

Per step, the momentum of every parameter is cut into ``chunk x chunk`` blocks (``chunk``-long
for vectors; see :class:`~quietsync.codecs.BlockLayout`), each block goes through a DCT-II, and
the ``k`` largest-magnitude coefficients of every block travel with their position inside the
block (``uint8``/``int16``). Because positions differ per worker the payloads cannot be summed:
they are **all-gathered** (one collective, values and positions of all parameters packed into a
single byte buffer), then each coefficient is averaged over the workers that sent it and the
result decoded. The gather grows with the replicate group: each worker receives ``(n-1)`` payloads,
where an all-reduce of ``random``/``striding`` moves ``2(n-1)/n`` of one.

``k`` per block follows from ``compression`` (bytes per coefficient = value + position bytes), or
is fixed by ``topk`` (DeMo's own knob; then ``compression`` is not used).
"""

from __future__ import annotations

from typing import Any

import torch

from ..codecs import BlockLayout, densify, index_dtype, nbytes, pack, scatter_mean, topk_per_block, unpack
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
