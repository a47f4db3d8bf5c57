"""What every ``--adapt`` controller of one whole-number knob keeps (DeMo's top-k, ACCO's/DPU's/WP's stage cap):
the knob in force, the step of its last change and its decision :class:`~.link_probe.Cadence`, checkpointed the
same way in the plain checkpoint and the logical one, so a run resumed after a change goes on with the adapted
knob and decides at the same events against the same reference. A checkpoint of a run without ``--adapt`` holds
none of it: the knob stays as configured."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .link_probe import Cadence
from .part import Part


class KnobController(Part):
    """Base of a one-knob controller: a subclass names its knob (:attr:`KNOB`), reads it (:attr:`value`) and sets
    it (:meth:`apply`); it sets :attr:`cadence` and measures and decides itself."""

    KNOB: ClassVar[str] = ""
    """The knob's key in a checkpoint (``adapt.<KNOB>`` in a logical one): the config field it re-picks."""

    changed_at: int = 0
    """The step of the last change (0: none)."""
    cadence: Cadence

    @property
    def value(self) -> int:
        """The knob in force."""
        raise NotImplementedError

    def apply(self, value: int) -> None:
        """Put ``value`` in force."""
        raise NotImplementedError

    def _take(self, value: int, changed_at: int) -> None:
        self.apply(int(value))
        self.changed_at = int(changed_at)

    def state_dict(self) -> dict[str, Any]:
        return {self.KNOB: self.value, "changed_at": self.changed_at, **self.cadence.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.KNOB in state:
            self._take(state[self.KNOB], state["changed_at"])
            self.cadence.load(state)

    def logical_state(self) -> dict[str, torch.Tensor]:
        return {f"adapt.{self.KNOB}": torch.tensor(self.value, dtype=torch.int64),
                "adapt.changed_at": torch.tensor(self.changed_at, dtype=torch.int64), **self.cadence.logical_state()}

    def logical_targets(self, saved: dict[str, Any]) -> dict[str, torch.Tensor]:
        keys = (f"adapt.{self.KNOB}", "adapt.changed_at")
        return {**{k: torch.zeros((), dtype=torch.int64) for k in keys if k in saved},
                **Cadence.logical_targets(saved)}

    def load_logical(self, filled: dict[str, torch.Tensor]) -> None:
        if f"adapt.{self.KNOB}" in filled:
            self._take(int(filled[f"adapt.{self.KNOB}"]), int(filled["adapt.changed_at"]))
            self.cadence.load_logical(filled)


__all__ = ["KnobController"]
