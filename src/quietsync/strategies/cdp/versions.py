"""Cyclic DP's version store (a part): each stage's live parameters and the previous version kept for the
micro-batches still in flight on it.

Stage ``j``'s parameters in the model are its **live** version θ^j_c (``c`` updates applied). An update
(:meth:`VersionStore.update`) never writes into a storage a pending forward or backward holds: the parameters get
a fresh copy that the optimizer steps, and the old storage becomes the kept **previous** version θ^j_{c−1}. So
at most two versions per stage exist, and a micro-batch's backward uses the version its forward used
(:meth:`VersionStore.tensors`). :meth:`VersionStore.committed` shows θ_steps on every stage (a stage updated past
it shows its previous version); :meth:`VersionStore.settle` makes that for good (the end of a run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..parts.part import Part


class VersionStore(Part):
    """The versions of every stage's owned, trainable parameters (see the module docstring).

    Args:
        owned: per stage, the trainable parameters it owns (a tied one belongs to the first stage using it).
    """

    def __init__(self, owned: list[list[nn.Parameter]]) -> None:
        self.owned = owned
        self.n = len(owned)
        self.live = [0] * self.n
        """Per stage: the version the model holds (updates applied)."""
        self.prev: list[tuple[int, list[torch.Tensor]] | None] = [None] * self.n
        """Per stage: ``(version, tensors)`` of the kept previous version, or None."""

    def tensors(self, j: int, v: int) -> list[torch.Tensor]:
        """The tensors of version ``v`` of stage ``j`` (live or kept); a version not here is a schedule bug."""
        if self.live[j] == v:
            return [p.data for p in self.owned[j]]
        if self.prev[j] is not None and self.prev[j][0] == v:
            return self.prev[j][1]
        raise RuntimeError(f"cdp: version {v} of stage {j} is not here (live {self.live[j]}, "
                           f"previous {self.prev[j][0] if self.prev[j] else None}) — schedule bug")

    def update(self, c: int, j: int, step: Callable[[], None]) -> None:
        """θ^j_{c+1} = ``step()`` applied to a fresh copy of θ^j_c; θ^j_c is kept as the previous version."""
        if self.live[j] != c:
            raise RuntimeError(f"cdp: update of cycle {c} for stage {j} at version {self.live[j]} — schedule bug")
        params = self.owned[j]
        kept = [p.data for p in params]
        with torch.no_grad():
            for p in params:
                p.data = p.data.clone()  # pending backwards keep the old storage: it becomes θ_c^j
        step()
        self.prev[j] = (c, kept)
        self.live[j] = c + 1

    def _behind(self, steps: int) -> Iterator[int]:
        """Stages updated past ``steps`` whose version ``steps`` is still kept."""
        return (j for j in range(self.n)
                if self.live[j] != steps and self.prev[j] is not None and self.prev[j][0] == steps)

    @contextmanager
    def committed(self, steps: int) -> Iterator[None]:
        """Within: every stage holds θ_steps (a stage updated past it shows its previous version)."""
        swapped = []
        for j in list(self._behind(steps)):
            for p, old in zip(self.owned[j], self.prev[j][1]):
                swapped.append((p, p.data))
                p.data = old
        try:
            yield
        finally:
            for p, cur in swapped:
                p.data = cur

    def settle(self, steps: int) -> None:
        """Every stage holds θ_steps for good: a stage updated past it goes back to its kept previous version."""
        for j in list(self._behind(steps)):
            for p, old in zip(self.owned[j], self.prev[j][1]):
                p.data = old
            self.live[j], self.prev[j] = steps, None

    def storages(self) -> set[int]:
        """Data pointers of the kept previous versions (the activation meter leaves parameters out)."""
        return {x.untyped_storage().data_ptr() for prev in self.prev if prev is not None for x in prev[1]}

    def memory_report(self) -> dict[str, int]:
        return {"previous_versions": sum(sum(x.numel() * x.element_size() for x in p[1]) for p in self.prev if p)}
