"""The part protocol: what a component a strategy holds may offer, declared once.

A strategy *holds* its parts (:meth:`~quietsync.strategies.base.Strategy.hold`) rather than inheriting them.
The
base strategy then treats every held part alike: it checkpoints it under its name, merges its position
counters into the strategy's :meth:`~quietsync.strategies.base.Strategy.position`, adds its buffers to
:meth:`~quietsync.strategies.base.Strategy.memory_report`, forgets its open round when a round is discarded,
and closes it with the strategy. :class:`Part` declares those methods with do-nothing defaults, so a part
overrides only what it has; nothing is looked up by name.
"""

from __future__ import annotations

from typing import Any


class Part:
    """Base class of everything a strategy holds (see the module docstring); every method is optional."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must keep of this part (empty: nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned."""

    def position(self) -> dict[str, int]:
        """Counters that place the part in the algorithm (checked equal across workers on resume)."""
        return {}

    def memory_report(self) -> dict[str, int]:
        """Bytes of each buffer the part holds."""
        return {}

    @property
    def round_full(self) -> bool | None:
        """For the part that counts the open round: whether the next step commits; None for other parts."""
        return None

    def discard(self) -> None:
        """Forget the open round's contribution (``Strategy.discard_round``)."""

    def close(self) -> None:
        """Stop background work and release resources (called once, in reverse order of holding)."""
