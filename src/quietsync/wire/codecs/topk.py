"""Top-k per block, with indices in the smallest integer dtype that holds them.

DeMo sends, per DCT block, the ``k`` coefficients of largest magnitude and their position inside
the block. Positions are ``< block_numel`` (``<= chunk**2``), so they travel as ``uint8``
(blocks up to 256 elements), ``int16`` (up to 32768) or ``int32`` -- a quarter to a half of the
bytes of ``int64``. :func:`topk_positions` picks them: on CPU (fp32/fp64) with NumPy's introselect
(``np.argpartition``), about twice as fast as ``torch.topk`` on 64x64 blocks here (which copies every row
into a vector of (value, index) pairs first), elsewhere with ``torch.topk``. Both return a set of ``k``
largest magnitudes; only among entries of *equal* magnitude at the k-th place may the two pick different
positions (e.g. a block of zeros). :func:`scatter_mean` is the receiving side: it averages each coefficient over
the workers that actually sent it (a coefficient only one worker picked is not diluted by the
others' implicit zeros), exactly as the DeMo reference's ``batch_decompress`` does.
"""

from __future__ import annotations

import numpy as np
import torch

from ...validate import check_int

__all__ = ["index_dtype", "topk_positions", "topk_per_block", "scatter_mean", "densify"]

_ROWS_ELEMENTS = 2**20
"""Elements of ``x`` per NumPy call: its int64 index array (8 MiB) stays below the size glibc maps afresh
(and faults in page by page) on every allocation."""


def index_dtype(block_numel: int) -> torch.dtype:
    """Smallest integer dtype holding every position ``0 .. block_numel - 1``."""
    if block_numel <= 256:
        return torch.uint8
    if block_numel <= 2**15:
        return torch.int16
    if block_numel <= 2**31:
        return torch.int32
    return torch.int64


def topk_positions(x: torch.Tensor, k: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Positions (``int64``, ``(blocks, k)``, in no particular order) of the ``k`` largest-magnitude
    entries of each row of ``x`` (``(blocks, block_numel)``); NaN counts as largest.

    ``scratch`` (``x``'s shape, dtype and device) receives ``|x|`` when given, so a caller that steps
    repeatedly reuses one buffer.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be (blocks, block_numel), got shape {tuple(x.shape)}")
    n = x.shape[1]
    check_int("k", k, 1, n)  # at most the block size
    if k == n:
        return torch.arange(n, device=x.device).expand(x.shape[0], n)
    mag = torch.abs(x, out=scratch) if scratch is not None else x.abs()
    if mag.device.type == "cpu" and mag.dtype in (torch.float32, torch.float64) and x.shape[0] > 0:
        pos = torch.empty(x.shape[0], k, dtype=torch.long)
        arr, out = mag.detach().numpy(), pos.numpy()
        rows = max(1, _ROWS_ELEMENTS // n)  # argpartition returns a full index array: keep it small and reused
        for start in range(0, x.shape[0], rows):
            out[start : start + rows] = np.argpartition(arr[start : start + rows], n - k, axis=1)[:, n - k:]
        return pos
    return mag.topk(k, dim=1, sorted=False).indices


def topk_per_block(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` largest-magnitude entries of each row of ``x`` (shape ``(blocks, block_numel)``).

    Returns ``(values, positions)``, both ``(blocks, k)``; positions in :func:`index_dtype`
    (chosen by :func:`topk_positions`).
    """
    pos = topk_positions(x, k)
    return torch.gather(x, 1, pos), pos.to(index_dtype(x.shape[1]))


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
