"""The initial broadcast: replicas start identical because rank 0's parameters win, as in DDP (a part)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...transport import Transport


def broadcast_parameters(transport: Transport, tensors: Sequence[torch.Tensor], group: str = "world") -> None:
    """Overwrite ``tensors`` with group rank 0's values, in one collective (nothing happens in a group of
    one).

    One contiguous tensor is broadcast in place; several are packed into one buffer first.
    """
    if transport.group_size(group) == 1 or not tensors:
        return
    with torch.no_grad():
        if len(tensors) == 1 and tensors[0].is_contiguous():
            transport.broadcast(tensors[0], src=0, group=group, name="init_params")
            return
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        transport.broadcast(flat, src=0, group=group, name="init_params")
        torch._foreach_copy_(
            list(tensors),
            [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)],
        )
