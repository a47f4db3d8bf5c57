"""The model's units, as the strategies and the planner take them: its repeated blocks and its layers.

* :func:`blocks` — every element of every outermost ``nn.ModuleList`` that holds parameters (a transformer's
  blocks): FSDP2's units (the root holds the rest), the per-block transformations (activation checkpointing,
  ``torch.compile``);
* :func:`layer_units` — the model's layers as groups of parameter indices (a layer's weight and bias together):
  what Streaming DiLoCo's strided fragments deal out.

Both read a model without changing it, so the planner's workload and the strategies cut it the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: every element of every ``nn.ModuleList`` that holds parameters (outermost
    lists only), in module order. The root is not included."""
    out: list[torch.nn.Module] = []
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and id(module) not in seen:
            for child in module:
                if any(True for _ in child.parameters()):
                    out.append(child)
                for sub in child.modules():
                    seen.add(id(sub))
    return out


def layer_units(model: torch.nn.Module, params: Sequence[torch.Tensor]) -> list[list[int]]:
    """The model's layers as groups of indices into ``params`` (a layer's weight and bias together).

    A **layer** is a child of the model's largest stack of layers -- the ``nn.ModuleList`` or
    ``nn.Sequential`` holding the most parameters (GPT-Neo's transformer blocks, an MLP's ``Sequential``) --
    or, for parameters outside that stack (embeddings, a final norm), the module that owns the parameter.
    Layers come in the order of their first parameter in ``model.parameters()``; parameters of ``params``
    owned by no module of ``model`` form one layer each, at the end.
    """
    index = {id(p): i for i, p in enumerate(params)}

    def owned(m: torch.nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    stacks = [m for m in model.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))]
    stack = max(stacks, key=owned, default=None)
    units: dict[int, list[int]] = {}  # key: id of the layer module
    owner: dict[int, int] = {}  # param id -> layer key
    if stack is not None:
        for child in stack.children():
            for p in child.parameters():
                owner.setdefault(id(p), id(child))
    # after the stack, and setdefault: its layers keep their parameters; only the rest go to their own module
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owner.setdefault(id(p), id(m))
    order: list[int] = []
    for p in model.parameters():
        if id(p) in index:
            key = owner[id(p)]
            if key not in units:
                units[key] = []
                order.append(key)
            units[key].append(index[id(p)])
    out = [sorted(units[k]) for k in order]
    seen = {i for u in out for i in u}
    out += [[i] for i in range(len(params)) if i not in seen]
    return out
