"""Pack tensors of mixed dtypes into one byte buffer, so a step needs one collective.

DeMo's payload is values (transfer dtype) plus positions (uint8/int16/int32) for every block
group; :func:`pack` lays them end to end as ``uint8`` and :func:`unpack` reads them back from a
``(workers, nbytes)`` gathered buffer without copying more than once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["pack", "unpack", "nbytes"]


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate the raw bytes of ``tensors`` into one contiguous ``uint8`` tensor."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)  # torch.cat refuses an empty list


def unpack(
    buf: torch.Tensor, specs: Sequence[tuple[Sequence[int], torch.dtype]]
) -> list[torch.Tensor]:
    """Inverse of :func:`pack` for a ``(workers, nbytes)`` buffer: tensors ``(workers, *shape)``."""
    if buf.dim() == 1:
        buf = buf.unsqueeze(0)
    workers = buf.shape[0]
    out, at = [], 0
    for shape, dtype in specs:
        n = nbytes(shape, dtype)
        size = torch.empty((), dtype=dtype).element_size()
        piece = buf[:, at : at + n].reshape(-1)  # the workers' rows end to end (a copy when they are apart)
        if (piece.storage_offset() * piece.element_size()) % size:
            piece = piece.clone()  # its bytes aligned for view(dtype)
        out.append(piece.view(dtype).reshape(workers, *shape))
        at += n
    if at != buf.shape[1]:
        raise ValueError(f"buffer holds {buf.shape[1]} bytes per worker, specs describe {at}")
    return out
