"""Streaming DiLoCo's fragments: the model's parameter tensors split into groups synced at staggered steps.

Two patterns (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", the fragment patterns):

* ``contiguous`` -- :func:`split_fragments`: consecutive parameter tensors, balanced by element count;
* ``strided`` -- :func:`strided_fragments` over :func:`layer_units`: whole layers, layer ``l`` in fragment
  ``l mod F``, so every fragment holds layers from the whole depth of the network.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...validate import check_int


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Indices of the tensors of each of ``fragments`` contiguous, non-empty fragments, balanced by element
    count (fragment k starts at the first tensor with at least k/F of all elements before it)."""
    check_int("fragments", fragments, 1, len(sizes))
    n, total = len(sizes), sum(sizes)
    before = [sum(sizes[:i]) for i in range(n)]
    bounds = [0]
    for k in range(1, fragments):
        b = next((i for i in range(n) if before[i] >= k * total / fragments), n)
        bounds.append(min(max(b, bounds[-1] + 1), n - (fragments - k)))
    bounds.append(n)
    return [list(range(bounds[k], bounds[k + 1])) for k in range(fragments)]


FRAGMENT_PATTERNS = ("contiguous", "strided")


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


def strided_fragments(units: list[list[int]], fragments: int) -> list[list[int]]:
    """Streaming DiLoCo's strided pattern: layer ``l`` goes to fragment ``l mod F`` (indices ascending)."""
    check_int("fragments", fragments, 1, len(units))
    return [sorted(i for u in units[f::fragments] for i in u) for f in range(fragments)]
