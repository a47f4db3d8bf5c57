"""Module buffers across replicas (a part every strategy holds): what is not a parameter but must still agree.

A model's buffers come in three kinds:

* **non-persistent** buffers (rotary ``inv_freq``, causal masks): recomputed from the configuration by every
  replica, not part of a checkpoint — nothing to do;
* **persistent** buffers (a ``state_dict`` entry): broadcast from the group's rank 0 when the strategy is built,
  like the parameters, so replicas start identical even when only rank 0 loaded a checkpoint;
* **running statistics**, the persistent buffers the forward pass itself updates in train mode
  (``running_mean``/``running_var``/``num_batches_tracked`` of BatchNorm- and InstanceNorm-style layers with
  ``track_running_stats``): each replica sees its own micro-batches, so they drift apart. :meth:`ModuleBuffers.sync`
  averages them over the group — one all-reduce, only for models that have them — which the strategy calls where
  its replicas agree on the parameters: at every committed step (zero1, fsdp, demo, flexdemo, acco, dpu, wp) or at
  every parameter sync (localsgd, diloco). ``ddp`` keeps torch DDP's own rule (rank 0's buffers broadcast before
  every forward); ``cdp`` refuses such a model, naming the buffer (its stages run different micro-batches at
  different times and it has no collective to average them with).

Averaging is exact for the running means (an exponential average is linear, so the mean of the replicas' is the
average of the per-step global means) and, for the running variances, the mean of the replicas' within-batch
variances. The running statistics are also saved in this part's checkpoint state, so a resumed run continues
with them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...transport import Transport
from .part import Part

RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")
"""Buffers a ``torch.nn.modules.batchnorm._NormBase`` layer with ``track_running_stats`` updates in forward."""


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every buffer in ``module``'s ``state_dict``, each tensor once."""
    out, seen = [], set()
    for prefix, m in module.named_modules():
        for name, t in m.named_buffers(recurse=False):
            if t is None or name in m._non_persistent_buffers_set or id(t) in seen:
                continue
            seen.add(id(t))
            out.append((f"{prefix}.{name}" if prefix else name, t))
    return out


def running_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the buffers the forward pass updates in train mode (see the module docstring)."""
    out = []
    for prefix, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            for name in RUNNING_STATS:
                t = getattr(m, name, None)
                if isinstance(t, torch.Tensor):
                    out.append((f"{prefix}.{name}" if prefix else name, t))
    return out


class ModuleBuffers(Part):
    """The buffers of ``module`` on one worker (see the module docstring).

    Args:
        module: the model.
        transport: the transport; ``group``: the group whose replicas must agree.
        broadcast: overwrite the persistent buffers with the group's rank 0's now.
    """

    def __init__(self, module: nn.Module, transport: Transport, group: str = "world", broadcast: bool = True) -> None:
        self.transport, self.group = transport, group
        self.running = running_buffers(module)
        """``(name, tensor)`` of the running statistics (empty for most models)."""
        if broadcast and transport.group_size(group) > 1:
            # one broadcast per dtype, so no buffer passes through another dtype on the wire
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for _, t in persistent_buffers(module):
                by_dtype.setdefault(t.dtype, []).append(t)
            with torch.no_grad():
                for dtype, tensors in by_dtype.items():
                    wire = torch.uint8 if dtype == torch.bool else dtype
                    flat = torch.cat([t.reshape(-1).to(wire) for t in tensors]).to(transport.device)
                    transport.broadcast(flat, src=0, group=group, name="init_buffers")
                    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                        t.copy_(part.view_as(t))

    @property
    def names(self) -> list[str]:
        """Names of the running statistics."""
        return [name for name, _ in self.running]

    def sync(self, group: str | None = None, from_rank0: bool = False) -> None:
        """Average the running statistics over ``group`` (default: the part's) — one all-reduce of them all, in
        float64, integer counts rounded back — or, ``from_rank0``, take the group's rank 0's (torch DDP's rule).
        Nothing happens for a model without running statistics or in a group of one."""
        group = self.group if group is None else group
        if not self.running or self.transport.group_size(group) == 1:
            return
        tensors = [t for _, t in self.running]
        with torch.no_grad():
            flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).to(self.transport.device)
            if from_rank0:
                self.transport.broadcast(flat, src=0, group=group, name="running_stats")
            else:
                self.transport.all_reduce(flat, group, op="avg", name="running_stats")
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                part = part.view_as(t)
                t.copy_(part.round() if not t.is_floating_point() else part)

    def state_dict(self) -> dict[str, Any]:
        return {name: t.detach().clone() for name, t in self.running}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, t in self.running:
                if name in state:
                    t.copy_(state[name])
